"""fp8 rows: each weight one float8 e4m3 byte, each row (output feature) one float32 scale.

Layout, like bf16's: row-major [rows, cols] with the input dimension contiguous, so the
kernel keeps giving each warp whole rows; a 16-byte load now brings 16 weights instead of 8,
which halves the bytes a decode step streams. The kernel accumulates a row's dot product of
the raw fp8 values with the activations and multiplies it once by the row's fp32 scale:
``data`` holds exactly the bytes it streams and ``scales[0]`` the [rows] scales.

A row's scale maps its largest magnitude onto e4m3's largest finite value (448), so each row
uses the whole range whatever its size; a row of zeros gets scale 1 (any scale represents it,
and 1 keeps the division finite). Everything is per row: packing rows apart and stacking
them gives the same bytes as packing the stack, so the repack may fuse (Q/K/V, gate/up)
before or after packing, and a rank's row block carries its own scales.

``RowScaled`` is the part fp8 and int8 (int8.py) share: they differ only in how a scaled row
is rounded to one byte.

fp8 has a second layout, told apart by ``data``'s rank: 16-row tiles for the tensor cores
(tiles.py's byte tiles, [rows / 16, cols / 32, 32, 16], csrc/formats/fp8_tiles.cuh), the
same bytes reordered, the same [rows] scales. ``Fp8Rows(tiles=True)`` packs it; every other
method reads either layout. Which one the monokernel streams is tiles.py's ``tiles_for``.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from typing import ClassVar

import torch

from monokernel import envs
from monokernel.weights.formats.base import PackedMatrix, WeightFormat, check_block
from monokernel.weights.formats.tiles import (
    TILE_ROWS,
    check_tile_shape,
    pack_byte_tiles,
    unpack_byte_tiles,
)

_FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_SCALE_BYTES = 4  # float32


class RowScaled(WeightFormat):
    """One byte a weight and one float32 scale a row; the value is ``data[r, c] * s[r]``."""

    packs_in_place = False
    weights_per_load = 16
    qmax: ClassVar[float]  # the largest stored magnitude; a row's amax maps onto it
    has_tiles: ClassVar[bool] = False  # whether the kernel reads this format as tiles

    def __init__(self, tiles: bool = False) -> None:
        if tiles and not self.has_tiles:
            raise ValueError(f"{self.name} has no tile layout (the kernel streams it in rows)")
        self.tiles = tiles  # pack in the tile layout (instances differ; the class says rows)

    @staticmethod
    def is_tiled(m: PackedMatrix) -> bool:
        return m.data.dim() == 4

    def stored(self, m: PackedMatrix) -> torch.Tensor:
        """m's stored values as a [rows, cols] matrix, in either layout."""
        if not self.is_tiled(m):
            return m.data
        return unpack_byte_tiles(m.data.view(torch.uint8)).view(m.data.dtype)

    @abstractmethod
    def _round(self, scaled: torch.Tensor) -> torch.Tensor:
        """w / s (float32, |.| <= qmax up to rounding) -> the stored bytes."""

    def row_scales(self, w: torch.Tensor) -> torch.Tensor:
        amax = w.float().abs().amax(dim=1)  # [rows]
        return torch.where(amax > 0, amax / self.qmax, torch.ones_like(amax))

    def pack(self, w: torch.Tensor, scales: torch.Tensor | None = None) -> PackedMatrix:
        if w.dim() != 2 or not w.is_floating_point():
            raise ValueError(
                f"{self.name} packs a floating-point matrix; got {w.dtype} {tuple(w.shape)}"
            )
        rows, cols = w.shape
        wf = w.float()  # one rounding of the input, so any float dtype scales alike
        if scales is None:
            s = self.row_scales(wf)
        elif tuple(scales.shape) != (rows,):
            raise ValueError(f"{self.name}: scales {tuple(scales.shape)} for {rows} rows")
        else:
            s = scales.float().to(wf.device)
        q = self._round(wf / s[:, None])  # [rows, cols]
        if self.tiles:
            check_tile_shape(self.name, rows, cols)
            q = pack_byte_tiles(q.view(torch.uint8)).view(q.dtype)
        return PackedMatrix(self.name, rows, cols, q.contiguous(), (s.contiguous(),))

    def dense(self, m: PackedMatrix, dtype: torch.dtype | None = None) -> torch.Tensor:
        # float32 product first: with dtype=float32 the result is exactly what the kernel
        # multiplies by; bf16 rounds it once, as the prefill's GEMMs want.
        (s,) = m.scales
        return (self.stored(m).float() * s[:, None]).to(dtype or torch.bfloat16)

    def gemm_operands(
        self, m: PackedMatrix, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The stored values (e4m3's 4 significant bits, int8's 7) are exact in bf16, so the
        # prefill's GEMM sees the kernel's weights without a second rounding of q * s.
        dtype = dtype or torch.bfloat16
        tiled_on_gpu = self.is_tiled(m) and m.data.is_cuda
        if tiled_on_gpu and dtype == torch.bfloat16 and envs.MONOKERNEL_PREFILL_TRITON:
            from monokernel.weights.formats.fp8_triton import untile_bf16

            return untile_bf16(m.data, m.cols), m.scales[0]
        return self.stored(m).to(dtype), m.scales[0]

    def matrix_bytes(self, rows: int, cols: int) -> int:
        return rows * cols + _SCALE_BYTES * rows

    def slice_rows(self, m: PackedMatrix, start: int, size: int) -> PackedMatrix:
        check_block(m, start, size, "rows")
        (s,) = m.scales
        end = start + size
        data = m.data
        if self.is_tiled(m):
            if start % TILE_ROWS or size % TILE_ROWS:
                raise ValueError(
                    f"{self.name} tiles: rows [{start}, {end}) cut tiles of {TILE_ROWS}"
                )
            data = data[start // TILE_ROWS : end // TILE_ROWS]
        else:
            data = data[start:end]
        return dataclasses.replace(m, rows=size, data=data, scales=(s[start:end],))

    def slice_cols(self, m: PackedMatrix, start: int, size: int) -> PackedMatrix:
        # The scales are a row's: every column block of a row shares them, so partial dot
        # products scaled alike sum to the whole row's.
        check_block(m, start, size, "cols")
        block = self.stored(m)[:, start : start + size].contiguous()  # a copy
        if self.is_tiled(m):
            check_tile_shape(self.name, m.rows, size)
            block = pack_byte_tiles(block.view(torch.uint8)).view(block.dtype)
        return dataclasses.replace(m, cols=size, data=block)


class Fp8Rows(RowScaled):
    name = "fp8"
    kernel_type = "Fp8Rows"  # in tiles: Fp8Tiles (build.py)
    qmax = _FP8_MAX
    has_tiles = True

    def _round(self, scaled: torch.Tensor) -> torch.Tensor:
        # Clamped first: the division can land a hair past 448, and e4m3fn has no infinity
        # to saturate to (an out-of-range value converts to NaN).
        return scaled.clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
