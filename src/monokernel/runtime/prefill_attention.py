"""Prefill attention: T new queries against the cached keys before them and their own.

Three forms, all the same function (query i at position start + i sees keys 0..start + i):

* ``causal_attention``: SDPA on sliced, GQA-expanded copies (the CPU, fp32, a prompt from
  position 0, where SDPA's own causal kernel measured fastest).
* ``flash_cache_attention``: FlashAttention-2's variable-length kernel read straight from the
  cache layout, GQA native, key count on the device (one CUDA graph serves every start).
  With ``splits`` > 1 the keys before the queries go in that many chunks, each a sequence of
  one varlen batch with its own copy of the queries, and the queries' own keys (the causal
  block) in a second call; the parts are merged by their log-sum-exp (flash-decoding over a
  prefill). An agent's turn is a few hundred queries against ~16k keys: one call is
  ceil(T / 128) x heads CTAs (48 for Qwen2.5-Coder-1.5B's 500-token turn on 132 SMs), so
  for few heads or short turns the split is what fills the GPU.
* ``masked_attention``: SDPA under an explicit mask, for graphs where flash on the cache is
  missing.

Where it runs, ``prefill_attention_triton.triton_cache_attention`` (a Triton kernel on
Hopper's wgmma, head_dim 64 and 128) takes flash_cache_attention's place: 1.6x FA2 on a
Llama-3.2-1B turn, and it fills the GPU for few-head models without a split.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from monokernel import envs
from monokernel.runtime.prefill_ops import lazy_triton, pow2_at_least, probed_once

# FlashAttention-2's query block in the forward kernel (head_dim <= 128: 128 rows).
FLASH_BLOCK_M = 128
# CTAs to aim for per SM when splitting: FA2 fits about two of its 4-warp CTAs on an SM, and
# a second wave evens out the chunks' finishing times.
SPLIT_CTAS_PER_SM = 4
MIN_SPLIT_KEYS = 1024  # fewer keys a chunk and the per-chunk overhead outweighs the gain
# A call whose CTAs cover this share of the SMs is not split (FA2's own threshold for its
# split-KV decode path). Measured on an H100 (docs/perf-notes.md, step 27): Llama-3.2-1B's
# 500-token turn (128 CTAs) ran 0.36 ms a layer unsplit and 0.50-0.65 split 2-16 ways.
SPLIT_MIN_FILL = 0.8
MAX_SPLITS = 16


def _expand_gqa(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """[kv_heads, S, d] -> [heads, S, d]: query head h reads kv head h // group. Expanded
    copies rather than SDPA's enable_gqa, which not every backend (nor the bottom-right
    causal path) takes; the copy is O(context) per layer, small next to the GEMMs."""
    kv_heads, s_len, d = kv.shape
    if heads == kv_heads:
        return kv
    return kv[:, None].expand(kv_heads, heads // kv_heads, s_len, d).reshape(heads, s_len, d)


def causal_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int
) -> torch.Tensor:
    """q [T, heads, d] at positions start..start+T-1; keys/values [kv_heads, start+T, d] ->
    [T, heads * d]. Query i sees keys 0..start+i (bottom-right causal)."""
    t, heads, d = q.shape
    keys, values = _expand_gqa(keys, heads), _expand_gqa(values, heads)
    s_len = keys.shape[1]
    qh = q.transpose(0, 1)[None]  # [1, heads, T, d]
    if start == 0:  # square: top-left and bottom-right causal coincide
        out = F.scaled_dot_product_attention(qh, keys[None], values[None], is_causal=True)
    else:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(t, s_len)
        out = F.scaled_dot_product_attention(qh, keys[None], values[None], attn_mask=mask)
    return out[0].transpose(0, 1).reshape(t, heads * d)


def masked_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """causal_attention with the causal structure given as a mask: visible [T, S] bool, True
    where query i may read key j. For graphs whose start is a device value."""
    t, heads, d = q.shape
    keys, values = _expand_gqa(keys, heads), _expand_gqa(values, heads)
    qh = q.transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(
        qh, keys[None], values[None], attn_mask=visible[None, None]
    )
    return out[0].transpose(0, 1).reshape(t, heads * d)


def split_count(queries: int, heads: int, prefix_keys: int, sms: int) -> int:
    """Chunks flash_cache_attention splits ``prefix_keys`` cached keys into for ``queries``
    new queries: 1 (one call) when one call's CTAs already cover SPLIT_MIN_FILL of the SMs,
    else enough for SPLIT_CTAS_PER_SM per SM, no chunk under MIN_SPLIT_KEYS keys, at most
    MAX_SPLITS."""
    blocks = -(-queries // FLASH_BLOCK_M) * heads
    if blocks >= SPLIT_MIN_FILL * sms:
        return 1
    want = -(-SPLIT_CTAS_PER_SM * sms // blocks)
    return max(1, min(want, prefix_keys // MIN_SPLIT_KEYS, MAX_SPLITS))


def _flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
    used: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FA2's varlen forward: (out [total_q, heads, d], log-sum-exp [heads, total_q] fp32)."""
    out, lse = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
        scale=q.shape[-1] ** -0.5, seqused_k=used,
    )[:2]  # fmt: skip
    if lse.dim() == 3:  # older layouts: [batch, heads, max_q], padded per sequence
        b, h, _ = lse.shape
        lse = lse[:, :, : q.shape[0] // b].permute(1, 0, 2).reshape(h, -1)
    return out, lse


def flash_cache_attention(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    used: torch.Tensor,
    splits: int = 1,
) -> torch.Tensor:
    """Causal attention of the T queries q [T, heads, d] (bf16) sitting at positions
    [used - T, used) over cache rows [0, used) of one layer's k/v [kv_heads, max_len, d]:
    FlashAttention-2's variable-length kernel, reading the cache in place (no slice, no
    GQA-expanded copies: it takes kv_heads < heads natively) with its causal mask aligned
    bottom-right. ``used`` [1] int32 lives on the device, so one CUDA graph serves every
    start. ``splits`` > 1: the keys before the queries in that many chunks (module doc).
    -> [T, heads * d]."""
    if splits <= 1:
        t, heads, d = q.shape
        max_len = k_layer.shape[1]
        kt, vt = k_layer.transpose(0, 1), v_layer.transpose(0, 1)  # [max_len, kv_heads, d]
        steps = torch.arange(2, dtype=torch.int32, device=q.device)
        # One sequence of T queries over the whole cache, of which `used` rows count.
        out, _ = _flash(q, kt, vt, steps * t, steps * max_len, t, max_len, True, used)
        return out.reshape(t, heads * d)
    return merge_parts(*split_parts(q, k_layer, v_layer, used, splits))


def split_parts(
    q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, used: torch.Tensor, splits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash_cache_attention's split form before its merge: the ``splits`` chunks of the keys
    before the queries (out_p [S, T, heads, d], lse_p [heads, S * T]) and the queries' own
    causal block (out_s [T, heads, d], lse_s [heads, T]), as merge_parts takes them."""
    t, heads, d = q.shape
    max_len = k_layer.shape[1]
    kt, vt = k_layer.transpose(0, 1), v_layer.transpose(0, 1)  # [max_len, kv_heads, d]
    steps = torch.arange(2, dtype=torch.int32, device=q.device)
    start = used - t  # [1]: the queries' first position, on the device
    j = torch.arange(splits + 1, dtype=torch.int32, device=q.device)
    bounds = (j.long() * start // splits).int()  # chunk c is keys [bounds[c], bounds[c+1])
    qq = q[None].expand(splits, t, heads, d).reshape(splits * t, heads, d)
    out_p, lse_p = _flash(qq, kt, vt, j * t, bounds, t, max_len, False)
    out_s, lse_s = _flash(q, kt, vt, steps * t, start + steps * t, t, t, True)
    return out_p.view(splits, t, heads, d), lse_p, out_s, lse_s


def merge_parts_reference(
    out_p: torch.Tensor, lse_p: torch.Tensor, out_s: torch.Tensor, lse_s: torch.Tensor
) -> torch.Tensor:
    """The softmax over all parts from each part's normalised output and log-sum-exp:
    out_p [S, T, heads, d] with lse_p [heads, S * T] (the key chunks), out_s [T, heads, d]
    with lse_s [heads, T] (the causal block) -> [T, heads * d] in out_s's dtype. A part with
    no keys (FA2 reports its log-sum-exp as +inf) weighs nothing, whatever its output."""
    s, t, heads, d = out_p.shape
    f = torch.promote_types(out_s.dtype, torch.float32)  # fp32 at least
    lse = torch.cat((lse_p.to(f).view(heads, s, t), lse_s.to(f).view(heads, 1, t)), dim=1)
    inf = float("inf")
    lse = torch.nan_to_num(lse, nan=-inf, posinf=-inf)  # [heads, S + 1, T]
    w = torch.softmax(lse, dim=1).permute(1, 2, 0)[..., None]  # [S + 1, T, heads, 1]
    parts = torch.cat((out_p.to(f), out_s.to(f)[None]), dim=0)  # [S + 1, T, heads, d]
    merged = torch.where(w > 0, parts * w, 0.0).sum(0)
    return merged.to(out_s.dtype).reshape(t, heads * d)


@lazy_triton
def _merge_kernel(triton: Any, tl: Any) -> Any:
    @triton.jit
    def merge_kernel(
        out_p, lse_p, out_s, lse_s, dst, t, heads, splits,
        D: tl.constexpr, DP: tl.constexpr, SP: tl.constexpr,
    ):  # fmt: skip
        # One (query, head) row: SP >= splits + 1 parts, DP >= D lanes, both powers of 2.
        row = tl.program_id(0)
        i, h = row // heads, row % heads
        c = tl.arange(0, SP)
        e = tl.arange(0, DP)
        chunk = c < splits
        own = c == splits
        lse = tl.load(lse_p + h * splits * t + c * t + i, mask=chunk, other=float("-inf"))
        lse = tl.where(own, tl.load(lse_s + h * t + i), lse)
        lse = tl.where((lse != lse) | (lse == float("inf")), float("-inf"), lse)
        w = tl.exp(lse - tl.max(lse, 0))
        w = w / tl.sum(w, 0)
        live = e < D
        rows_p = ((c * t + i) * heads + h) * D
        both = chunk[:, None] & live[None, :]
        vals = tl.load(out_p + rows_p[:, None] + e[None, :], mask=both, other=0.0)
        vals = vals.to(tl.float32)
        mine = tl.load(out_s + (i * heads + h) * D + e, mask=live, other=0.0).to(tl.float32)
        vals = tl.where(own[:, None], mine[None, :], vals)
        res = tl.sum(tl.where(w[:, None] > 0, vals * w[:, None], 0.0), 0)
        tl.store(dst + (i * heads + h) * D + e, res.to(dst.dtype.element_ty), mask=live)

    return merge_kernel


def merge_parts(
    out_p: torch.Tensor, lse_p: torch.Tensor, out_s: torch.Tensor, lse_s: torch.Tensor
) -> torch.Tensor:
    """merge_parts_reference in one Triton pass over the parts on a GPU (the elementwise
    PyTorch form reads and writes [S + 1, T, heads, d] fp32 several times: ~1 ms over a
    Llama-3.2-1B turn's 16 layers); the reference elsewhere."""
    if not out_p.is_cuda:
        return merge_parts_reference(out_p, lse_p, out_s, lse_s)
    s, t, heads, d = out_p.shape
    dst = torch.empty(t, heads, d, dtype=out_s.dtype, device=out_s.device)
    _merge_kernel()[(t * heads,)](
        out_p.contiguous(), lse_p.contiguous(), out_s.contiguous(), lse_s.contiguous(), dst,
        t, heads, s, D=d, DP=pow2_at_least(d), SP=pow2_at_least(s + 1), num_warps=2,
    )  # fmt: skip
    return dst.reshape(t, heads * d)


_FLASH_OK: dict[int, bool] = {}  # CUDA device index -> flash_cache_attention works here
_SPLIT_OK: dict[int, bool] = {}  # CUDA device index -> its split form works here


def flash_cache_attention_ok(device: torch.device) -> bool:
    """Whether flash_cache_attention runs on this device and torch and agrees with SDPA's
    math on a small case (GQA, a start past 0, the cache's strided layout). Probed once per
    device; False (or MONOKERNEL_PREFILL_FLASH=0) sends prefill to causal_attention /
    masked_attention."""
    if device.type != "cuda" or not envs.MONOKERNEL_PREFILL_FLASH:
        return False
    return probed_once(_FLASH_OK, device, lambda: agrees_with_sdpa(device, flash_cache_attention))


def flash_split_ok(device: torch.device) -> bool:
    """Whether the split form (``splits`` > 1) runs here and agrees with SDPA's math, empty
    chunks included. Probed once per device; False (or MONOKERNEL_PREFILL_SPLIT=0) keeps
    one call."""
    if not flash_cache_attention_ok(device):
        return False
    if not envs.MONOKERNEL_PREFILL_SPLIT:
        return False
    split3 = functools.partial(flash_cache_attention, splits=3)
    return probed_once(
        _SPLIT_OK,
        device,
        lambda: agrees_with_sdpa(device, split3) and agrees_with_sdpa(device, split3, start=2),
    )


AttentionCase = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def sdpa_case(
    device: torch.device,
    heads: int,
    kv_heads: int,
    d: int,
    start: int,
    t: int,
    max_len: int,
    seed: int = 0,
) -> AttentionCase:
    """A random bf16 cache case and SDPA's fp32 answer (the probes, tests and benchmarks of
    the cache-attention forms): (q [t, heads, d], k and v [kv_heads, max_len, d], used [1]
    int32 = start + t on the device, want [t, heads * d] fp32)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    k = torch.randn(kv_heads, max_len, d, generator=g).to(device, torch.bfloat16)
    v = torch.randn(kv_heads, max_len, d, generator=g).to(device, torch.bfloat16)
    q = torch.randn(t, heads, d, generator=g).to(device, torch.bfloat16)
    used = torch.full((1,), start + t, dtype=torch.int32, device=device)
    end = start + t
    want = causal_attention(q.float(), k[:, :end].float(), v[:, :end].float(), start)
    return q, k, v, used, want


def agrees_with_sdpa(
    device: torch.device,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    d: int = 64,
    start: int = 19,
    t: int = 11,
) -> bool:
    """Whether ``attend(q, k, v, used)`` (flash_cache_attention's signature) gives SDPA's math
    on a small case: GQA (6 query heads, 2 KV heads), head_dim ``d``, ``t`` queries at
    ``start``, the cache's strided layout. False also where it raises: no kernel, no
    compiler, an unexpected layout; the plain path then serves."""
    try:
        q, k, v, used, want = sdpa_case(device, 6, 2, d, start, t, start + t + 18)
        got = attend(q, k, v, used).float()
        return bool(torch.allclose(got, want, atol=3e-2, rtol=3e-2))
    except Exception:
        return False
