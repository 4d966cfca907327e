"""Prefill attention on the cache as one Triton kernel, for head_dim 64 and 128: the same
function as prefill_attention.flash_cache_attention (T queries at positions [used - T, used)
over cache rows [0, used), the cache layout read in place, GQA native, the key count on the
device so one CUDA graph serves every start), with Triton's Hopper code generation (its
products run on wgmma). Measured on an H100 (docs/perf-notes.md step 30, 512 queries at
16,384): 0.178 ms a layer against FA2's 0.291 for Llama-3.2-1B's heads (392 against 240
TFLOP/s), 0.184 against 0.472 (0.242 split) for Qwen2.5-Coder-1.5B's. Probed once per
device against SDPA's math; MONOKERNEL_PREFILL_TRITON=0 keeps FA2.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from monokernel import envs
from monokernel.runtime.prefill_attention import agrees_with_sdpa
from monokernel.runtime.prefill_ops import lazy_triton

HEAD_DIMS = (64, 128)


# (block_m, block_n, warps, stages). Measured on an H100, 512 queries at 16,384 (perf notes
# step 30): best of 9 configurations for both Llama-3.2-1B's heads (0.178 ms a layer, 392
# TFLOP/s; 128-query blocks with 8 warps 0.202) and Qwen2.5-Coder-1.5B's (0.184 ms, 285
# TFLOP/s): 64-query blocks also give few-head models more CTAs.
BLOCKS = (64, 128, 4, 3)


@lazy_triton
def _attention_kernel(triton: Any, tl: Any) -> Any:
    @triton.jit
    def suffix_attention(
        q_ptr, k_ptr, v_ptr, o_ptr, used_ptr, t, heads, group, max_len, qk_scale,
        D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    ):  # fmt: skip
        # Program (query block m, head h): queries i at positions start + i see keys
        # 0 .. start + i; keys below start + m * BM are seen by the whole block (no mask).
        m = tl.program_id(0)
        h = tl.program_id(1)
        kvh = (h // group).to(tl.int64)
        used = tl.load(used_ptr)
        start = used - t
        rows = m * BM + tl.arange(0, BM)
        d = tl.arange(0, D)
        cols = tl.arange(0, BN)
        live = rows < t
        q = tl.load(q_ptr + (rows[:, None] * heads + h) * D + d[None, :], mask=live[:, None],
                    other=0.0)  # fmt: skip
        k_base = k_ptr + kvh * max_len * D
        v_base = v_ptr + kvh * max_len * D
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        full = (start + m * BM) // BN * BN
        end = tl.minimum(used, start + (m + 1) * BM)
        for n0 in range(0, full, BN):
            keys = n0 + cols
            k = tl.load(k_base + keys[:, None] * D + d[None, :])
            s = tl.dot(q, tl.trans(k)) * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + keys[:, None] * D + d[None, :])
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        for n0 in range(full, end, BN):
            keys = n0 + cols
            inside = keys < end
            k = tl.load(k_base + keys[:, None] * D + d[None, :], mask=inside[:, None],
                        other=0.0)  # fmt: skip
            s = tl.dot(q, tl.trans(k)) * qk_scale
            seen = (keys[None, :] <= (start + rows)[:, None]) & inside[None, :]
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + keys[:, None] * D + d[None, :], mask=inside[:, None],
                        other=0.0)  # fmt: skip
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        out = acc / l_i[:, None]
        out = out.to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + (rows[:, None] * heads + h) * D + d[None, :], out, mask=live[:, None])

    return suffix_attention


def triton_cache_attention(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    used: torch.Tensor,
    block_m: int = BLOCKS[0],
    block_n: int = BLOCKS[1],
    warps: int = BLOCKS[2],
    stages: int = BLOCKS[3],
) -> torch.Tensor:
    """flash_cache_attention's function: q [T, heads, d] bf16 at positions [used - T, used)
    over cache rows [0, used) of k/v [kv_heads, max_len, d] -> [T, heads * d]."""
    t, heads, d = q.shape
    kv_heads, max_len, _ = k_layer.shape
    if d not in (64, 128):
        raise ValueError(f"the Triton suffix attention takes head_dim 64 or 128, not {d}")
    q = q.contiguous()
    out = torch.empty_like(q)
    grid = (-(-t // block_m), heads)
    _attention_kernel()[grid](
        q, k_layer, v_layer, out, used, t, heads, heads // kv_heads, max_len,
        d**-0.5 * math.log2(math.e), D=d, BM=block_m, BN=block_n,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out.reshape(t, heads * d)


_OK: dict[tuple[int, int], bool] = {}  # (CUDA device index, head_dim) -> runs and agrees here


def triton_attention_ok(device: torch.device, head_dim: int) -> bool:
    """Whether triton_cache_attention runs on this device at ``head_dim`` and agrees with
    SDPA's math (prefill_attention.agrees_with_sdpa), probed once per device and head_dim."""
    if device.type != "cuda" or head_dim not in HEAD_DIMS:
        return False
    if not envs.MONOKERNEL_PREFILL_TRITON:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, head_dim)
    if key not in _OK:
        # Both of the kernel's key loops (a start past one query block), GQA by index.
        _OK[key] = agrees_with_sdpa(device, triton_cache_attention, head_dim, start=150, t=70)
    return _OK[key]
