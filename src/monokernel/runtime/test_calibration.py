"""--quantize int4's input statistics (runtime/calibration.py): what they are on a tiny random
model, against a forward written out here; that they are deterministic; how a rank slices
them; the calibration text; and that every engine's int4 weights are searched with the
same ones (CPU only)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F

from monokernel.models.config import ModelConfig
from monokernel.models.rope import apply_rope, rope_tables
from monokernel.models.transformer import rms_norm
from monokernel.runtime import backends
from monokernel.runtime.calibration import (
    CALIBRATION_PARTS,
    activation_stats,
    calibration_ids,
    calibration_stats,
    shard_stats,
)
from monokernel.runtime.perplexity import read_text
from monokernel.weights.quantize import LINEAR_NAMES, config_format, fake_quantize
from monokernel.weights.random_weights import random_weights
from monokernel.weights.repack import repack

# int4-sized (every input a multiple of 32: groups of 32), GQA, two layers.
CFG = ModelConfig(
    family="llama",
    vocab_size=211,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return random_weights(CFG, dtype=torch.float32, seed=4, logit_scale=4.0)


def _ids(n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist()


def _layer0_inputs(w: dict[str, torch.Tensor], ids: list[int]) -> dict[str, torch.Tensor]:
    """Layer 0's four matrix inputs [T, cols] for one window, in float64 from the weights:
    the attention norm's output (Q, K, V), the attention's output (O), the MLP norm's output
    (gate, up) and silu(gate) * up (down)."""
    d = {k: v.double() for k, v in w.items()}
    t, h, dh = len(ids), CFG.num_heads, CFG.head_dim
    x = d["embed"][torch.tensor(ids)]
    a = rms_norm(x, d["layers.0.attn_norm"], CFG.rms_norm_eps)
    q = (a @ d["layers.0.wq"].T).view(t, h, dh)
    k = (a @ d["layers.0.wk"].T).view(t, CFG.num_kv_heads, dh)
    v = (a @ d["layers.0.wv"].T).view(t, CFG.num_kv_heads, dh)
    cos, sin = rope_tables(CFG, t, torch.device("cpu"))
    q, k = apply_rope(q, cos.double(), sin.double()), apply_rope(k, cos.double(), sin.double())
    rep = h // CFG.num_kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / dh**0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, h * dh)
    x = x + o @ d["layers.0.wo"].T
    m = rms_norm(x, d["layers.0.ffn_norm"], CFG.rms_norm_eps)
    down = F.silu(m @ d["layers.0.w_gate"].T) * (m @ d["layers.0.w_up"].T)
    return {"wq": a, "wo": o, "w_gate": m, "w_down": down}


def test_stats_are_the_mean_squares_of_each_matrix_input(weights: dict[str, torch.Tensor]) -> None:
    ids = _ids(37)
    stats = activation_stats(CFG, weights, ids, window=16)  # windows of 16, 16 and 5
    sums: dict[str, torch.Tensor] = {}
    for start in range(0, 37, 16):
        for m, x in _layer0_inputs(weights, ids[start : start + 16]).items():
            sums[m] = sums.get(m, 0) + (x * x).sum(0)
    for m, total in sums.items():
        assert torch.allclose(stats[f"layers.0.{m}"].double(), total / 37, rtol=1e-5)


def test_stats_shapes_sharing_and_determinism(weights: dict[str, torch.Tensor]) -> None:
    ids = _ids(50, seed=1)
    a, b = activation_stats(CFG, weights, ids, window=32), activation_stats(CFG, weights, ids, 32)
    cols = {"wo": CFG.q_size, "w_down": CFG.intermediate_size}
    assert set(a) == {f"layers.{n}.{m}" for n in range(CFG.num_layers) for m in LINEAR_NAMES}
    for name, s in a.items():
        m = name.rsplit(".", 1)[-1]
        assert s.dtype == torch.float32 and s.device.type == "cpu"
        assert tuple(s.shape) == (cols.get(m, CFG.hidden_size),)
        assert bool((s > 0).all()) and torch.equal(s, b[name])
    for n in range(CFG.num_layers):
        p = f"layers.{n}."
        assert torch.equal(a[p + "wk"], a[p + "wq"]) and torch.equal(a[p + "wv"], a[p + "wq"])
        assert torch.equal(a[p + "w_up"], a[p + "w_gate"])
    # bf16 weights are read as float32 one tensor at a time: the same as their float32 copy.
    half = {k: v.bfloat16() for k, v in weights.items()}
    widened = {k: v.float() for k, v in half.items()}
    c = activation_stats(CFG, half, ids, window=32)
    assert all(torch.equal(c[k], v) for k, v in activation_stats(CFG, widened, ids, 32).items())


def test_a_rank_slices_the_column_split_inputs() -> None:
    stats = {
        f"layers.0.{m}": torch.arange(c, dtype=torch.float32)
        for m, c in (("wq", 64), ("wk", 64), ("wv", 64), ("wo", 64), ("w_gate", 64))
    }
    stats |= {"layers.0.w_up": torch.arange(64.0), "layers.0.w_down": torch.arange(96.0)}
    one = shard_stats(CFG, stats, 1, 2)
    assert torch.equal(one["layers.0.wo"], torch.arange(32.0, 64.0))  # heads 2, 3
    assert torch.equal(one["layers.0.w_down"], torch.arange(48.0, 96.0))
    for m in ("wq", "wk", "wv", "w_gate", "w_up"):  # split by row: the whole input
        assert one[f"layers.0.{m}"] is stats[f"layers.0.{m}"]


def test_the_calibration_text_is_its_own() -> None:
    text = read_text(CALIBRATION_PARTS)
    first = text.splitlines()[0]
    assert "calibration" in first.lower() and "CC0" in first
    assert 12_000 < len(text) < 40_000
    ours, theirs = set(text.splitlines()[1:]), set(read_text().splitlines())
    assert not {line for line in ours & theirs if len(line) > 40}  # no shared passages


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_the_monokernels_packing_is_the_other_engines_values(
    weights: dict[str, torch.Tensor], method: str
) -> None:
    """repack (the monokernel, its QKV and gate/up fused) with the statistics packs the values
    fake_quantize (the reference and torch engines) gives with them; int4's differ from the
    plain search's, int8 (rows, unweighted) ignores them."""
    stats = activation_stats(CFG, weights, _ids(40), window=20)
    fake = fake_quantize(weights, method, stats=stats)
    plain = fake_quantize(weights, method)
    packed = repack(CFG, dict(weights), 64, fold=False, fmt=method, act_stats=stats)
    fmt = config_format(method, CFG)
    for n, layer in enumerate(packed.layers):
        p = f"layers.{n}."
        qkv = torch.cat([fake[p + m] for m in ("wq", "wk", "wv")])
        gu = torch.stack((fake[p + "w_gate"], fake[p + "w_up"]), dim=1).flatten(0, 1)
        want = {"wqkv": qkv, "wo": fake[p + "wo"], "wgu": gu, "wdown": fake[p + "w_down"]}
        for k, v in want.items():
            assert layer.matrices[k].format == method
            assert torch.equal(fmt.dense(layer.matrices[k], torch.float32), v), (n, k)
    differ = any(not torch.equal(fake[k], plain[k]) for k in fake if k.startswith("layers."))
    assert differ == (method == "int4")


class _Recording:
    """A backend that records what it was built with."""

    name = "recording"
    got: ClassVar[dict[str, Any]] = {}

    def __init__(
        self, cfg: object, weights: object, max_seq_len: int, device: object, **kw: object
    ) -> None:
        _Recording.got = {"weights": weights, **kw}


@pytest.mark.parametrize("engine", ["monokernel", "reference", "torch"])
def test_every_engine_gets_the_same_statistics(
    monkeypatch: pytest.MonkeyPatch, weights: dict[str, torch.Tensor], engine: str
) -> None:
    monkeypatch.setitem(backends.BACKEND_CLASSES, engine, (__name__, "_Recording"))
    stats = activation_stats(CFG, weights, _ids(20), window=20)
    backends.construct_backend(
        engine, CFG, weights, 64, torch.device("cpu"), quantize="int4", act_stats=stats
    )
    if engine == "monokernel":  # packs them itself (repack)
        assert _Recording.got["act_stats"] is stats and _Recording.got["quantize"] == "int4"
        return
    got = _Recording.got["weights"]
    want = fake_quantize(weights, "int4", stats=stats)
    assert all(torch.equal(got[k], v) for k, v in want.items())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from monokernel.weights.random_checkpoint import write_random_checkpoint

    out = tmp_path_factory.mktemp("calib") / "ckpt"
    write_random_checkpoint(
        out, dataclasses.replace(CFG, num_layers=1), seed=6, vocab_from_tokenizer=True
    )
    yield out


def test_the_engine_calibrates_int4_once_for_its_backend(checkpoint: Path) -> None:
    """Engine(quantize="int4") on float weights: the reference's matrices are fake_quantize's
    with the statistics over the calibration text, not the plain search's."""
    from monokernel.runtime.engine import Engine, EngineConfig
    from monokernel.tokenizer.tokenizer import Tokenizer
    from monokernel.weights.loader import load_checkpoint

    config = EngineConfig(engine="reference", device="cpu", quantize="int4", progress=False)
    engine = Engine(checkpoint, config)
    ckpt = load_checkpoint(checkpoint, progress=False)
    w = {k: v.float() for k, v in ckpt.weights.items()}
    tokenizer = Tokenizer.load(ckpt.tokenizer_dir, ckpt.gguf_file)
    assert len(calibration_ids(tokenizer)) > 2_000
    stats = calibration_stats(ckpt.config, w, tokenizer)
    want, plain = fake_quantize(w, "int4", stats=stats), fake_quantize(w, "int4")
    got = engine.backend.model.w  # type: ignore[attr-defined]
    assert torch.equal(got["layers.0.w_down"], want["layers.0.w_down"])
    assert not torch.equal(got["layers.0.w_down"], plain["layers.0.w_down"])


def test_a_ranks_blocks_quantise_as_the_whole_model() -> None:
    """What the tensor-parallel backend does for --quantize int4 (tp.py): each rank's blocks
    of the matrices (weights/shard.py), searched with its slice of the statistics, are the
    whole matrices' groups split as shard_groups splits a checkpoint's."""
    from monokernel.weights.group_quant import quantize_rtn
    from monokernel.weights.shard import shard_groups, shard_weights

    cfg = dataclasses.replace(CFG, intermediate_size=128)  # 64 a rank: whole groups of 32
    weights = random_weights(cfg, dtype=torch.float32, seed=5)
    stats = activation_stats(cfg, weights, _ids(30), window=30)
    names = list(stats)
    whole = {k: quantize_rtn(weights[k].bfloat16(), 32, stats[k]) for k in names}
    for r in range(2):
        dense, act = shard_weights(cfg, weights, r, 2), shard_stats(cfg, stats, r, 2)
        want = shard_groups(cfg, whole, r, 2)
        for k in names:
            got = quantize_rtn(dense[k].bfloat16(), 32, act[k])
            assert torch.equal(got.q, want[k].q), (r, k)
            assert torch.equal(got.scale, want[k].scale) and torch.equal(got.offset, want[k].offset)
