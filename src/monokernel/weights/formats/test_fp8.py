"""How the fp8 weight format (one e4m3 byte a weight, a float32 scale a row) rounds: the
error bound of e4m3's round to nearest and the values it stores exactly, which
test_row_scaled.py checks fp8 against (with all fp8 shares with int8), and what only fp8
rounding shows."""

from __future__ import annotations

import torch

from monokernel.weights.formats import get_format

FP8 = get_format("fp8")
E4M3 = torch.float8_e4m3fn


def representable() -> torch.Tensor:
    """Every finite e4m3fn value (254 of the 256 bytes; 0x7f and 0xff are NaN)."""
    v = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    return v[~v.isnan()]


def error_bound(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Round to nearest on e4m3: in a binade [2^e, 2^(e+1)), e >= -6, the step is 2^(e-3),
    so the error is at most half a step, 2^(e-4) <= |x| 2^-4; below 2^-6 (subnormals) the
    step is 2^-9 and the error at most 2^-10. x = w / s, so in w's units
    max(|w| 2^-4, s 2^-10); plus float32's rounding of the division and the product."""
    s = s[:, None]
    return torch.maximum(w.abs() * 2**-4, s * 2**-10) + w.abs().amax(dim=1, keepdim=True) * 2**-20


def test_a_row_whose_largest_weight_is_negative_keeps_e4m3s_relative_step() -> None:
    """The scales and the stored -448 and 448 are test_row_scaled.py's; each weight is
    within 2^-4 of itself, relative."""
    w = torch.tensor([[-3.0, 1.0, 2.0], [0.5, -0.25, 0.125]])
    torch.testing.assert_close(FP8.dense(FP8.pack(w), torch.float32), w, rtol=2**-4, atol=0)
