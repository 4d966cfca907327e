"""GPU prefill (cuBLAS + flash attention) against the fp32 reference, and decode after a long
prefill: logits at 1 and >4,000 prompt tokens, the backend's reuse path, teacher-forced
decode at a 16k context, the cache-sizing refusal.

Shapes: real head dims and widths, 2 layers (the odd shape: all its 3), so the fp32
reference stays quick at long context. Marker ``gpu``; the backend tests need Hopper.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from monokernel.errors import InvalidRequestError
from monokernel.models.config import ModelConfig
from monokernel.models.shapes import SHAPES
from monokernel.models.transformer import KVCache, Transformer
from monokernel.runtime.prefill import PRECISIONS, Prefiller
from monokernel.runtime.prefill_attention import (
    flash_cache_attention,
    flash_cache_attention_ok,
    flash_split_ok,
    sdpa_case,
)
from monokernel.runtime.prefill_attention_triton import (
    BLOCKS,
    HEAD_DIMS,
    triton_attention_ok,
    triton_cache_attention,
)
from monokernel.runtime.prefill_graphs import graph_keys
from monokernel.testing.gpu_models import needs_hopper
from monokernel.weights.names import Weights
from monokernel.weights.random_weights import random_weights
from monokernel.weights.repack import repack

LONG = 4100  # > 2 chunks of 2048: the bottom-right causal path runs too
TRITON_CONFIGS = (BLOCKS, (128, 64, 8, 3))  # the default and one other block shape


def _cfg(shape: str, full: bool = False) -> ModelConfig:
    cfg = SHAPES[shape]
    return cfg if full or shape == "odd" else dataclasses.replace(cfg, num_layers=2)


@functools.lru_cache(maxsize=1)
def _weights(shape: str, full: bool = False) -> Weights:
    return random_weights(_cfg(shape, full), device="cuda", seed=11)


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(cfg: ModelConfig, weights: Weights, tokens: list[int], chunk: int = 1024):
    """fp32 reference over ``tokens`` in chunks (each attends to the cached prefix, which is
    the same function as one pass); returns the model and its cache for more tokens."""
    ref = Transformer(cfg, {k: v.float() for k, v in weights.items()}, len(tokens) + 64)
    cache = ref.new_cache(len(tokens) + 64)
    ids = torch.tensor(tokens, device="cuda")
    last = None
    for a in range(0, len(tokens), chunk):
        last = ref.forward(ids[a : a + chunk], a, cache, last_only=True)[0]
    return ref, cache, last


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(32, 8, 64), (12, 2, 128), (5, 1, 104)])
@pytest.mark.parametrize(("start", "t"), [(0, 1), (0, 300), (1000, 37), (4093, 512)])
@pytest.mark.parametrize("form", ["flash", "flash-split", "triton"])
def test_attention_on_the_cache_matches_sdpa(
    heads: int, kv_heads: int, d: int, start: int, t: int, form: str
) -> None:
    """Attention read straight from the cache layout [kv_heads, max_len, d] with the key
    count on the device (what prefill and its graphs use on an H100) against SDPA's math on
    sliced, GQA-expanded fp32 copies: same function, so only bf16 rounding apart. Forms:
    FlashAttention-2; FA2 with the keys before the queries in 5 chunks (empty ones where
    start < 5) merged with the causal block by log-sum-exp; the Triton kernel (head_dim 64
    and 128), with its default blocks and another shape of them."""
    dev = torch.device("cuda")
    assert flash_cache_attention_ok(dev), "prefill would fall back to the slower SDPA path"
    assert flash_split_ok(dev), "turn prefill would run on fewer SMs than the GPU has"
    if form == "triton" and d not in HEAD_DIMS:
        pytest.skip(f"the Triton kernel takes head_dim {HEAD_DIMS}")
    if form == "triton":
        assert triton_attention_ok(dev, d), "prefill would fall back to FA2"
    q, k, v, used, want = sdpa_case(dev, heads, kv_heads, d, start, t, 4800, seed=start + t)
    end = start + t
    if form == "triton":
        runs = [triton_cache_attention(q, k, v, used, *c) for c in TRITON_CONFIGS]
    else:
        runs = [flash_cache_attention(q, k, v, used, 5 if form == "flash-split" else 1)]
    for got in runs:
        rel = _rel(got.float(), want)
        print(f"{form} on the cache, {heads}/{kv_heads} heads, d {d}, [{start}, {end}): {rel:.1e}")
        assert rel < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, LONG])
@pytest.mark.parametrize("shape", ["llama-3.2-1b", "qwen2.5-coder-1.5b", "odd"])
def test_prefill_logits_match_reference(shape: str, n: int) -> None:
    cfg, weights = _cfg(shape), _weights(shape)
    tokens = _tokens(n, cfg.vocab_size, seed=1)
    _, _, want = _reference(cfg, weights, tokens)
    packed = repack(cfg, weights, n, fold=False)
    for precision in PRECISIONS if n == LONG and shape == "llama-3.2-1b" else ("split-qkv",):
        cache = KVCache.allocate(cfg, n, torch.bfloat16, "cuda")
        got = Prefiller(  # chunks of 2048, so LONG also runs the bottom-right causal path
            cfg, packed, cache.k, cache.v, chunk_tokens=2048, precision=precision
        ).run(tokens, 0, logits=True)
        assert got is not None and torch.isfinite(got).all()
        rel = _rel(got, want)
        print(f"{shape} n={n} {precision}: prefill logits rel L2 {rel:.2e}")
        assert rel <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["llama-3.2-1b", "odd"])
def test_graphed_prefill_matches_eager(shape: str) -> None:
    """Prompts prefilled from position 0 replay a CUDA graph padded to a bucket: the logits
    and the K/V of the real positions must match the eager prefill, for several lengths and
    for a second prompt through the same graph (its static input really is refreshed)."""
    cfg, weights = _cfg(shape), _weights(shape)
    max_len = 2048
    packed = repack(cfg, weights, max_len, fold=False)
    graphed_cache = KVCache.allocate(cfg, max_len, torch.bfloat16, "cuda")
    eager_cache = KVCache.allocate(cfg, max_len, torch.bfloat16, "cuda")
    graphed = Prefiller(cfg, packed, graphed_cache.k, graphed_cache.v, graphs=True)
    eager = Prefiller(cfg, packed, eager_cache.k, eager_cache.v, graphs=False)
    assert graphed.graphs is not None
    for i, n in enumerate([1, 100, 1000, 700]):  # 1000 and 700 share the 1,024 bucket
        tokens = _tokens(n, cfg.vocab_size, seed=10 + i)
        got = graphed.run(tokens, 0, logits=True)
        want = eager.run(tokens, 0, logits=True)
        assert got is not None and want is not None
        kv = max(
            _rel(graphed_cache.k[:, :, :n].float(), eager_cache.k[:, :, :n].float()),
            _rel(graphed_cache.v[:, :, :n].float(), eager_cache.v[:, :, :n].float()),
        )
        print(f"{shape} n={n}: graphed vs eager logits {_rel(got, want):.2e}, K/V {kv:.2e}")
        # A padded GEMM may take another cuBLAS algorithm: rounding, not structure.
        assert _rel(got, want) <= 2e-3 and kv <= 2e-3
    assert sorted(graphed.graphs._graphs) == [(16, 0), (128, 0), (1024, 0)]
    # A turn: 300 tokens after a 1,500-token prefix already in both caches replays a graph
    # at a device-side start (masked attention over 2,048 cache rows).
    base = _tokens(1800, cfg.vocab_size, seed=20)
    graphed.run(base[:1500], 0)
    eager.run(base[:1500], 0)
    for start in (1500, 1400):  # the same graph at two starts
        got = graphed.run(base[start:], start, logits=True)
        want = eager.run(base[start:], start, logits=True)
        assert got is not None and want is not None
        n = len(base)
        kv = max(
            _rel(graphed_cache.k[:, :, :n].float(), eager_cache.k[:, :, :n].float()),
            _rel(graphed_cache.v[:, :, :n].float(), eager_cache.v[:, :, :n].float()),
        )
        print(
            f"{shape} turn at {start}: graphed vs eager logits {_rel(got, want):.2e}, K/V {kv:.2e}"
        )
        # Masked memory-efficient attention here, flash attention with a bottom-right causal
        # mask in the eager path: their bf16 outputs round differently (measured on H100:
        # logits 6.9e-3 / 2.9e-3, K/V 1.6e-3 / 8e-4, the size of the bf16-vs-split-qkv
        # difference); a wrong position or mask would be O(1). The CPU test of _chunk_at
        # checks the same math to fp32 rounding.
        assert _rel(got, want) <= 1e-2 and kv <= 5e-3
    assert (512, 2048) in graphed.graphs._graphs


@pytest.mark.gpu
def test_warm_captures_every_fresh_bucket_and_requests_then_capture_none() -> None:
    """warm() (the monokernel's load) captures every graph (graph_keys: buckets 16..chunk,
    and each suffix bucket at each key-row bucket); a fresh prompt of any length up to the
    chunk then replays one of them, with the eager prefill's logits, and a suffix after a
    held prefix replays one too."""
    cfg, weights = _cfg("odd"), _weights("odd")
    max_len = 1024
    packed = repack(cfg, weights, max_len, fold=False)
    graphed_cache = KVCache.allocate(cfg, max_len, torch.bfloat16, "cuda")
    eager_cache = KVCache.allocate(cfg, max_len, torch.bfloat16, "cuda")
    graphed = Prefiller(cfg, packed, graphed_cache.k, graphed_cache.v, 512, graphs=True)
    eager = Prefiller(cfg, packed, eager_cache.k, eager_cache.v, 512, graphs=False)
    assert graphed.graphs is not None
    assert graphed.graphs.warm() == len(graph_keys(512, max_len))
    assert graphed.graphs.warm() == 0
    keys = sorted(graphed.graphs._graphs)
    assert keys == sorted(graph_keys(512, max_len))
    for i, n in enumerate([3, 200, 512]):
        seq = _tokens(n, cfg.vocab_size, seed=30 + i)
        got = graphed.run(seq, 0, logits=True)
        want = eager.run(seq, 0, logits=True)
        assert got is not None and want is not None and _rel(got, want) <= 2e-3
    # Each suffix continues the sequence before it (the 512-token prompt's, then its own), so
    # both caches hold the same keys below each start. The last two's buckets (512, 128)
    # would pass the cache's end: the graphed side starts them earlier, over held tokens.
    for i, n in enumerate([7, 100, 300, 90]):
        start = len(seq)
        seq += _tokens(n, cfg.vocab_size, seed=40 + i)
        at = graphed.fitting_start(start, n)
        assert at == {619: 512, 919: 896}.get(start, start)
        got = graphed.run(seq[at:], at, logits=True)
        want = eager.run(seq[start:], start, logits=True)
        assert got is not None and want is not None and _rel(got, want) <= 2e-3
    assert sorted(graphed.graphs._graphs) == keys


@pytest.mark.gpu
@needs_hopper
def test_backend_prefill_logits_with_reuse() -> None:
    """The backend's prefill_logits: from scratch, then extending the cached prompt (only
    the new tokens are prefilled), then with reuse off: all close to the reference."""
    from monokernel.runtime.backends.monokernel import MonokernelBackend

    shape = "odd"  # every optional feature; its kernel is small to build
    cfg, weights = _cfg(shape), _weights(shape)
    mk = MonokernelBackend(cfg, weights, 4096, torch.device("cuda"))
    tokens = _tokens(3000, cfg.vocab_size, seed=2)
    try:
        first = mk.prefill_logits(tokens[:2500])
        starts: list[int] = []
        run = mk.kv.prefill.run

        def spy(ids, start, logits=False):  # type: ignore[no-untyped-def]
            starts.append(start)
            return run(ids, start, logits=logits)

        mk.kv.prefill.run = spy  # type: ignore[method-assign]
        reused = mk.prefill_logits(tokens)
        assert starts == [2500], "the cached 2,500 tokens should not be prefilled again"
        mk.set_prefix_reuse(False)
        fresh = mk.prefill_logits(tokens)
        assert starts == [2500, 0]
    finally:
        mk.close()
    _, _, want_first = _reference(cfg, weights, tokens[:2500])
    _, _, want = _reference(cfg, weights, tokens)
    print(
        f"backend prefill logits rel L2: {_rel(first, want_first):.2e} (2,500), "
        f"{_rel(reused, want):.2e} (reused), {_rel(fresh, want):.2e} (fresh); "
        f"reused vs fresh {_rel(reused, fresh):.2e}"
    )
    assert max(_rel(first, want_first), _rel(reused, want), _rel(fresh, want)) <= 1e-2
    # Different chunk boundaries round different GEMM inputs and K/V entries to bf16, so
    # the two are independent samples of the same bf16 noise (~3e-3 each from the
    # reference on H100), not bit-equal; a wrong reused prefix (positions, RoPE) gives O(1).
    assert _rel(reused, fresh) <= 1e-2


@pytest.mark.gpu
@needs_hopper
def test_decode_logits_at_16k_context() -> None:
    """A 16k prompt through the chunked prefill (8 chunks), then teacher-forced kernel steps
    at full depth: logits within 1e-2 of the fp32 reference that ran the whole sequence."""
    from monokernel.runtime.backends.monokernel import MonokernelBackend

    shape, prompt_len, steps = "llama-3.2-1b", 16380, 4
    cfg, weights = _cfg(shape, full=True), _weights(shape, full=True)
    seq = _tokens(prompt_len + steps, cfg.vocab_size, seed=3)
    mk = MonokernelBackend(cfg, weights, prompt_len + steps, torch.device("cuda"))
    try:
        got = mk.teacher_forced_logits(seq[:prompt_len], seq[prompt_len:])  # [steps, V]
    finally:
        mk.close()
    ref, cache, _ = _reference(cfg, weights, seq[: prompt_len - 1])
    tail = torch.tensor(seq[prompt_len - 1 : -1], device="cuda")
    want = ref.forward(tail, prompt_len - 1, cache)  # [steps, V]
    assert torch.isfinite(got).all(), "unwritten or non-finite logits"
    rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
    print(f"16k context decode: rel L2 per step {[f'{r:.2e}' for r in rel.tolist()]}")
    assert float(rel.max()) <= 1e-2


@pytest.mark.gpu
@needs_hopper
def test_context_that_cannot_fit_is_refused_with_numbers() -> None:
    from monokernel.runtime.backends.monokernel import MonokernelBackend

    cfg = SHAPES["odd"]
    weights = random_weights(cfg, device="cuda", seed=1)
    free = torch.cuda.mem_get_info()[0]
    too_long = free // 1000 * 10  # the odd shape's cache takes ~1.2 KB a token
    with pytest.raises(InvalidRequestError, match=r"bytes are free.*--max-model-len"):
        MonokernelBackend(cfg, weights, too_long, torch.device("cuda"))
