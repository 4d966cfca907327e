"""bf16 rows: the matrix itself, row-major [rows, cols] with the input dimension contiguous,
two bytes an element. The kernel gives each warp whole rows and streams a row with 16-byte
loads, lanes side by side; the prefill's GEMMs read the same tensor, no copy.

A float32 matrix is kept float32: the CPU tests repack in the reference's precision to check
the repack, the schedule and the prefill exactly. The kernel never sees one (the backend
converts a checkpoint to bf16 before repacking).
"""

from __future__ import annotations

import dataclasses

import torch

from monokernel.weights.formats.base import PackedMatrix, WeightFormat, check_block

_KEPT = (torch.bfloat16, torch.float32)
_ELEMENT_BYTES = 2


class Bf16(WeightFormat):
    name = "bf16"
    kernel_type = "Bf16Rows"
    weights_per_load = 8
    packs_in_place = True

    def pack(self, w: torch.Tensor, scales: torch.Tensor | None = None) -> PackedMatrix:
        if scales is not None:
            raise ValueError("bf16 has no scales to pack with")
        if w.dim() != 2 or not w.is_floating_point():
            raise ValueError(f"bf16 packs a floating-point matrix; got {w.dtype} {tuple(w.shape)}")
        data = w if w.dtype in _KEPT else w.to(torch.bfloat16)
        rows, cols = w.shape
        return PackedMatrix(self.name, rows, cols, data.contiguous())  # [rows, cols]

    def dense(self, m: PackedMatrix, dtype: torch.dtype | None = None) -> torch.Tensor:
        if dtype is None or dtype == m.data.dtype:
            return m.data  # [rows, cols], the streamed tensor itself
        return m.data.to(dtype)

    def matrix_bytes(self, rows: int, cols: int) -> int:
        return _ELEMENT_BYTES * rows * cols

    def slice_rows(self, m: PackedMatrix, start: int, size: int) -> PackedMatrix:
        check_block(m, start, size, "rows")
        return dataclasses.replace(m, rows=size, data=m.data[start : start + size])  # a view

    def slice_cols(self, m: PackedMatrix, start: int, size: int) -> PackedMatrix:
        check_block(m, start, size, "cols")
        block = m.data[:, start : start + size].contiguous()  # rows stay contiguous: a copy
        return dataclasses.replace(m, cols=size, data=block)
