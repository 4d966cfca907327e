"""The random-weight checkpoint writer: what it writes loads through the normal paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from monokernel.models.config import ModelConfig, config_from_hf_dict, load_hf_config
from monokernel.models.shapes import SHAPES
from monokernel.weights.loader import load_checkpoint
from monokernel.weights.random_checkpoint import (
    BASE_VOCAB,
    ENDOFTEXT_ID,
    IM_END_ID,
    MARKER,
    checkpoint_config,
    hf_config_dict,
    main,
    write_random_checkpoint,
)

# Head counts that split over 2 ranks, small enough for a CPU test.
TINY = ModelConfig(
    family="qwen2",
    vocab_size=151936,  # replaced by the tokenizer's (padded) size below
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    qkv_bias=True,
)


@pytest.mark.parametrize("name", list(SHAPES))
def test_config_json_reads_back_for_every_shape(name: str) -> None:
    cfg = checkpoint_config(SHAPES[name])
    assert config_from_hf_dict(hf_config_dict(cfg)) == cfg
    assert cfg.vocab_size == SHAPES[name].vocab_size


def test_loads_and_generates_through_the_normal_path(tmp_path: Path) -> None:
    from monokernel.runtime.engine import Engine, EngineConfig
    from monokernel.runtime.sampling import SamplingParams

    out = tmp_path / "ckpt"
    written = write_random_checkpoint(out, TINY, seed=3, vocab_from_tokenizer=True)
    ckpt = load_checkpoint(out)
    cfg = ckpt.config
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.num_layers, cfg.hidden_size) == (4, 2, 2, 64)
    assert cfg.vocab_size == 320 and cfg.vocab_size >= BASE_VOCAB and cfg.vocab_size % 2 == 0
    assert (cfg.family, cfg.qkv_bias, cfg.tie_word_embeddings) == ("qwen2", True, True)
    assert set(ckpt.eos_token_ids) == {ENDOFTEXT_ID, IM_END_ID}
    assert set(ckpt.weights) == set(written)
    assert ckpt.weights["layers.1.wk"].dtype == torch.bfloat16
    assert torch.equal(ckpt.weights["layers.1.wk"], written["layers.1.wk"])
    assert torch.equal(ckpt.weights["embed"], written["embed"])
    assert not ckpt.weights["embed"][ENDOFTEXT_ID : IM_END_ID + 1].any()

    engine = Engine(out, EngineConfig(engine="reference", device="cpu", progress=False))
    try:
        assert engine.tokenizer.vocab_size == cfg.vocab_size
        assert engine.encode("hé") == list("hé".encode())  # ids 0-255 are the bytes
        for prompt in ("def fib(n):", [{"role": "user", "content": "hi"}]):
            ids = engine.encode(prompt)
            events = list(engine.generate(prompt, SamplingParams(max_tokens=5), prompt_ids=ids))
            tokens = [e.token_id for e in events if e.token_id is not None]
            assert len(tokens) == 5 and all(0 <= t < cfg.vocab_size for t in tokens)
            assert events[-1].finish_reason == "length"
            assert isinstance("".join(e.text for e in events), str)
    finally:
        engine.close()


def test_cli_writes_a_named_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "odd"
    assert main([str(out), "--shape", "odd", "--vocab-from-tokenizer", "--seed", "1"]) == 0
    assert "valid --tp sizes: 1" in capsys.readouterr().out
    cfg = load_hf_config(out)
    shape = SHAPES["odd"]
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (5, 1, 104)
    assert (cfg.qk_norm, cfg.o_bias, cfg.tie_word_embeddings) == (True, True, False)
    assert cfg.vocab_size == 320 != shape.vocab_size
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert (out / MARKER).is_file() and (out / "tokenizer.json").is_file()
    # Written by this tool: writing again over it is allowed.
    assert main([str(out), "--shape", "odd", "--vocab-from-tokenizer"]) == 0


def test_unknown_shape_lists_the_known_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "x"), "--shape", "gpt-17"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown shape 'gpt-17'" in err and "qwen2.5-coder-1.5b" in err
    assert not (tmp_path / "x").exists()


def test_refuses_a_foreign_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    assert main([str(tmp_path), "--shape", "odd", "--vocab-from-tokenizer"]) == 1
    assert "not empty" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
