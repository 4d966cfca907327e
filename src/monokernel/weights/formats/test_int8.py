"""How the int8 weight format (one signed byte a weight, a float32 scale a row, symmetric)
rounds: half a step at most and the integers it stores exactly, which test_row_scaled.py
checks int8 against (with all int8 shares with fp8), and what only int8 rounding shows:
-128 never used, the nearest integer for each weight."""

from __future__ import annotations

import pytest
import torch

from monokernel.weights.formats import get_format

INT8 = get_format("int8")


def representable() -> torch.Tensor:
    """The integers in [-127, 127]: symmetric, -128 is never stored."""
    return torch.arange(-127, 128).float()


def error_bound(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Round to nearest on a uniform grid of step s: half a step, plus float32's rounding of
    the division and the product."""
    return s[:, None] / 2 + w.abs().amax(dim=1, keepdim=True) * 2**-20


@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (7, 13), (33, 5), (3, 130), (5, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_minus_128_is_never_used(rows: int, cols: int, dtype: torch.dtype) -> None:
    """Symmetric: a row's amax maps onto 127 whichever its sign (test_row_scaled.py packs
    the same matrices)."""
    g = torch.Generator().manual_seed(1)
    m = INT8.pack(torch.randn(rows, cols, generator=g).to(dtype))
    assert m.data.min() >= -127


def test_a_row_whose_largest_weight_is_negative_rounds_each_to_the_nearest_integer() -> None:
    """The scales and the stored -127 and 127 are test_row_scaled.py's; here every byte."""
    w = torch.tensor([[-3.0, 1.0, 2.0], [0.5, -0.25, 0.125]])
    m = INT8.pack(w)
    assert m.data.tolist() == [[-127, 42, 85], [127, -64, 32]]
    torch.testing.assert_close(INT8.dense(m, torch.float32), w, rtol=0, atol=3.0 / 127 / 2)
