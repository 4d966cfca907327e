"""Fused element-wise steps of the GPU prefill, where the MLP's fp32 activations make the
memory traffic of separate PyTorch ops cost as much as a third of an 8k-token prefill.

* ``silu_mul_bf16(gate, up)``: silu(gate) * up rounded to bf16 in one pass (a Triton
  kernel): the down projection's input. Separately (silu in place, a multiply, the bf16
  copy for the GEMM) it read and wrote the [T, intermediate] fp32 tensors five times.
* ``addmm_fp32_ok``: whether acc += x @ w^T runs as one cuBLAS GEMM with beta = 1 (bf16
  operands, fp32 accumulate and output; prefill.gemm_bf16_acc), so residual adds and the
  split QKV's second term need no pass of their own.
* ``rms_norm_bf16(x, gain, eps, split)``: the RMSNorm in front of a GEMM and the rounding of
  its output to the GEMM's bf16 operand(s) in one pass (a Triton kernel): hi, and with
  ``split`` also lo = bf16(y - hi), the split QKV's two terms (prefill.gemm_parts). Apart, the
  norm, the cast, the subtraction and the second cast were four or more passes.

Each has a plain PyTorch path (the CPU, a torch or GPU without the fused form, or
``MONOKERNEL_PREFILL_FUSED=0``) computing the same values; the GPU forms are probed once per
device against it before use.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from monokernel import envs

_SILU_OK: dict[int, bool] = {}  # CUDA device index -> the Triton kernel runs and agrees
_NORM_OK: dict[int, bool] = {}  # CUDA device index -> the Triton norm runs and agrees
_ADDMM_OK: dict[int, bool] = {}  # CUDA device index -> addmm(out_dtype=fp32, out=acc) works


def fused_enabled() -> bool:
    return bool(envs.MONOKERNEL_PREFILL_FUSED)


def epilogue_enabled() -> bool:
    """The fused norms and QKV epilogue (rms_norm_bf16, prefill_qkv.py): off with the other
    fusions, or alone with MONOKERNEL_PREFILL_EPILOGUE=0."""
    return fused_enabled() and bool(envs.MONOKERNEL_PREFILL_EPILOGUE)


def probed_once(cache: dict[int, bool], device: torch.device, probe: Callable[[], bool]) -> bool:
    """``probe()``'s answer for this CUDA device, run the first time it is asked (the
    prefill's fast paths are each checked once per device against their PyTorch twin)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in cache:
        cache[index] = probe()
    return cache[index]


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton's block shapes."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, rounded to bf16 (consumes gate's storage)."""
    act = F.silu(gate, inplace=True)
    act *= up
    return act.to(torch.bfloat16)


def lazy_triton(build: Callable[[Any, Any], Any]) -> Callable[[], Any]:
    """``build(triton, triton.language)`` -> a Triton kernel, run at the first call and kept:
    Triton is imported only where a GPU path needs it, never on the CPU path."""

    @functools.cache
    def kernel() -> Any:
        import triton
        import triton.language as tl

        return build(triton, tl)

    return kernel


@lazy_triton
def _silu_mul_kernel(triton: Any, tl: Any) -> Any:
    @triton.jit
    def silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = offs < n
        g = tl.load(g_ptr + offs, mask=live, other=0.0)
        u = tl.load(u_ptr + offs, mask=live, other=0.0)
        a = g / (1.0 + tl.exp(-g)) * u  # fp32 throughout, like F.silu then the multiply
        tl.store(out_ptr + offs, a.to(tl.bfloat16), mask=live)

    return silu_mul_kernel


def _silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out = torch.empty(gate.shape, dtype=torch.bfloat16, device=gate.device)
    n, block = gate.numel(), 2048
    _silu_mul_kernel()[(-(-n // block),)](gate, up, out, n, BLOCK=block)
    return out


def silu_mul_bf16(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [T, I] fp32 contiguous -> silu(gate) * up as bf16 [T, I]. May overwrite
    gate."""
    dense = gate.is_contiguous() and up.is_contiguous()
    if gate.is_cuda and dense and silu_mul_fused_ok(gate.device):
        return _silu_mul_triton(gate, up)
    return silu_mul_reference(gate, up)


def silu_mul_fused_ok(device: torch.device) -> bool:
    """Whether the Triton kernel runs on this device and agrees with PyTorch (once per
    device; MONOKERNEL_PREFILL_FUSED=0: never)."""

    def probe() -> bool:
        g = torch.Generator(device="cpu").manual_seed(0)
        gate = (4 * torch.randn(37, 515, generator=g)).to(device)
        up = torch.randn(37, 515, generator=g).to(device)
        try:
            got = _silu_mul_triton(gate, up).float()
            want = silu_mul_reference(gate.clone(), up).float()
            return bool(torch.allclose(got, want, rtol=8e-3, atol=1e-6))
        except Exception:  # no Triton, no compiler, no driver: PyTorch does it
            return False

    return fused_enabled() and probed_once(_SILU_OK, device, probe)


def addmm_fp32_ok(device: torch.device) -> bool:
    """Whether torch.addmm(acc, x, w, out_dtype=float32, out=acc) accumulates in place on
    this device (torch >= 2.8 and cuBLAS), checked once against a separate add."""

    def probe() -> bool:
        g = torch.Generator(device="cpu").manual_seed(0)
        acc = torch.randn(33, 48, generator=g).to(device)
        x = torch.randn(33, 64, generator=g).to(device, torch.bfloat16)
        w = torch.randn(48, 64, generator=g).to(device, torch.bfloat16)
        try:
            want = acc + torch.mm(x, w.t(), out_dtype=torch.float32)
            got = acc.clone()
            torch.addmm(got, x, w.t(), out_dtype=torch.float32, out=got)
            return bool(torch.allclose(got, want, rtol=1e-5, atol=1e-4))
        except (RuntimeError, TypeError, NotImplementedError):
            return False

    return fused_enabled() and probed_once(_ADDMM_OK, device, probe)


def bf16_parts(y: torch.Tensor, split: bool) -> tuple[torch.Tensor, ...]:
    """y fp32 as a GEMM's bf16 operand(s): (hi,) or, with ``split``, (hi, lo) with lo =
    bf16(y - hi), y - hi exact in fp32: ~16 mantissa bits in two terms (prefill.gemm_parts)."""
    hi = y.to(torch.bfloat16)
    return (hi, (y - hi.float()).to(torch.bfloat16)) if split else (hi,)


def rms_norm_reference(
    x: torch.Tensor, gain: torch.Tensor | None, eps: float, split: bool
) -> tuple[torch.Tensor, ...]:
    """F.rms_norm(x [T, H] fp32, gain) as bf16_parts."""
    return bf16_parts(F.rms_norm(x, (x.shape[-1],), gain, eps), split)


@lazy_triton
def _rms_norm_kernel(triton: Any, tl: Any) -> Any:
    @triton.jit
    def rms_norm_bf16_kernel(x_ptr, g_ptr, hi_ptr, lo_ptr, h, eps, BLOCK: tl.constexpr,
                             HAS_GAIN: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
        # One program a row: the sum of squares in one sweep, the scaled row in a second
        # (the row is back from L2 by then).
        row = x_ptr + tl.program_id(0).to(tl.int64) * h
        acc = tl.zeros([BLOCK], tl.float32)
        for a in range(0, h, BLOCK):
            i = a + tl.arange(0, BLOCK)
            v = tl.load(row + i, mask=i < h, other=0.0)
            acc += v * v
        r = tl.math.rsqrt(tl.sum(acc, 0) / h + eps)
        out = tl.program_id(0).to(tl.int64) * h
        for a in range(0, h, BLOCK):
            i = a + tl.arange(0, BLOCK)
            live = i < h
            y = tl.load(row + i, mask=live, other=0.0) * r
            if HAS_GAIN:
                y = y * tl.load(g_ptr + i, mask=live, other=0.0)
            hi = y.to(tl.bfloat16)
            tl.store(hi_ptr + out + i, hi, mask=live)
            if SPLIT:
                tl.store(lo_ptr + out + i, (y - hi.to(tl.float32)).to(tl.bfloat16), mask=live)

    return rms_norm_bf16_kernel


def _rms_norm_triton(
    x: torch.Tensor, gain: torch.Tensor | None, eps: float, split: bool
) -> tuple[torch.Tensor, ...]:
    t, h = x.shape
    hi = torch.empty(t, h, dtype=torch.bfloat16, device=x.device)
    lo = torch.empty_like(hi) if split else hi
    block = min(4096, pow2_at_least(h))
    _rms_norm_kernel()[(t,)](
        x, gain if gain is not None else x, hi, lo, h, eps,
        BLOCK=block, HAS_GAIN=gain is not None, SPLIT=split, num_warps=4,
    )  # fmt: skip
    return (hi, lo) if split else (hi,)


def rms_norm_bf16(
    x: torch.Tensor, gain: torch.Tensor | None, eps: float, split: bool = False
) -> tuple[torch.Tensor, ...]:
    """x [T, H] fp32 contiguous -> RMSNorm(x) * gain as bf16: (hi,) or (hi, lo)."""
    if x.is_cuda and x.is_contiguous() and rms_norm_fused_ok(x.device):
        return _rms_norm_triton(x, gain, eps, split)
    return rms_norm_reference(x, gain, eps, split)


def rms_norm_fused_ok(device: torch.device) -> bool:
    """Whether the Triton norm runs on this device and agrees with PyTorch (once per device;
    MONOKERNEL_PREFILL_FUSED=0 or MONOKERNEL_PREFILL_EPILOGUE=0: never): hi within one bf16
    step, hi + lo within 2^-14."""

    def probe() -> bool:
        g = torch.Generator(device="cpu").manual_seed(0)
        x = (3 * torch.randn(9, 5000, generator=g)).to(device)
        gain = torch.rand(5000, generator=g).to(device) + 0.5
        try:
            return all(
                norm_parts_agree(
                    _rms_norm_triton(x, gn, 1e-5, True), rms_norm_reference(x, gn, 1e-5, True)
                )
                for gn in (gain, None)
            )
        except Exception:  # no Triton, no compiler, no driver: PyTorch does it
            return False

    return epilogue_enabled() and probed_once(_NORM_OK, device, probe)


def norm_parts_agree(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> bool:
    """(hi, lo) pairs of rms_norm_bf16's two forms: hi one bf16 step apart at most (the sum
    of squares is added in another order), and hi + lo the same to 2^-14 relative."""
    hi, lo = (t.float() for t in got)
    whi, wlo = (t.float() for t in want)
    return bool(
        torch.allclose(hi, whi, rtol=2**-7, atol=1e-30)
        and torch.allclose(hi + lo, whi + wlo, rtol=2**-14, atol=1e-6)
    )
