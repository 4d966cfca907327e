"""16-row tiles: the layout in which the monokernel multiplies int4 and fp8 layers on the
tensor cores (csrc/gemv_tiles.cuh) rather than a warp a row on the CUDA cores, and which
layout a model's layers are packed in (``tiles_for``, MONOKERNEL_WEIGHT_LAYOUT).

The tiles hold the same values as the rows, reordered so that each lane's 16-byte load is
its A fragments of mma.m16n8k16 (PTX's m16n8k16 fragment layout: lane l = 4g + t holds, in
register order, the elements (g, 2t) (g, 2t+1) (g+8, 2t) (g+8, 2t+1) (g, 2t+8) (g, 2t+9)
(g+8, 2t+8) (g+8, 2t+9) of a 16 x 16 k-tile). int4.py packs nibbles that way; a format of
one byte a weight (fp8) packs bytes with ``pack_byte_tiles``:

    data [rows / 16, cols / 32, 32 lanes, 16]: bytes 8i .. 8i + 7 of lane l are its 8
    elements of k-tile i of the load's 32 columns, in register order.

Element e = 4 e2 + 2 e1 + e0 of lane (g, t) is row g + 8 e1, column 8 e2 + 2t + e0, so the
layout is one permutation of axes (no gather): a copy to pack or unpack.
"""

from __future__ import annotations

import torch

from monokernel import envs

TILE_ROWS = 16  # rows of a tile (the mma's M)
TILE_COLS = 64  # inputs come in whole 64-column blocks (int4: one warp-wide load)
BYTE_TILE_COLS = 32  # a one-byte format's columns in one warp-wide load (2 k-tiles)
SMS = 132  # an H100's or H200's SMs: the decode kernel's CTAs
TILE_FORMATS = ("int4", "fp8")  # the formats the kernel streams as tiles (csrc/formats/*_tiles)


def tiles_for(fmt: str, hidden: int, q_size: int, kv_size: int, intermediate: int) -> bool:
    """Whether the monokernel streams the layers of a model (one rank's sizes under tensor
    parallelism) in format ``fmt`` as 16-row tiles (MONOKERNEL_WEIGHT_LAYOUT). Only int4 and
    fp8 have tiles. ``auto``: where the shape fits tiles and every CTA owns an output tile of
    the O and down projections (hidden / 16 >= SMS), so the kernel's hand-offs stay tagged
    data; ``tiles`` on a shape that does not fit is refused, naming the sizes."""
    layout = envs.MONOKERNEL_WEIGHT_LAYOUT
    if layout == "rows" or fmt not in TILE_FORMATS:
        return False
    odd = tile_misfits(hidden, q_size, kv_size, intermediate)
    if layout == "tiles" and odd:
        raise ValueError(
            f"MONOKERNEL_WEIGHT_LAYOUT=tiles: tiles take inputs in multiples of {TILE_COLS} "
            f"columns and outputs of {TILE_ROWS} rows; this shape has {', '.join(odd)} "
            "(set it to auto or rows)"
        )
    return layout == "tiles" or (not odd and hidden // TILE_ROWS >= SMS)


def tile_misfits(hidden: int, q_size: int, kv_size: int, intermediate: int) -> list[str]:
    """The sizes of a model (a rank's) that are not whole tiles, named: [] where its layers
    can stream as tiles."""
    return [
        f"{name} {v}"
        for name, v, unit in (
            ("hidden", hidden, TILE_COLS),
            ("q heads x head_dim", q_size, TILE_COLS),
            ("intermediate", intermediate, TILE_COLS),
            ("fused QKV rows", q_size + 2 * kv_size, TILE_ROWS),
        )
        if v % unit
    ]


def block_fits(cols: int) -> bool:
    """Whether block scales of ``cols`` columns are a block the kernel reads (csrc
    Fp8BlockTiles): a power of two of at least TILE_COLS (HF's fine-grained FP8: 128)."""
    return cols >= TILE_COLS and cols & (cols - 1) == 0


def check_tile_shape(what: str, rows: int, cols: int) -> None:
    """ValueError naming ``what`` unless a [rows, cols] matrix is whole tiles."""
    if rows % TILE_ROWS or cols % TILE_COLS:
        raise ValueError(
            f"{what} tiles: a [{rows}, {cols}] matrix; rows must be a multiple of {TILE_ROWS} "
            f"and columns of {TILE_COLS}"
        )


# [rows, cols] viewed as [T, e1, g, J, i, e2, t, e0] (row = 16 T + 8 e1 + g, column =
# 32 J + 16 i + 8 e2 + 2 t + e0) -> [T, J, g, t, i, e2, e1, e0]: lane 4g + t, byte 8i + e.
_TO_TILES = (0, 3, 2, 6, 4, 5, 1, 7)
_FROM_TILES = tuple(_TO_TILES.index(k) for k in range(8))


def pack_byte_tiles(q: torch.Tensor) -> torch.Tensor:
    """A matrix of one byte a weight [rows, cols] (whole tiles; any one-byte dtype, moved as
    bytes) -> the tile layout [rows / 16, cols / 32, 32, 16], same dtype."""
    rows, cols = q.shape
    v = q.view(torch.uint8).reshape(rows // TILE_ROWS, 2, 8, cols // BYTE_TILE_COLS, 2, 2, 4, 2)
    out = v.permute(_TO_TILES).contiguous()
    return out.view(rows // TILE_ROWS, cols // BYTE_TILE_COLS, 32, 16).view(q.dtype)


def unpack_byte_tiles(data: torch.Tensor) -> torch.Tensor:
    """pack_byte_tiles' inverse: [rows, cols], same dtype."""
    tiles, loads = data.shape[:2]
    v = data.view(torch.uint8).reshape(tiles, loads, 8, 4, 2, 2, 2, 2).permute(_FROM_TILES)
    return v.reshape(tiles * TILE_ROWS, loads * BYTE_TILE_COLS).view(data.dtype)
