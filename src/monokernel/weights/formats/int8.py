"""int8: each weight one byte, in one of two forms.

Rows (``Int8Rows()``, ``--quantize int8``): each weight one signed byte, each row (output
feature) one float32 scale. Layout, like bf16's: row-major [rows, cols] with the input
dimension contiguous, so the kernel keeps giving each warp whole rows; a 16-byte load brings
16 weights instead of 8, which halves the bytes a decode step streams. The kernel
accumulates a row's dot product of the raw integers with the activations and multiplies it
once by the row's fp32 scale: ``data`` holds exactly the bytes it streams and ``scales[0]``
the [rows] scales. Symmetric, no zero point: a row's scale maps its largest magnitude onto
127 and -128 is never used, so negating a row negates its bytes and zero is exact. Rounding
is to the nearest step (an error of at most half a scale a weight). A row of zeros gets
scale 1. The packing, the slicing and the byte count are fp8's (``RowScaled`` in fp8.py),
per row, so the repack may fuse rows before or after packing.

Groups (``Int8Rows(group=g)``, g 16 or 32; ``pack_groups`` only): a GGUF file's 5-, 6- and
8-bit blocks with their values unchanged (weights/gguf_8bit.py): w = a u + b per group of g
input columns of a row, u an unsigned byte. Only in 16-row tiles (csrc/formats/
int8_tiles.cuh): ``data`` is tiles.py's byte tiles [rows / 16, cols / 32, 32, 16] of u,
``scales[0]`` float32 [rows / 16, cols / g, 8, 4], int4.py's tile pairs with base 1024:
for rows g and g + 8 of a tile (a, b - 1024 a) (the kernel multiplies 1024 + u, an f16).
dense() gives a (1024 + u) + (b - 1024 a), the value the kernel multiplies by, within an
fp32 rounding of a u + b. A grouped matrix is told apart by its scales' rank (4).
"""

from __future__ import annotations

import dataclasses

import torch

from monokernel import envs
from monokernel.weights.formats.base import PackedMatrix, check_block
from monokernel.weights.formats.fp8 import RowScaled
from monokernel.weights.formats.int4 import check_groups, group_cols, tile_pairs, untile_pairs
from monokernel.weights.formats.tiles import (
    TILE_ROWS,
    check_tile_shape,
    pack_byte_tiles,
    unpack_byte_tiles,
)

_INT8_MAX = 127.0
GROUPS = (16, 32)  # group sizes the kernel reads: a k-tile, or one load's 32 columns
BASE = 1024.0  # the kernel widens u to the f16 1024 + u
_PAIR_BYTES = 8  # float32 a and b


class Int8Rows(RowScaled):
    name = "int8"
    kernel_type = "Int8Rows"  # with groups: Int8GroupTiles<g> (build.py)
    qmax = _INT8_MAX

    def __init__(self, tiles: bool = False, block: int = 0, group: int = 0) -> None:
        super().__init__(tiles, block)
        if group and group not in GROUPS:
            raise ValueError(f"int8 group {group}: the kernel reads groups of {GROUPS}")
        self.group = group  # columns a pair covers (a grouped instance); 0: row scales

    def _round(self, scaled: torch.Tensor) -> torch.Tensor:
        return torch.round(scaled).clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)

    @staticmethod
    def is_grouped(m: PackedMatrix) -> bool:
        return m.scales[0].dim() == 4

    @staticmethod
    def group_of(m: PackedMatrix) -> int:
        return m.cols // m.scales[0].shape[1] if Int8Rows.is_grouped(m) else 0

    def pack(self, w: torch.Tensor, scales: torch.Tensor | None = None) -> PackedMatrix:
        if self.group:
            raise ValueError("int8 groups pack a checkpoint's own values (pack_groups)")
        return super().pack(w, scales)

    def pack_groups(self, q: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> PackedMatrix:
        """q uint8 [rows, cols], a and b float32 [rows, cols / group] -> the grouped tiles,
        the values unchanged (w = a q + b)."""
        rows, cols = q.shape
        check_groups("int8", q, a, b, GROUPS)
        check_tile_shape("int8", rows, cols)
        pairs = tile_pairs(a, b, BASE)
        return PackedMatrix(self.name, rows, cols, pack_byte_tiles(q), (pairs,))

    def groups_of(self, m: PackedMatrix) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A grouped m's (q uint8 [rows, cols], a, b [rows, groups])."""
        a, b0 = untile_pairs(m.scales[0])
        return unpack_byte_tiles(m.data), a, b0 + BASE * a

    def dense(self, m: PackedMatrix, dtype: torch.dtype | None = None) -> torch.Tensor:
        if not self.is_grouped(m):
            return super().dense(m, dtype)
        if m.data.is_cuda and dtype in (None, torch.bfloat16) and envs.MONOKERNEL_PREFILL_TRITON:
            from monokernel.weights.formats.fp8_triton import untile_bf16

            return untile_bf16(m.data, m.cols, pairs=m.scales[0])
        a, b0 = untile_pairs(m.scales[0])
        g = self.group_of(m)
        u = unpack_byte_tiles(m.data).float().view(m.rows, -1, g) + BASE
        w = u * a[:, :, None] + b0[:, :, None]  # as the kernel: a (1024 + u) + (b - 1024 a)
        return w.view(m.rows, m.cols).to(dtype or torch.bfloat16)

    def gemm_operands(
        self, m: PackedMatrix, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.is_grouped(m):  # pairs do not factor out of a row: the matrix, rounded once
            return self.dense(m, dtype), None
        return super().gemm_operands(m, dtype)

    def matrix_bytes(self, rows: int, cols: int) -> int:
        if self.group:
            return rows * cols + _PAIR_BYTES * rows * (cols // self.group)
        return super().matrix_bytes(rows, cols)

    def slice_rows(self, m: PackedMatrix, start: int, size: int) -> PackedMatrix:
        if not self.is_grouped(m):
            return super().slice_rows(m, start, size)
        check_block(m, start, size, "rows")
        if start % TILE_ROWS or size % TILE_ROWS:
            raise ValueError(f"int8 tiles: rows [{start}, {start + size}) cut tiles of 16")
        t = slice(start // TILE_ROWS, (start + size) // TILE_ROWS)
        return dataclasses.replace(m, rows=size, data=m.data[t], scales=(m.scales[0][t],))

    def slice_cols(self, m: PackedMatrix, start: int, size: int) -> PackedMatrix:
        if not self.is_grouped(m):
            return super().slice_cols(m, start, size)
        check_block(m, start, size, "cols")
        g = self.group_of(m)
        return Int8Rows(group=g).pack_groups(*group_cols("int8", self.groups_of(m), g, start, size))
