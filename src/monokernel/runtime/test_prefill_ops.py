"""The prefill's fused element-wise steps (prefill_ops.py) against plain PyTorch: on the CPU
the fallback paths, on a GPU (marker ``gpu``) the Triton kernel and the in-place addmm."""

from __future__ import annotations

import pytest
import torch

from monokernel.runtime.prefill import gemm_bf16, gemm_bf16_acc
from monokernel.runtime.prefill_ops import (
    addmm_fp32_ok,
    silu_mul_bf16,
    silu_mul_fused_ok,
    silu_mul_reference,
)


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
