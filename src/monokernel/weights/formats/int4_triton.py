"""int4's dequantisation on the GPU in one Triton kernel: what the bf16 prefill multiplies
by, made once a prompt for every matrix (int4.py dense). The torch path takes ~8 passes over
~8 bytes a weight; this one reads the packed byte and its group's pair and writes the bf16
weight, one launch a matrix (on the 8B shape it was most of a 64-token prompt's TTFT)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from monokernel.weights.formats.int4 import TILE_BASE, TILE_UPPER

BLOCK = 1024  # output columns a program writes
# The tile layout's constants (int4.py), as the kernel's compile-time arguments.
TILE_CONSTANTS = {"BASE": TILE_BASE, "UPPER": 1.0 / TILE_UPPER}


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def dequant_int4(
        data_ptr, pairs_ptr, out_ptr, cols, G: tl.constexpr, BLOCK: tl.constexpr,
        TILES: tl.constexpr, BASE: tl.constexpr, UPPER: tl.constexpr,
    ):  # fmt: skip
        # Program (row, column block): int4.py's layout read backwards, a weight at a time.
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = col < cols
        if TILES:
            # Row r is row rr = r % 16 of tile r // 16: lane group g = rr % 8, half h =
            # rr // 8; column c is column cc = c % 16 of k-tile c // 16, word (c // 16) % 4
            # of load c // 64, lane 4 g + (cc % 8) // 2, fragment element e = cc % 2 + 2 h +
            # 4 (cc // 8), nibble 4 (e // 2) + 16 (e % 2) of the word.
            tile = row // 16
            g = row % 8
            h = (row % 16) // 8
            cc = col % 16
            e = cc % 2 + 2 * h + 4 * (cc // 8)
            shift = 4 * (e // 2) + 16 * (e % 2)
            lane = 4 * g + (cc % 8) // 2
            load = (tile * (cols // 64) + col // 64) * 32 + lane
            byte_at = data_ptr + load * 16 + ((col // 16) % 4) * 4 + shift // 8
            nibble = shift % 8
            pair = pairs_ptr + ((tile * (cols // G) + col // G) * 8 + g) * 4 + 2 * h
        else:
            chunk = col // 32
            within = col % 32
            word = ((within // 8) - ((chunk >> 1) & 3)) & 3  # stored word of natural word
            j = within % 8
            byte_at = data_ptr + row * (cols // 2) + chunk * 16 + word * 4 + (j % 4)
            nibble = 4 * (j // 4)
            pair = pairs_ptr + (row * (cols // G) + col // G) * 2
        byte = tl.load(byte_at, mask=live, other=0)
        q = ((byte.to(tl.int32) >> nibble) & 15).to(tl.float32)
        a = tl.load(pair, mask=live, other=0.0)
        b = tl.load(pair + 1, mask=live, other=0.0)
        # Tiles store (a', b - BASE a'): a' (BASE + q) + b' for rows g of a tile, a' (BASE +
        # UPPER q) + b' for rows g + 8, the values the kernel multiplies by (int4.py's
        # TILE_BASE and 1 / TILE_UPPER).
        w = a * (q * (1.0 + (UPPER - 1.0) * h) + BASE) + b if TILES else q * a + b
        tl.store(out_ptr + row * cols + col, w.to(tl.bfloat16), mask=live)

    return dequant_int4


def dequantize_bf16(data: torch.Tensor, pairs: torch.Tensor, cols: int) -> torch.Tensor:
    """The packed int4 matrix (data uint8 [rows, cols / 2], pairs float32 [rows, groups, 2],
    or the tile layout's: int4.py) as bf16 [rows, cols], on data's CUDA device: a * q + b
    (tiles: a' (1024 + q / m) + (b - 1024 a'), int4.py), which Triton may fuse into one
    multiply-add, rounded to bf16. So each weight is within one bf16 rounding of dense()'s
    float32 value; where that is 0 a fused residue of the scale's own rounding, ~1e-8 of the
    step, may stand in for it."""
    tiled = data.dim() == 4  # the tile layout (int4.py)
    rows = data.shape[0] * (16 if tiled else 1)
    out = torch.empty(rows, cols, dtype=torch.bfloat16, device=data.device)
    group = cols // pairs.shape[1]
    grid = (rows, -(-cols // BLOCK))
    _kernel()[grid](data, pairs, out, cols, G=group, BLOCK=BLOCK, TILES=tiled, **TILE_CONSTANTS)
    return out
