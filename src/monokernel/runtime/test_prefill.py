"""The chunked prefill against the reference forward, on the CPU: every family's features,
every precision, chunking and start offsets (the GPU runs the same code with cuBLAS and
flash attention; backends/test_prefill.py checks it there)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from monokernel.models.config import ModelConfig, RopeScaling
from monokernel.models.shapes import SHAPES
from monokernel.models.transformer import KVCache, Transformer
from monokernel.runtime.prefill import (
    PRECISIONS,
    Prefiller,
    gemm_bf16,
    gemm_fp32,
    gemm_parts,
    workspace_bytes,
)
from monokernel.runtime.prefill_ops import bf16_parts
from monokernel.weights.quantize import fake_quantize
from monokernel.weights.random_weights import random_weights
from monokernel.weights.repack import repack

_BASE = ModelConfig(
    family="llama",
    vocab_size=301,
    hidden_size=96,
    intermediate_size=136,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
CONFIGS: dict[str, ModelConfig] = {
    "llama3-scaled": dataclasses.replace(
        _BASE, rope_theta=500000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64)
    ),
    "llama-tied-bias": dataclasses.replace(
        _BASE, tie_word_embeddings=True, qkv_bias=True, o_bias=True
    ),
    "qwen2": dataclasses.replace(_BASE, family="qwen2", qkv_bias=True, num_kv_heads=1),
    "qwen3": dataclasses.replace(_BASE, family="qwen3", qk_norm=True, head_dim=24),
    "mha": dataclasses.replace(_BASE, num_kv_heads=6),
    "odd": SHAPES["odd"],
}


def _tokens(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _reference(
    cfg: ModelConfig, weights: dict, tokens: torch.Tensor
) -> tuple[torch.Tensor, KVCache]:
    ref = Transformer(cfg, {k: v.float() for k, v in weights.items()}, tokens.shape[0])
    cache = ref.new_cache(tokens.shape[0])
    return ref.forward(tokens, 0, cache), cache  # [T, V], fp32 K/V


def _prefiller(
    cfg: ModelConfig, weights: dict, max_len: int, dtype: torch.dtype, **kw: object
) -> Prefiller:
    packed = repack(cfg, weights, max_len, fold=bool(kw.pop("fold", False)))
    cache = KVCache.allocate(cfg, max_len, dtype, "cpu")
    return Prefiller(cfg, packed, cache.k, cache.v, **kw)  # type: ignore[arg-type]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fp32_prefill_is_the_reference_forward(name: str) -> None:
    """fp32 weights, fp32 cache, fp32 precision: the same function as the reference, so the
    logits and every cached key and value agree to fp32 rounding."""
    cfg = CONFIGS[name]
    weights = random_weights(cfg, dtype=torch.float32, seed=1)
    tokens = _tokens(70, cfg.vocab_size)
    want, ref_cache = _reference(cfg, weights, tokens)
    pf = _prefiller(cfg, weights, 80, torch.float32, precision="fp32", chunk_tokens=32)
    got = pf.run(tokens, 0, logits=True)
    assert got is not None and got.shape == (cfg.vocab_size,)
    assert _rel(got, want[-1]) < 1e-5
    assert _rel(pf.k[:, :, :70], ref_cache.k) < 1e-5
    assert _rel(pf.v[:, :, :70], ref_cache.v) < 1e-5
    assert not pf.k[:, :, 70:].any(), "wrote past the prompt"


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_a_quantised_prefill_is_the_reference_on_the_dequantised_weights(fmt: str) -> None:
    """Packed in a 1-byte format (--quantize), the fp32 prefill multiplies by the stored
    values and scales the outputs; in int4, by the dequantised groups: the reference forward
    on fake_quantize's weights, to fp32 rounding, on a shape whose rows are whole loads."""
    sizes = {"hidden_size": 528, "intermediate_size": 1424, "num_heads": 5, "head_dim": 112}
    if fmt == "int4":  # whole 32-column groups
        sizes = {"hidden_size": 640, "intermediate_size": 1408, "num_heads": 7, "head_dim": 96}
    cfg = dataclasses.replace(SHAPES["odd"], **sizes)
    weights = random_weights(cfg, dtype=torch.float32, seed=3)
    tokens = _tokens(40, cfg.vocab_size, seed=4)
    want, ref_cache = _reference(cfg, fake_quantize(weights, fmt), tokens)
    packed = repack(cfg, weights, 48, fold=False, fmt=fmt)
    assert packed.layers[0].matrices["wqkv"].format == fmt
    assert packed.matrices["lm_head"].format == "bf16"
    cache = KVCache.allocate(cfg, 48, torch.float32, "cpu")
    pf = Prefiller(cfg, packed, cache.k, cache.v, precision="fp32", chunk_tokens=16)
    got = pf.run(tokens, 0, logits=True)
    assert got is not None
    assert _rel(got, want[-1]) < 1e-5
    assert _rel(pf.k[:, :, :40], ref_cache.k) < 1e-5


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bf16_prefill_close_to_the_reference(name: str, precision: str) -> None:
    cfg = CONFIGS[name]
    weights = random_weights(cfg, seed=2)  # bf16, as the kernel has them
    tokens = _tokens(90, cfg.vocab_size, seed=1)
    want, _ = _reference(cfg, weights, tokens)
    pf = _prefiller(cfg, weights, 96, torch.bfloat16, precision=precision)
    got = pf.run(tokens, 0, logits=True)
    assert got is not None
    assert _rel(got, want[-1]) < 1e-2


@pytest.mark.parametrize("precision", PRECISIONS)
def test_chunks_and_start_offsets_give_the_same_cache(precision: str) -> None:
    """Whole, in chunks of 1 and 13, and in two calls (the second starting where the first
    ended, as prefix reuse does): the same K/V and logits, up to summation order. With bf16
    GEMM inputs a last-bit difference of the sums can flip an activation's rounding to bf16
    (a 2^-8 step), so those agree to ~1e-4, not to fp32 rounding."""
    tol = 1e-5 if precision == "fp32" else 2e-3
    cfg = CONFIGS["qwen3"]
    weights = random_weights(cfg, seed=3)
    tokens = _tokens(50, cfg.vocab_size, seed=2)
    whole = _prefiller(cfg, weights, 64, torch.float32, precision=precision)
    want = whole.run(tokens, 0, logits=True)
    assert want is not None
    for chunk in (1, 13):
        pf = _prefiller(cfg, weights, 64, torch.float32, precision=precision, chunk_tokens=chunk)
        got = pf.run(tokens, 0, logits=True)
        assert got is not None and _rel(got, want) < tol
        assert _rel(pf.k, whole.k) < tol and _rel(pf.v, whole.v) < tol
    pf = _prefiller(cfg, weights, 64, torch.float32, precision=precision, chunk_tokens=8)
    assert pf.run(tokens[:21], 0) is None
    got = pf.run(tokens[21:], 21, logits=True)
    assert got is not None and _rel(got, want) < tol
    assert _rel(pf.k, whole.k) < tol and _rel(pf.v, whole.v) < tol


def test_folded_gains_match_too() -> None:
    cfg = CONFIGS["llama-tied-bias"]
    weights = random_weights(cfg, dtype=torch.float32, seed=4)
    tokens = _tokens(20, cfg.vocab_size, seed=3)
    want, _ = _reference(cfg, weights, tokens)
    pf = _prefiller(cfg, weights, 20, torch.float32, precision="fp32", fold=True)
    got = pf.run(tokens, 0, logits=True)
    assert got is not None and _rel(got, want[-1]) < 1e-5


def test_gemm_precisions() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 256, generator=gen)
    w = torch.randn(64, 256, generator=gen).to(torch.bfloat16)
    exact = x.double() @ w.double().t()
    products = {
        "bf16": gemm_bf16(x, w),
        "split": gemm_parts(bf16_parts(x, split=True), w),
        "fp32": gemm_fp32(x, w),
    }
    err = {k: float((v.double() - exact).norm() / exact.norm()) for k, v in products.items()}
    assert err["fp32"] < 1e-6
    assert err["split"] < 1e-4  # ~16 mantissa bits of x
    assert 5e-4 < err["bf16"] < 1e-2  # x rounded to 8 bits
    assert all(v.dtype == torch.float32 for v in products.values())


def test_refuses_bad_arguments() -> None:
    cfg = CONFIGS["mha"]
    pf = _prefiller(cfg, random_weights(cfg), 16, torch.bfloat16)
    with pytest.raises(ValueError, match="exceeds the cache"):
        pf.run(_tokens(10, cfg.vocab_size), 8)
    with pytest.raises(ValueError, match="at least one token"):
        pf.run([], 0)
    with pytest.raises(ValueError, match="precision"):
        _prefiller(cfg, random_weights(cfg), 16, torch.bfloat16, precision="fp8")
    with pytest.raises(ValueError, match="chunk_tokens"):
        _prefiller(cfg, random_weights(cfg), 16, torch.bfloat16, chunk_tokens=0)


def test_workspace_grows_with_chunk_and_context() -> None:
    cfg = SHAPES["llama-3.2-1b"]
    small = workspace_bytes(cfg, 512, 8192, "split-qkv")
    assert workspace_bytes(cfg, 2048, 8192, "split-qkv") > small
    assert workspace_bytes(cfg, 512, 65536, "split-qkv") > small
    assert workspace_bytes(cfg, 512, 8192, "fp32") > small
    # A 2048-token chunk of the 1B model stays in the hundreds of MB.
    assert workspace_bytes(cfg, 2048, 8192, "split-qkv") < 1 << 30


@pytest.mark.parametrize("name", ["qwen3", "mha", "llama-tied-bias"])
def test_chunk_at_device_positions_matches_the_sliced_chunk(name: str) -> None:
    """The graph-friendly form (positions as a tensor, a fixed number of cache rows under a
    mask, padding rows after the real ones) computes what the sliced form computes for the
    real rows: the suffix of a turn after a prefix already in the cache."""
    cfg = CONFIGS[name]
    weights = random_weights(cfg, dtype=torch.float32, seed=3)
    tokens = _tokens(40, cfg.vocab_size, seed=4)
    start, t, bucket, keys = 25, 15, 16, 64  # one padding row; rows [41, 64) unread
    sliced = _prefiller(cfg, weights, 128, torch.float32, precision="fp32")
    placed = _prefiller(cfg, weights, 128, torch.float32, precision="fp32")
    for p in (sliced, placed):
        p.run(tokens[:start], 0)
    want = sliced._chunk(tokens[start:], start)
    padded = torch.cat((tokens[start:], torch.zeros(bucket - t, dtype=torch.long)))
    pos = torch.arange(start, start + bucket)
    got = placed._chunk_at(padded, pos, keys)[:t]
    assert _rel(got, want) < 1e-5
    assert _rel(placed.k[:, :, : start + t], sliced.k[:, :, : start + t]) < 1e-5
    assert _rel(placed.v[:, :, : start + t], sliced.v[:, :, : start + t]) < 1e-5


def test_workspace_counts_a_dense_copy_only_of_what_is_not_read_in_place() -> None:
    """A quantised layer format adds the bf16 copy of the largest layer matrix (gate/up on
    the 8B shape); the LM head's [V, H] counts only where its own format is not read in place
    (a bf16 head, as every --quantize keeps it, is multiplied where it lies)."""
    cfg = SHAPES["llama-3.1-8b"]
    h, gate_up = cfg.hidden_size, 2 * cfg.intermediate_size * cfg.hidden_size
    bf16 = workspace_bytes(cfg, 512, 4096, "split-qkv")
    assert workspace_bytes(cfg, 512, 4096, "split-qkv", "int4") - bf16 == 2 * gate_up
    assert workspace_bytes(cfg, 512, 4096, "split-qkv", "fp8") - bf16 == 2 * gate_up
    head = workspace_bytes(cfg, 512, 4096, "split-qkv", "int4", head_fmt="fp8")
    assert head - bf16 == 2 * cfg.vocab_size * h
    # fp32 mode's copy of the largest matrix is the head's whatever its format.
    fp32 = workspace_bytes(cfg, 512, 4096, "fp32", "int4")
    assert fp32 - workspace_bytes(cfg, 512, 4096, "fp32") == 2 * gate_up
