"""The prefill's fused element-wise steps (prefill_ops.py) against plain PyTorch: on the CPU
the fallback paths, on a GPU (marker ``gpu``) the Triton kernel and the in-place addmm."""

from __future__ import annotations

import pytest
import torch

from monokernel.runtime.prefill import gemm_bf16, gemm_bf16_acc
from monokernel.runtime.prefill_ops import (
    _rms_norm_triton,
    addmm_fp32_ok,
    norm_parts_agree,
    rms_norm_bf16,
    rms_norm_fused_ok,
    rms_norm_reference,
    silu_mul_bf16,
    silu_mul_fused_ok,
    silu_mul_reference,
)
from monokernel.testing.triton_interpreter import interpreted


def _pair(t: int, i: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(t * 7 + i)
    return (3 * torch.randn(t, i, generator=g)).to(device), torch.randn(t, i, generator=g).to(
        device
    )


@pytest.mark.parametrize(("t", "i"), [(1, 1), (3, 1000), (17, 8192)])
def test_silu_mul_on_the_cpu_is_silu_times_up_in_bf16(t: int, i: int) -> None:
    gate, up = _pair(t, i, "cpu")
    want = (gate * torch.sigmoid(gate) * up).to(torch.bfloat16)
    got = silu_mul_bf16(gate.clone(), up)
    assert got.dtype == torch.bfloat16 and got.shape == (t, i)
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-6)


def test_gemm_acc_adds_the_product_on_the_cpu() -> None:
    g = torch.Generator().manual_seed(0)
    acc, x, w = torch.randn(5, 7, generator=g), torch.randn(5, 9, generator=g), torch.randn(7, 9)
    want = acc + gemm_bf16(x, w)
    gemm_bf16_acc(acc, x, w)
    torch.testing.assert_close(acc, want)


NORM_CASES = [(1, 1), (3, 1001), (5, 4096), (2, 8960), (4, 9000)]  # (T, H): one and two sweeps


def _norm_input(t: int, h: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(t * 31 + h)
    x = (5 * torch.randn(t, h, generator=g)).to(device)
    return x, (torch.rand(h, generator=g) + 0.5).to(device)


def test_rms_norm_on_the_cpu_is_the_reference_norm_rounded() -> None:
    x, gain = _norm_input(3, 70, "cpu")
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * gain
    hi, lo = rms_norm_bf16(x, gain, 1e-5, split=True)
    torch.testing.assert_close(hi.float(), y.to(torch.bfloat16).float())
    torch.testing.assert_close(hi.float() + lo.float(), y, rtol=2**-15, atol=1e-6)
    (only,) = rms_norm_bf16(x, None, 1e-5)
    assert only.dtype == torch.bfloat16 and only.shape == (3, 70)


def _interpreted_norm(t: int, h: int) -> bool:
    """The Triton norm in Triton's interpreter against the reference, with and without gain.
    Its bf16 casts truncate (the GPU rounds to nearest): hi within one bf16 step, hi + lo
    within 2^-13."""
    x, gain = _norm_input(t, h, "cpu")
    for gn in (gain, None):
        hi, lo = (p.float() for p in _rms_norm_triton(x, gn, 1e-5, True))
        whi, wlo = (p.float() for p in rms_norm_reference(x, gn, 1e-5, True))
        if not torch.allclose(hi, whi, rtol=2**-7, atol=1e-30):
            return False
        if not torch.allclose(hi + lo, whi + wlo, rtol=2**-13, atol=1e-6):
            return False
    return True


@pytest.mark.parametrize("case", NORM_CASES, ids=str)
def test_triton_norm_logic_in_the_interpreter(case: tuple[int, int]) -> None:
    """Rows shorter than one block, one block, and several (the two sweeps' masks), in a
    fresh process: the interpreter must be chosen before Triton is imported."""
    call = f"_interpreted_norm(*{case!r})"
    assert interpreted("monokernel.runtime.test_prefill_ops", call) == "True"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("t", "i"), [(1, 1), (3, 1001), (512, 8192), (129, 8960)])
def test_triton_silu_mul_matches_pytorch(t: int, i: int) -> None:
    assert silu_mul_fused_ok(torch.device("cuda")), "prefill would run silu and mul apart"
    gate, up = _pair(t, i, "cuda")
    want = silu_mul_reference(gate.clone(), up).float()
    got = silu_mul_bf16(gate.clone(), up).float()
    # bf16 rounding of values within an ulp of each other: at most one bf16 step apart
    torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-6)


@pytest.mark.gpu
@needs_cuda
def test_in_place_addmm_is_used_and_exact() -> None:
    assert addmm_fp32_ok(torch.device("cuda")), "prefill would add in separate passes"
    g = torch.Generator().manual_seed(1)
    acc = torch.randn(300, 520, generator=g).cuda()
    x, w = torch.randn(300, 2048, generator=g).cuda(), torch.randn(520, 2048, generator=g).cuda()
    want = acc + gemm_bf16(x, w)
    gemm_bf16_acc(acc, x, w)
    torch.testing.assert_close(acc, want, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", [*NORM_CASES, (512, 2048), (500, 1536)], ids=str)
def test_triton_norm_matches_pytorch(case: tuple[int, int]) -> None:
    assert rms_norm_fused_ok(torch.device("cuda")), "prefill would norm and round apart"
    x, gain = _norm_input(*case, "cuda")
    for gn in (gain, None):
        got = rms_norm_bf16(x, gn, 1e-5, split=True)
        assert norm_parts_agree(got, rms_norm_reference(x, gn, 1e-5, True))
        (hi,) = rms_norm_bf16(x, gn, 1e-5)
        assert torch.equal(hi, got[0])
