"""The split prefill attention's arithmetic on the CPU: parts merged by log-sum-exp equal one
softmax over every key, and how many parts a shape gets. The FA2 calls themselves run on
the GPU (runtime/backends/test_prefill.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

from monokernel.runtime.prefill_attention import (
    MAX_SPLITS,
    MIN_SPLIT_KEYS,
    _expand_gqa,
    causal_attention,
    merge_parts,
    merge_parts_reference,
    split_count,
)
from monokernel.testing.triton_interpreter import interpreted


def _part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_from: int | None):
    """One part as FA2 returns it: normalised output [T, heads, d] and log-sum-exp
    [heads, T] over keys k/v [kv_heads, n, d]; ``causal_from``: key j is visible to query i
    iff j <= causal_from + i (None: all visible). No keys: output 0, log-sum-exp +inf."""
    t, heads, d = q.shape
    if k.shape[1] == 0:
        return torch.zeros(t, heads, d), torch.full((heads, t), float("inf"))
    kk, vv = _expand_gqa(k, heads), _expand_gqa(v, heads)
    s = torch.einsum("thd,hnd->htn", q, kk) * d**-0.5
    if causal_from is not None:
        n = k.shape[1]
        visible = torch.arange(n)[None, :] <= causal_from + torch.arange(t)[:, None]
        s = s.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [heads, T]
    out = torch.einsum("htn,hnd->thd", torch.softmax(s, dim=-1), vv)
    return out, lse


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "start", "t", "splits"),
    [(6, 2, 16, 40, 7, 3), (4, 4, 8, 9, 13, 4), (5, 1, 24, 2, 5, 4), (3, 1, 8, 1, 1, 2)],
)
def test_merged_parts_equal_one_softmax(
    heads: int, kv_heads: int, d: int, start: int, t: int, splits: int
) -> None:
    """Chunks of the keys before the queries (some empty when start < splits, as FA2 leaves
    them) and the queries' own causal block, merged, against causal attention over all."""
    g = torch.Generator().manual_seed(start * 31 + t)
    q = torch.randn(t, heads, d, generator=g, dtype=torch.float64)
    k = torch.randn(kv_heads, start + t, d, generator=g, dtype=torch.float64)
    v = torch.randn(kv_heads, start + t, d, generator=g, dtype=torch.float64)
    bounds = [c * start // splits for c in range(splits + 1)]
    outs, lses = [], []
    for a, b in itertools.pairwise(bounds):
        o, lse = _part(q, k[:, a:b], v[:, a:b], None)
        outs.append(o)
        lses.append(lse)
    out_s, lse_s = _part(q, k[:, start:], v[:, start:], 0)
    out_p = torch.stack(outs)  # [S, T, heads, d]
    lse_p = torch.stack(lses, dim=1).reshape(heads, splits * t)  # [heads, S * T]
    got = merge_parts_reference(out_p, lse_p, out_s, lse_s)
    want = causal_attention(q, k, v, start)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert torch.equal(merge_parts(out_p, lse_p, out_s, lse_s), got)  # CPU: the reference


def test_an_empty_part_weighs_nothing_whatever_its_output() -> None:
    t, heads, d = 3, 2, 4
    out_s = torch.randn(t, heads, d, dtype=torch.float64)
    lse_s = torch.randn(heads, t, dtype=torch.float64)
    out_p = torch.full((2, t, heads, d), float("nan"), dtype=torch.float64)
    lse_p = torch.tensor([float("inf"), float("nan")], dtype=torch.float64).repeat_interleave(t)
    got = merge_parts_reference(out_p, lse_p.expand(heads, 2 * t), out_s, lse_s)
    torch.testing.assert_close(got, out_s.reshape(t, heads * d))


def test_split_count() -> None:
    # Llama-3.2-1B's 500-token turn on 132 SMs: 4 query blocks x 32 heads = 128 CTAs, enough
    # to fill the GPU in one call.
    assert split_count(500, 32, 16384, 132) == 1
    # Qwen2.5-Coder-1.5B's: 4 x 12 = 48 CTAs; ~4 an SM wanted: 11 chunks of the 16k keys.
    assert split_count(500, 12, 16384, 132) == 11
    assert split_count(8192, 12, 16384, 132) == 1  # a long chunk fills the GPU by itself
    assert split_count(1, 32, 100_000, 132) == MAX_SPLITS
    assert split_count(500, 12, 3 * MIN_SPLIT_KEYS + 5, 132) == 3  # chunks stay large
    assert split_count(500, 12, MIN_SPLIT_KEYS - 1, 132) == 1
    assert split_count(500, 12, 0, 132) == 1


def _interpreted_error(heads: int, kv_heads: int, d: int, start: int, t: int, bm: int, bn: int):
    """Relative error of the Triton kernel run by Triton's interpreter (fp16: it has no bf16)
    against causal attention. Needs TRITON_INTERPRET=1 set before Triton is imported."""
    from monokernel.runtime.prefill_attention_triton import triton_cache_attention

    g = torch.Generator().manual_seed(start + t)
    max_len = start + t + 40
    k = torch.randn(kv_heads, max_len, d, generator=g).to(torch.float16)
    v = torch.randn(kv_heads, max_len, d, generator=g).to(torch.float16)
    q = torch.randn(t, heads, d, generator=g).to(torch.float16)
    used = torch.tensor([start + t], dtype=torch.int32)
    got = triton_cache_attention(q, k, v, used, bm, bn, 1, 1).float()
    want = causal_attention(q.float(), k[:, : start + t].float(), v[:, : start + t].float(), start)
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize(
    "case",
    [(8, 2, 64, 100, 37, 16, 32), (4, 1, 128, 0, 20, 16, 16), (6, 3, 64, 33, 50, 32, 16)],
    ids=["wide-key-tiles", "from-0", "narrow-key-tiles"],
)
def test_triton_kernel_logic_in_the_interpreter(case: tuple[int, ...]) -> None:
    """The Triton kernel's loops and masks on the CPU (a start at 0 and past it, query blocks
    narrower and wider than the key tiles), in a fresh process: the interpreter must be
    chosen before Triton is imported. Its speed and bf16 run on the GPU
    (runtime/backends/test_prefill.py)."""
    call = f"_interpreted_error(*{case!r})"
    err = interpreted("monokernel.runtime.test_prefill_attention", call)
    assert float(err) < 2e-3
