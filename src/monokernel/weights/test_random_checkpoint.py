"""The random-weight checkpoint writer: what it writes loads through the normal paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from monokernel.models.config import ModelConfig, config_from_hf_dict, load_hf_config
from monokernel.models.shapes import DENSE_SHAPES
from monokernel.weights.loader import load_checkpoint
from monokernel.weights.names import expected_shapes
from monokernel.weights.random_checkpoint import (
    BASE_VOCAB,
    DEFAULT_SHARD_BYTES,
    ENDOFTEXT_ID,
    IM_END_ID,
    MARKER,
    checkpoint_config,
    hf_config_dict,
    hf_order,
    main,
    parse_size,
    plan_shards,
    write_random_checkpoint,
)
from monokernel.weights.safetensors_loader import INDEX_FILE, SINGLE_FILE

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


@pytest.mark.parametrize("name", list(DENSE_SHAPES))
def test_config_json_reads_back_for_every_shape(name: str) -> None:
    cfg = checkpoint_config(DENSE_SHAPES[name])
    assert config_from_hf_dict(hf_config_dict(cfg)) == cfg
    assert cfg.vocab_size == DENSE_SHAPES[name].vocab_size


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
    shape = DENSE_SHAPES["odd"]
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


def test_an_8b_shape_shards_as_transformers_shards_it() -> None:
    """Llama-3.1-8B's real checkpoint is 4 shards of at most 5 GB; planned without
    allocating a byte, ours is too."""
    cfg = checkpoint_config(DENSE_SHAPES["llama-3.1-8b"])
    shapes = expected_shapes(cfg)
    sizes = [(n, 2 * torch.Size(shapes[n]).numel()) for n in sorted(shapes, key=hf_order)]
    shards = plan_shards(sizes, DEFAULT_SHARD_BYTES)
    assert len(shards) == 4
    assert shards[0][0] == "embed" and shards[-1][-2:] == ["norm", "lm_head"]
    per_shard = [sum(dict(sizes)[n] for n in names) for names in shards]
    assert max(per_shard) <= DEFAULT_SHARD_BYTES
    assert 16.0e9 < sum(per_shard) < 16.1e9


def test_plan_shards() -> None:
    assert plan_shards([("a", 2), ("b", 2), ("c", 2)], 5) == [["a", "b"], ["c"]]
    # A tensor over the limit gets a shard of its own rather than an error.
    assert plan_shards([("a", 2), ("big", 9), ("c", 1)], 5) == [["a"], ["big"], ["c"]]
    assert plan_shards([("a", 2), ("b", 3)], 5) == [["a", "b"]]


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("5GB", 5 * 10**9),
        ("500MB", 5 * 10**8),
        ("2GiB", 2 * 2**30),
        ("1000", 1000),
        ("1.5kB", 1500),
    ],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["5 parsecs", "", "0", "GB"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_writes_shards_with_an_index_then_one_file(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    shard_bytes = 20_000
    written = write_random_checkpoint(
        out, TINY, vocab_from_tokenizer=True, shard_bytes=shard_bytes, seed=2
    )
    index = json.loads((out / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 1 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (out / SINGLE_FILE).exists()
    total = 0
    for f in files:
        tensors = load_file(out / f)  # the safetensors library reads what we wrote
        assert {h for h, g in index["weight_map"].items() if g == f} == set(tensors)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= shard_bytes or len(tensors) == 1
        total += size
    assert index["metadata"]["total_size"] == total
    ckpt = load_checkpoint(out, progress=False)
    assert all(torch.equal(ckpt.weights[k], v) for k, v in written.items())

    # Rewritten in one file: the earlier shards and their index go.
    write_random_checkpoint(out, TINY, vocab_from_tokenizer=True, seed=2)
    assert sorted(p.name for p in out.glob("*.safetensors")) == [SINGLE_FILE]
    assert not (out / INDEX_FILE).exists()


def test_transformers_reads_the_shards(tmp_path: Path) -> None:
    """The shards are a real HF checkpoint, not only one our loader accepts."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ckpt"
    written = write_random_checkpoint(out, TINY, vocab_from_tokenizer=True, shard_bytes=50_000)
    assert len(list(out.glob("*.safetensors"))) > 2
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert torch.equal(model.model.layers[1].self_attn.k_proj.weight, written["layers.1.wk"])
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, written["layers.0.w_down"])


def test_cli_shard_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "odd"
    args = [str(out), "--shape", "odd", "--vocab-from-tokenizer", "--shard-size", "4MB"]
    assert main(args) == 0
    assert "(17.7 MB in 6 shards" in capsys.readouterr().out
    assert len(json.loads((out / INDEX_FILE).read_text())["weight_map"]) == len(
        expected_shapes(load_hf_config(out))
    )
    with pytest.raises(SystemExit):
        main([str(out), "--shape", "odd", "--shard-size", "lots"])
    assert "--shard-size" in capsys.readouterr().err
