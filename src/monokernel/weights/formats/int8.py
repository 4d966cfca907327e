"""int8 rows: each weight one signed byte, each row (output feature) one float32 scale.

Layout, like bf16's: row-major [rows, cols] with the input dimension contiguous, so the
kernel keeps giving each warp whole rows; a 16-byte load brings 16 weights instead of 8,
which halves the bytes a decode step streams. The kernel accumulates a row's dot product of
the raw integers with the activations and multiplies it once by the row's fp32 scale:
``data`` holds exactly the bytes it streams and ``scales[0]`` the [rows] scales.

Symmetric, no zero point: a row's scale maps its largest magnitude onto 127 and -128 is never
used, so negating a row negates its bytes and zero is exact. Rounding is to the nearest step
(an error of at most half a scale a weight). A row of zeros gets scale 1. The packing, the
slicing and the byte count are fp8's (``RowScaled`` in fp8.py), per row, so the repack may
fuse rows before or after packing.
"""

from __future__ import annotations

import torch

from monokernel.weights.formats.fp8 import RowScaled

_INT8_MAX = 127.0


class Int8Rows(RowScaled):
    name = "int8"
    kernel_type = "Int8Rows"
    qmax = _INT8_MAX

    def _round(self, scaled: torch.Tensor) -> torch.Tensor:
        return torch.round(scaled).clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
