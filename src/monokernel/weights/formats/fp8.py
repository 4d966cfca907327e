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

In tiles fp8 may also keep a checkpoint's block scales (HF fine-grained FP8, 128 x 128
blocks): ``Fp8Rows(tiles=True, block=bn)`` stores one float32 scale a row and block of bn
columns, ``scales[0]`` [rows / 16, cols / bn, 16] (a tile's 16 rows of one block together,
as csrc Fp8BlockTiles reads them; each block's scale repeated over its rows, so fused and
interleaved rows keep theirs). The value is ``data[r, c] * s[r, c // bn]``: given the
checkpoint's dequantised weights and its scales so repeated, ``pack`` finds the
checkpoint's own E4M3 values again (w / s is q within bf16's rounding, far inside half an
E4M3 step).
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from typing import ClassVar

import torch

from monokernel import envs
from monokernel.weights.formats.base import PackedMatrix, WeightFormat, check_block
from monokernel.weights.formats.tiles import (
    TILE_COLS,
    TILE_ROWS,
    block_fits,
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

    def __init__(self, tiles: bool = False, block: int = 0) -> None:
        if tiles and not self.has_tiles:
            raise ValueError(f"{self.name} has no tile layout (the kernel streams it in rows)")
        if block and not (tiles and block_fits(block)):
            raise ValueError(
                f"{self.name}: block scales of {block} columns; the kernel reads them in tiles, "
                f"blocks a power of two of at least {TILE_COLS} columns"
            )
        self.tiles = tiles  # pack in the tile layout (instances differ; the class says rows)
        self.block = block  # columns a scale covers; 0: one scale a row

    @staticmethod
    def is_tiled(m: PackedMatrix) -> bool:
        return m.data.dim() == 4

    @staticmethod
    def block_of(m: PackedMatrix) -> int:
        """The columns one of m's scales covers; 0 where each row has one scale."""
        s = m.scales[0]
        return m.cols // s.shape[1] if s.dim() == 3 else 0

    def scales_of(self, m: PackedMatrix) -> torch.Tensor:
        """m's scales a row: [rows], or with block scales [rows, cols / block]."""
        s = m.scales[0]
        return s if s.dim() == 1 else s.permute(0, 2, 1).reshape(m.rows, s.shape[1])

    def _expanded(self, m: PackedMatrix) -> torch.Tensor:
        """The scale of each weight's row (and block) broadcasting against [rows, cols]."""
        s = self.scales_of(m)
        block = self.block_of(m)
        return s[:, None] if not block else s.repeat_interleave(block, dim=1)

    def stored(self, m: PackedMatrix) -> torch.Tensor:
        """m's stored values as a [rows, cols] matrix, in either layout."""
        return unpack_byte_tiles(m.data) if self.is_tiled(m) else m.data

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
        if self.block:
            return self._pack_blocks(wf, scales)
        if scales is None:
            s = self.row_scales(wf)
        elif tuple(scales.shape) != (rows,):
            raise ValueError(f"{self.name}: scales {tuple(scales.shape)} for {rows} rows")
        else:
            s = scales.float().to(wf.device)
        q = self._round(wf / s[:, None])  # [rows, cols]
        if self.tiles:
            check_tile_shape(self.name, rows, cols)
            q = pack_byte_tiles(q)
        return PackedMatrix(self.name, rows, cols, q.contiguous(), (s.contiguous(),))

    def _pack_blocks(self, wf: torch.Tensor, scales: torch.Tensor | None) -> PackedMatrix:
        """pack with a scale a row and block: ``scales`` [rows, cols / block], or each
        row's block's amax / qmax where None."""
        rows, cols = wf.shape
        check_tile_shape(self.name, rows, cols)
        if cols % self.block:
            raise ValueError(f"{self.name}: {cols} columns are not whole blocks of {self.block}")
        nb = cols // self.block
        if scales is None:
            amax = wf.abs().view(rows, nb, self.block).amax(dim=2)
            s = torch.where(amax > 0, amax / self.qmax, torch.ones_like(amax))
        elif tuple(scales.shape) != (rows, nb):
            raise ValueError(
                f"{self.name}: block scales {tuple(scales.shape)} for a [{rows}, {cols}] matrix "
                f"in blocks of {self.block} columns (expected ({rows}, {nb}))"
            )
        else:
            s = scales.float().to(wf.device)
        q = self._round(wf / s.repeat_interleave(self.block, dim=1))
        data = pack_byte_tiles(q)
        tiled = s.view(rows // TILE_ROWS, TILE_ROWS, nb).permute(0, 2, 1).contiguous()
        return PackedMatrix(self.name, rows, cols, data, (tiled,))

    def dense(self, m: PackedMatrix, dtype: torch.dtype | None = None) -> torch.Tensor:
        # float32 product first: with dtype=float32 the result is exactly what the kernel
        # multiplies by; bf16 rounds it once, as the prefill's GEMMs want.
        return (self.stored(m).float() * self._expanded(m)).to(dtype or torch.bfloat16)

    def gemm_operands(
        self, m: PackedMatrix, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The stored values (e4m3's 4 significant bits, int8's 7) are exact in bf16, so the
        # prefill's GEMM sees the kernel's weights without a second rounding of q * s. Block
        # scales do not factor out of a row: the matrix itself, rounded once.
        dtype = dtype or torch.bfloat16
        blocks = self.block_of(m) > 0
        tiled_on_gpu = self.is_tiled(m) and m.data.is_cuda
        if tiled_on_gpu and dtype == torch.bfloat16 and envs.MONOKERNEL_PREFILL_TRITON:
            from monokernel.weights.formats.fp8_triton import untile_bf16

            if blocks:
                return untile_bf16(m.data, m.cols, m.scales[0]), None
            return untile_bf16(m.data, m.cols), m.scales[0]
        if blocks:
            return self.dense(m, dtype), None
        return self.stored(m).to(dtype), m.scales[0]

    def matrix_bytes(self, rows: int, cols: int) -> int:
        return rows * cols + _SCALE_BYTES * rows * (cols // self.block if self.block else 1)

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
            s = s[start // TILE_ROWS : end // TILE_ROWS] if self.block_of(m) else s[start:end]
        else:
            s = s[start:end]
            data = data[start:end]
        return dataclasses.replace(m, rows=size, data=data, scales=(s,))

    def slice_cols(self, m: PackedMatrix, start: int, size: int) -> PackedMatrix:
        # The scales are a row's: every column block of a row shares them, so partial dot
        # products scaled alike sum to the whole row's.
        # Block scales: a block of whole blocks keeps theirs.
        check_block(m, start, size, "cols")
        cols = self.stored(m)[:, start : start + size].contiguous()  # a copy
        scales = m.scales
        if bn := self.block_of(m):
            if start % bn or size % bn:
                raise ValueError(
                    f"{self.name}: columns [{start}, {start + size}) cut blocks of {bn}"
                )
            scales = (m.scales[0][:, start // bn : (start + size) // bn].contiguous(),)
        if self.is_tiled(m):
            check_tile_shape(self.name, m.rows, size)
            cols = pack_byte_tiles(cols)
        return dataclasses.replace(m, cols=size, data=cols, scales=scales)


class Fp8Rows(RowScaled):
    name = "fp8"
    kernel_type = "Fp8Rows"  # in tiles: Fp8Tiles (build.py)
    qmax = _FP8_MAX
    has_tiles = True

    def _round(self, scaled: torch.Tensor) -> torch.Tensor:
        # Clamped first: the division can land a hair past 448, and e4m3fn has no infinity
        # to saturate to (an out-of-range value converts to NaN).
        return scaled.clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
