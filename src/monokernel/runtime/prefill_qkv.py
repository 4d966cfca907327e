"""The prefill's QKV epilogue: from the QKV projection's fp32 output [T, Q + 2 KV] to what
attention reads. Per layer: the QKV bias, the q/k RMSNorm (Qwen3), RoPE of q and k at the
chunk's positions, k and v rounded to the cache's dtype and written into the cache
[kv_heads, max_len, head_dim] at those positions, q rounded to attention's dtype.

Two forms of the same function:

* PyTorch ops (the CPU, ``precision="fp32"``, ``MONOKERNEL_PREFILL_EPILOGUE=0``): a dozen
  element-wise kernels a layer (the bias, the rotation's concatenation, multiply and add for
  q and for k, the cache's dtype copies and index copies, q's cast), each a pass over the
  chunk's activations.
* one Triton kernel: a program per (block of tokens, head row of q, k or v) reads its fp32
  row once and writes q, or the cache rows, once. For an agent's 500-token turn that is
  ~190 fewer graph nodes for Llama-3.2-1B's 16 layers (docs/perf-notes.md step 31).

fp32 throughout, as the reference: rotation x1 c - x2 s, x2 c + x1 s with the tables of
``models/rope.py``; the fused form may contract a multiply and an add into one rounding, so
the two agree to ~1 ulp of fp32 before the bf16 rounding. Probed once per device against
the PyTorch form before use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from monokernel.models.config import ModelConfig
from monokernel.runtime.prefill_ops import (
    epilogue_enabled,
    lazy_triton,
    pow2_at_least,
    probed_once,
)
from monokernel.weights.repack import LayerPack


def rope_factors(
    cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 1, d] factors for positions ``pos`` [T] so that rope(x) = x * c + swap_halves(x) *
    s (the reference's x1*c - x2*s, x2*c + x1*s, same fp32 roundings); index_select keeps it
    graph-friendly."""
    c, s = cos.index_select(0, pos), sin.index_select(0, pos)
    return torch.cat((c, c), dim=-1)[:, None], torch.cat((-s, s), dim=-1)[:, None]


def apply_rope(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] fp32 -> rotated, HF's non-interleaved halves."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * c, swapped, s)


@dataclass(frozen=True, slots=True)
class ChunkRope:
    """Where one chunk's T tokens sit, built once per chunk and shared by its layers: ``pos``
    [T] int64 on the device; ``start`` the first position when the chunk is contiguous and
    known on the host (the cache is then written by slicing); ``c``, ``s`` [T, 1, d] the
    rotation factors of the PyTorch form (None for the fused one)."""

    pos: torch.Tensor
    start: int | None
    c: torch.Tensor | None
    s: torch.Tensor | None


@lazy_triton
def _epilogue_kernel(triton: Any, tl: Any) -> Any:
    @triton.jit
    def qkv_epilogue(
        qkv_ptr, bias_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_ptr, v_ptr,
        t, max_len, eps,
        NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, HALF_P2: tl.constexpr,
        BT: tl.constexpr, HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr,
    ):  # fmt: skip
        # Program (token block, head row): rows [0, NH) are q heads, [NH, NH + NKV) k heads,
        # then v heads. Each token's row is two halves of D / 2 (the rotation pairs them).
        HALF: tl.constexpr = D // 2
        row = tl.program_id(1)
        tok = tl.program_id(0) * BT + tl.arange(0, BT)
        j = tl.arange(0, HALF_P2)
        live = (tok < t)[:, None] & (j < HALF)[None, :]
        src = qkv_ptr + tok.to(tl.int64)[:, None] * ((NH + 2 * NKV) * D) + row * D + j[None, :]
        x1 = tl.load(src, mask=live, other=0.0)
        x2 = tl.load(src + HALF, mask=live, other=0.0)
        if HAS_BIAS:
            x1 += tl.load(bias_ptr + row * D + j, mask=j < HALF, other=0.0)[None, :]
            x2 += tl.load(bias_ptr + row * D + HALF + j, mask=j < HALF, other=0.0)[None, :]
        rotated = row < NH + NKV  # q and k; v is copied as it is
        if QK_NORM:
            # RMSNorm over the head's D values, then the gain: F.rms_norm's (x * r) * g.
            r = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)[:, None]
            jm = j < HALF
            g1 = tl.where(
                row < NH,
                tl.load(qn_ptr + j, mask=jm, other=0.0),
                tl.load(kn_ptr + j, mask=jm, other=0.0),
            )[None, :]
            g2 = tl.where(
                row < NH,
                tl.load(qn_ptr + HALF + j, mask=jm, other=0.0),
                tl.load(kn_ptr + HALF + j, mask=jm, other=0.0),
            )[None, :]
            x1 = tl.where(rotated, x1 * r * g1, x1)
            x2 = tl.where(rotated, x2 * r * g2, x2)
        pos = tl.load(pos_ptr + tok, mask=tok < t, other=0)
        at = pos.to(tl.int64)[:, None] * HALF + j[None, :]
        c = tl.where(rotated, tl.load(cos_ptr + at, mask=live, other=1.0), 1.0)
        s = tl.where(rotated, tl.load(sin_ptr + at, mask=live, other=0.0), 0.0)
        o1 = x1 * c - x2 * s
        o2 = x2 * c + x1 * s
        # q [T, NH, D]; the caches [NKV, max_len, D] at the tokens' positions.
        q_at = q_ptr + tok.to(tl.int64)[:, None] * (NH * D) + row * D + j[None, :]
        tl.store(q_at, o1.to(q_ptr.dtype.element_ty), mask=live & (row < NH))
        tl.store(q_at + HALF, o2.to(q_ptr.dtype.element_ty), mask=live & (row < NH))
        kvh = tl.where(rotated, row - NH, row - NH - NKV)
        cache_at = (kvh.to(tl.int64) * max_len + pos.to(tl.int64))[:, None] * D + j[None, :]
        is_k = rotated & (row >= NH)
        tl.store(k_ptr + cache_at, o1.to(k_ptr.dtype.element_ty), mask=live & is_k)
        tl.store(k_ptr + cache_at + HALF, o2.to(k_ptr.dtype.element_ty), mask=live & is_k)
        is_v = row >= NH + NKV
        tl.store(v_ptr + cache_at, o1.to(v_ptr.dtype.element_ty), mask=live & is_v)
        tl.store(v_ptr + cache_at + HALF, o2.to(v_ptr.dtype.element_ty), mask=live & is_v)

    return qkv_epilogue


_BT = 16  # tokens a program: 16 x D/2 values per half (a Llama turn: 32 x 48 programs)


class QkvEpilogue:
    """The epilogue of every layer of one prefiller: the RoPE tables [max_len, d/2] fp32 and
    the caches [layers, kv_heads, max_len, d]; ``fused`` picks the Triton form."""

    def __init__(
        self,
        cfg: ModelConfig,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        fused: bool,
    ) -> None:
        self.cfg, self.cos, self.sin = cfg, rope_cos, rope_sin
        self.k, self.v = k_cache, v_cache
        self.fused = fused

    def rope(self, start: int, end: int) -> ChunkRope:
        """A chunk at host-known positions [start, end)."""
        pos = torch.arange(start, end, device=self.k.device)
        return self._rope(pos, start)

    def rope_at(self, pos: torch.Tensor) -> ChunkRope:
        """A chunk at the positions of the device tensor ``pos`` [T] (graph-friendly)."""
        return self._rope(pos, None)

    def _rope(self, pos: torch.Tensor, start: int | None) -> ChunkRope:
        if self.fused:
            return ChunkRope(pos, start, None, None)
        c, s = rope_factors(self.cos, self.sin, pos)
        return ChunkRope(pos, start, c, s)

    def __call__(
        self, qkv: torch.Tensor, lp: LayerPack, layer: int, at: ChunkRope, dtype: torch.dtype
    ) -> torch.Tensor:
        """qkv [T, Q + 2 KV] fp32 (bias not yet added) -> q [T, heads, d] in ``dtype``;
        writes the rotated k and the v into the cache of ``layer`` at ``at``'s positions."""
        if self.fused:
            return self._triton(qkv, lp, layer, at, dtype)
        return self._torch(qkv, lp, layer, at, dtype)

    def _torch(
        self, qkv: torch.Tensor, lp: LayerPack, layer: int, at: ChunkRope, dtype: torch.dtype
    ) -> torch.Tensor:
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        t, d = qkv.shape[0], cfg.head_dim
        if lp.bqkv is not None:
            qkv += lp.bqkv
        q = qkv[:, : cfg.q_size].view(t, cfg.num_heads, d)
        k = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(t, cfg.num_kv_heads, d)
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(t, cfg.num_kv_heads, d)
        if lp.q_norm is not None and lp.k_norm is not None:
            q = F.rms_norm(q, (d,), lp.q_norm, eps)
            k = F.rms_norm(k, (d,), lp.k_norm, eps)
        assert at.c is not None and at.s is not None
        q, k = apply_rope(q, at.c, at.s), apply_rope(k, at.c, at.s)
        if at.start is not None:
            self.k[layer, :, at.start : at.start + t] = k.transpose(0, 1)  # rounded to the cache's
            self.v[layer, :, at.start : at.start + t] = v.transpose(0, 1)  # dtype
        else:
            self.k[layer].index_copy_(1, at.pos, k.transpose(0, 1).to(self.k.dtype))
            self.v[layer].index_copy_(1, at.pos, v.transpose(0, 1).to(self.v.dtype))
        return q.to(dtype)

    def _triton(
        self, qkv: torch.Tensor, lp: LayerPack, layer: int, at: ChunkRope, dtype: torch.dtype
    ) -> torch.Tensor:
        cfg = self.cfg
        t, d = qkv.shape[0], cfg.head_dim
        q = torch.empty(t, cfg.num_heads, d, dtype=dtype, device=qkv.device)
        qk_norm = lp.q_norm is not None and lp.k_norm is not None
        rows = cfg.num_heads + 2 * cfg.num_kv_heads
        _epilogue_kernel()[(-(-t // _BT), rows)](
            qkv, lp.bqkv if lp.bqkv is not None else qkv,
            lp.q_norm if qk_norm else qkv, lp.k_norm if qk_norm else qkv,
            self.cos, self.sin, at.pos, q, self.k[layer], self.v[layer],
            t, self.k.shape[2], cfg.rms_norm_eps,
            NH=cfg.num_heads, NKV=cfg.num_kv_heads, D=d, HALF_P2=pow2_at_least(d // 2), BT=_BT,
            HAS_BIAS=lp.bqkv is not None, QK_NORM=qk_norm, num_warps=4,
        )  # fmt: skip
        return q


_OK: dict[int, bool] = {}  # CUDA device index -> the Triton epilogue runs and agrees


def fused_epilogue_ok(device: torch.device) -> bool:
    """Whether the Triton epilogue runs on this device and agrees with the PyTorch form
    (qkv_epilogue_agrees), once per device; MONOKERNEL_PREFILL_FUSED=0 or
    MONOKERNEL_PREFILL_EPILOGUE=0: never."""
    if device.type != "cuda" or not epilogue_enabled():
        return False

    def probe() -> bool:
        try:
            return qkv_epilogue_agrees(device)
        except Exception:  # no Triton, no compiler, no driver: PyTorch does it
            return False

    return probed_once(_OK, device, probe)


def qkv_epilogue_agrees(device: torch.device, head_dim: int = 24, t: int = 37) -> bool:
    """Both forms on one random Qwen3-like layer (bias, q/k-norm, GQA) at scattered positions:
    q and the written cache rows within one bf16 step of each other, nothing else written."""
    max_len = 2 * t + 64
    cfg = ModelConfig(
        family="qwen3", vocab_size=8, hidden_size=8 * head_dim, intermediate_size=8,
        num_layers=1, num_heads=6, num_kv_heads=2, head_dim=head_dim, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=max_len, tie_word_embeddings=False,
        qkv_bias=True, qk_norm=True,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    width = cfg.q_size + 2 * cfg.kv_size

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device)

    lp = LayerPack(  # the epilogue reads no matrix
        matrices={}, bqkv=rnd(width), q_norm=rnd(head_dim).abs() + 0.5,
        k_norm=rnd(head_dim).abs() + 0.5, bo=None,
    )  # fmt: skip
    angles = rnd(max_len, head_dim // 2) * 3
    cos, sin = angles.cos(), angles.sin()
    pos = torch.randperm(max_len, generator=g)[:t].to(device)
    qkv = 4 * rnd(t, width)
    outs = []
    for fused in (False, True):
        cache = [torch.full((1, 2, max_len, head_dim), 7.0, dtype=torch.bfloat16, device=device)
                 for _ in range(2)]  # fmt: skip
        ep = QkvEpilogue(cfg, cos, sin, *cache, fused=fused)
        q = ep(qkv.clone(), lp, 0, ep.rope_at(pos), torch.bfloat16)
        outs.append((q.float(), *(c.float() for c in cache)))
    return all(torch.allclose(a, b, rtol=1e-2, atol=1e-5) for a, b in zip(*outs, strict=True))
