"""int4 groups: each weight 4 bits, each group of ``group`` input columns of a row one
float32 scale a and one float32 offset b; the weight is ``a * q + b`` with q in 0..15.

That one form holds every 4-bit format we read with its bits unchanged: GGUF Q4_0 (a = d,
b = -8d) and Q4_1 (a = d, b = m) in groups of 32, AWQ and GPTQ (a = s, b = -z * s) in groups
of 128 (weights/group_quant.py decodes them), and ``--quantize int4`` (groups of 128, each
group's pair searched for its least activation-weighted squared error: group_quant.quantize_rtn
with the input statistics of runtime/calibration.py).

Two layouts, told apart by ``data``'s rank:

* rows (csrc/formats/int4.cuh, a warp a row on the CUDA cores): ``data`` is uint8
  [rows, cols / 2], row-major; the 16 bytes of chunk c of a row hold its columns
  32c .. 32c + 31. Word u (4 bytes) of a chunk holds columns 8u .. 8u + 7: byte k column
  8u + k in its low nibble and 8u + 4 + k in its high one. The words are stored rotated by
  rho = (c >> 1) & 3: stored word t is word (t + rho) & 3, which spreads the lanes' reads of
  the input over the shared-memory banks. ``scales[0]`` is float32 [rows, cols / group, 2]:
  each group's (a, b).
* tiles (csrc/formats/int4_tiles.cuh, 16-row tiles on the tensor cores): ``data`` is uint8
  [rows / 16, cols / 64, 32 lanes, 16], each lane's 4 words the A fragments of mma.m16n8k16
  for 4 k-tiles (that header has the order); ``scales[0]`` is float32
  [rows / 16, cols / group, 8, 4]: for rows g and g + 8 of a tile, (a', b - 1024 a') each,
  a' = a for rows g and a / 16 for rows g + 8: the kernel multiplies the f16 value 1024 + q
  (rows g) or 1024 + 16 q (rows g + 8), each made by one LOP3 from the nibble where it lies
  (int4_tiles.cuh). dense() gives a' (1024 + q / m) + (b - 1024 a'), m = a' / a, the value
  the kernel multiplies by, within an fp32 rounding of 1024 a' of the checkpoint's a q + b.

Which one the monokernel streams is tiles.py's ``tiles_for`` (MONOKERNEL_WEIGHT_LAYOUT).
"""

from __future__ import annotations

import dataclasses

import torch

from monokernel import envs
from monokernel.weights.formats.base import PackedMatrix, WeightFormat, check_block
from monokernel.weights.formats.tiles import TILE_COLS, TILE_ROWS, check_tile_shape
from monokernel.weights.group_quant import quantize_rtn

CHUNK = 32  # columns in one 16-byte load
# The tile layout's A values: the f16 1024 + q for rows g of a tile (a nibble in bits 0-3 of
# a half), 1024 + 16 q for rows g + 8 (bits 4-7), so the kernel widens with no shift there.
TILE_BASE = 1024.0
TILE_UPPER = 1.0 / 16  # rows g + 8: a' = a / 16
DEFAULT_GROUP = 128  # --quantize int4's, AWQ's and GPTQ's usual group
GROUPS = (32, 64, 128, 256)  # group sizes the kernel reads: whole chunks dividing 8 chunks
_PAIR_BYTES = 8  # float32 a and b


def _word_order(chunks: int, device: torch.device, direction: int) -> torch.Tensor:
    """[chunks, 4] int64, for chunk c: the natural word stored at each word position
    (``direction`` 1, packing), or the stored position of each natural word (-1)."""
    c = torch.arange(chunks, device=device)[:, None]
    t = torch.arange(4, device=device)[None, :]
    return (t + direction * ((c >> 1) & 3)) & 3


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [rows, cols] (0..15; cols a multiple of 32) -> the streamed bytes [rows, cols/2]."""
    rows, cols = q.shape
    chunks = cols // CHUNK
    v = q.reshape(rows, chunks, 4, 2, 4)  # [row, chunk, word u, low/high nibble, byte k]
    words = v[:, :, :, 0, :] | (v[:, :, :, 1, :] << 4)  # [row, chunk, u, k]
    idx = _word_order(chunks, q.device, 1)[None, :, :, None].expand(rows, chunks, 4, 4)
    return torch.gather(words, 2, idx).reshape(rows, cols // 2).contiguous()


def unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    """pack_nibbles' inverse: uint8 [rows, cols]."""
    return _nibble_values(data).to(torch.uint8)


# Weights dense() dequantises at once.
_DENSE_BLOCK = 1 << 23


def _nibble_values(data: torch.Tensor) -> torch.Tensor:
    """The packed bytes [rows, cols / 2] -> q int32 [rows, cols] in column order: one gather
    undoes the rotation, eight shifts split the words (word u's column 8u + k is byte k's
    low nibble, 8u + 4 + k its high one), a few passes for dense() to repeat every prompt."""
    rows, half = data.shape
    chunks = 2 * half // CHUNK
    words = data.contiguous().view(torch.int32).view(rows, chunks, 4)
    idx = _word_order(chunks, data.device, -1)[None].expand(rows, chunks, 4)
    natural = torch.gather(words, 2, idx)
    # Made on the device (no host copy: the prefill captures this in CUDA graphs).
    k = torch.arange(8, dtype=torch.int32, device=data.device)
    shifts = (k % 4) * 8 + (k // 4) * 4  # 0, 8, 16, 24, 4, 12, 20, 28
    return ((natural[..., None] >> shifts) & 0x0F).view(rows, 2 * half)


def fragment_tables(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lane l's 8 A-fragment elements of mma.m16n8k16 (g = l // 4, t = l % 4): their rows and
    columns in a 16 x 16 tile [32, 8], in register order, and element e's nibble in the
    lane's word [8]. Made on the device (no host copy: the prefill captures dense() in CUDA
    graphs)."""
    lane = torch.arange(32, device=dev).view(32, 1)
    e = torch.arange(8, device=dev).view(1, 8)
    rows = lane // 4 + 8 * ((e // 2) % 2)
    cols = 2 * (lane % 4) + e % 2 + 8 * (e // 4)
    shift = (4 * (e // 2) + 16 * (e % 2)).view(8).to(torch.int32)
    return rows, cols, shift


def pack_tiles(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [rows, cols] (0..15; rows a multiple of 16, cols of 64) -> the tile layout's
    bytes [rows / 16, cols / 64, 32, 16]."""
    rows, cols = q.shape
    frag_row, frag_col, shift = fragment_tables(q.device)
    t = q.to(torch.int32).reshape(rows // TILE_ROWS, TILE_ROWS, cols // 16, 16).permute(0, 2, 1, 3)
    f = t[:, :, frag_row, frag_col]  # [T, K/16, 32, 8]
    words = (f << shift).sum(-1, dtype=torch.int64)  # [T, K/16, 32]
    words = words.view(rows // TILE_ROWS, cols // TILE_COLS, 4, 32).permute(0, 1, 3, 2)
    packed = words.to(torch.int32).contiguous()  # wraps the top bit: the same 32 bits
    return packed.view(torch.uint8).view(rows // TILE_ROWS, cols // TILE_COLS, 32, 16)


def unpack_tiles(data: torch.Tensor) -> torch.Tensor:
    """pack_tiles' inverse: uint8 [rows, cols]."""
    tiles, blocks = data.shape[:2]
    frag_row, frag_col, shift = fragment_tables(data.device)
    words = data.contiguous().view(torch.int32).view(tiles, blocks, 32, 4).permute(0, 1, 3, 2)
    words = words.reshape(tiles, blocks * 4, 32, 1)  # [T, K/16, 32, 1]
    f = (words >> shift) & 0x0F  # [T, K/16, 32, 8]
    out = torch.empty(tiles, blocks * 4, TILE_ROWS, 16, dtype=torch.uint8, device=data.device)
    out[:, :, frag_row, frag_col] = f.to(torch.uint8)
    return out.permute(0, 2, 1, 3).reshape(tiles * TILE_ROWS, blocks * TILE_COLS)


def check_groups(
    what: str, q: torch.Tensor, a: torch.Tensor, b: torch.Tensor, groups: tuple[int, ...]
) -> int:
    """The group of a matrix's quants q uint8 [rows, cols] and pairs a, b [rows, groups]
    (``what``'s pack_groups: int4 here, int8 groups in int8.py), or ValueError naming what
    does not fit and the ``groups`` accepted."""
    rows, cols = q.shape
    group = cols // a.shape[1] if a.dim() == 2 and a.shape[1] else 0
    if group not in groups or a.shape != (rows, cols // group) or b.shape != a.shape:
        raise ValueError(
            f"{what}: groups {tuple(a.shape)} and {tuple(b.shape)} for a [{rows}, {cols}] "
            f"matrix; accepted groups of {groups} columns"
        )
    if q.dtype != torch.uint8:
        raise ValueError(f"{what}: quants are uint8; got {q.dtype}")
    return group


def group_cols(
    what: str,
    groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    g: int,
    start: int,
    size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Columns [start, start + size) of a matrix's (q, a, b) in groups of g, copies: whole
    groups only, or ValueError naming the cut (``what``'s slice_cols)."""
    if start % g or size % g:
        raise ValueError(f"{what}: columns [{start}, {start + size}) cut groups of {g}")
    q, a, b = groups
    block = slice(start // g, (start + size) // g)
    return (
        q[:, start : start + size].contiguous(),
        a[:, block].contiguous(),
        b[:, block].contiguous(),
    )


def tile_pairs(a: torch.Tensor, b: torch.Tensor, base: float) -> torch.Tensor:
    """a, b [rows, groups] -> the tile layout's pairs [rows / 16, groups, 8, 4]: rows g and
    g + 8 of each tile as (a, b - base a), for a kernel that multiplies base + q (int4:
    TILE_BASE; int8 groups, int8.py: BASE)."""
    rows, groups = a.shape
    a, b = a.float(), b.float()
    ab = torch.stack((a, b - base * a), dim=2)  # [rows, groups, 2]
    ab = ab.view(rows // TILE_ROWS, 2, 8, groups, 2).permute(0, 3, 2, 1, 4)  # [T, G', 8, 2, 2]
    return ab.reshape(rows // TILE_ROWS, groups, 8, 4).contiguous()


def tile_row_mult(rows: int, device: torch.device | None = None) -> torch.Tensor:
    """[rows, 1] float32: 1 for rows g of each 16-row tile, TILE_UPPER for rows g + 8."""
    upper = (torch.arange(rows, device=device) % TILE_ROWS) >= 8
    return torch.where(upper, TILE_UPPER, 1.0).float()[:, None]


def untile_pairs(pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tile layout's pairs as stored (tile_pairs' (a, b - base a)), each [rows, groups]."""
    tiles, groups = pairs.shape[:2]
    ab = pairs.view(tiles, groups, 8, 2, 2).permute(0, 3, 2, 1, 4).reshape(tiles * 16, groups, 2)
    return ab[:, :, 0].contiguous(), ab[:, :, 1].contiguous()


class Int4Groups(WeightFormat):
    name = "int4"
    kernel_type = "Int4Groups"  # a template over the group: build.py adds <group>
    weights_per_load = CHUNK
    packs_in_place = False

    def __init__(self, group: int = DEFAULT_GROUP, tiles: bool = False) -> None:
        if group not in GROUPS:
            raise ValueError(f"int4 group {group}: the kernel reads groups of {GROUPS}")
        self.group = group
        self.tiles = tiles  # pack in the tile layout (instances differ; the class says rows)

    def pack(
        self, w: torch.Tensor, scales: torch.Tensor | None = None, act: torch.Tensor | None = None
    ) -> PackedMatrix:
        """``w`` in groups of ``self.group``, each on the grid group_quant.quantize_rtn finds
        (activation-weighted with ``act``, w's input statistics [cols]: runtime/calibration.py)."""
        if scales is not None:
            raise ValueError("int4 packs with its groups' own scales (pack_groups)")
        if w.dim() != 2 or not w.is_floating_point():
            raise ValueError(f"int4 packs a floating-point matrix; got {w.dtype} {tuple(w.shape)}")
        if w.shape[1] % self.group:
            raise ValueError(f"int4: {w.shape[1]} columns are not whole groups of {self.group}")
        gq = quantize_rtn(w, self.group, act)
        return self.pack_groups(gq.q, gq.scale, gq.offset)

    def pack_groups(self, q: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> PackedMatrix:
        """q uint8 [rows, cols] (0..15), a and b [rows, cols / group] -> the packed matrix,
        its bits unchanged (a checkpoint's own 4-bit groups)."""
        rows, cols = q.shape
        check_groups("int4", q, a, b, GROUPS)
        if self.tiles:
            check_tile_shape("int4", rows, cols)
            a = a.float() * tile_row_mult(rows, a.device)
            return PackedMatrix(
                self.name, rows, cols, pack_tiles(q), (tile_pairs(a, b, TILE_BASE),)
            )
        pairs = torch.stack((a.float(), b.float()), dim=2).contiguous()  # [rows, groups, 2]
        return PackedMatrix(self.name, rows, cols, pack_nibbles(q), (pairs,))

    @staticmethod
    def group_of(m: PackedMatrix) -> int:
        return m.cols // m.scales[0].shape[1]

    @staticmethod
    def is_tiled(m: PackedMatrix) -> bool:
        return m.data.dim() == 4

    @staticmethod
    def groups_of(m: PackedMatrix) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """m's (q uint8 [rows, cols], a, b [rows, groups]) in either layout."""
        (pairs,) = m.scales
        if Int4Groups.is_tiled(m):
            a, b0 = untile_pairs(pairs)
            return unpack_tiles(m.data), a / tile_row_mult(m.rows, a.device), b0 + TILE_BASE * a
        return unpack_nibbles(m.data), pairs[:, :, 0], pairs[:, :, 1]

    def dense(self, m: PackedMatrix, dtype: torch.dtype | None = None) -> torch.Tensor:
        # float32 a * q + b per group (a product, then a sum: exactly group_quant's dense),
        # in blocks of rows: the prefill calls this for every matrix of every prompt, so its
        # temporaries (~8 bytes a weight) stay a few tens of MB whatever the matrix. bf16 on
        # a GPU: one Triton kernel a matrix (int4_triton.py), unless MONOKERNEL_PREFILL_TRITON
        # is off.
        (pairs,) = m.scales
        g = self.group_of(m)
        if m.data.is_cuda and dtype in (None, torch.bfloat16) and envs.MONOKERNEL_PREFILL_TRITON:
            from monokernel.weights.formats.int4_triton import dequantize_bf16

            return dequantize_bf16(m.data, pairs, m.cols)
        if self.is_tiled(m):  # a' (1024 + q / m) + (b - 1024 a'), as the kernel multiplies
            a, b0 = untile_pairs(pairs)
            mult = tile_row_mult(m.rows, a.device)[:, :, None]
            q = unpack_tiles(m.data).float().view(m.rows, -1, g) / mult + TILE_BASE
            w = q * a[:, :, None] + b0[:, :, None]
            return w.view(m.rows, m.cols).to(dtype or torch.bfloat16)
        out = torch.empty(m.rows, m.cols, dtype=dtype or torch.bfloat16, device=m.data.device)
        step = max(1, _DENSE_BLOCK // m.cols)
        for r in range(0, m.rows, step):
            q = _nibble_values(m.data[r : r + step]).float().view(-1, m.cols // g, g)
            ab = pairs[r : r + step]
            out[r : r + step] = (q * ab[:, :, 0:1] + ab[:, :, 1:2]).view(-1, m.cols)
        return out

    def matrix_bytes(self, rows: int, cols: int) -> int:
        return rows * cols // 2 + _PAIR_BYTES * rows * (cols // self.group)

    def slice_rows(self, m: PackedMatrix, start: int, size: int) -> PackedMatrix:
        check_block(m, start, size, "rows")
        (pairs,) = m.scales
        if self.is_tiled(m):
            if start % TILE_ROWS or size % TILE_ROWS:
                raise ValueError(f"int4 tiles: rows [{start}, {start + size}) cut tiles of 16")
            start, size = start // TILE_ROWS, size // TILE_ROWS
        end = start + size
        rows = size * (TILE_ROWS if self.is_tiled(m) else 1)
        return dataclasses.replace(m, rows=rows, data=m.data[start:end], scales=(pairs[start:end],))

    def slice_cols(self, m: PackedMatrix, start: int, size: int) -> PackedMatrix:
        # Repacked: a block's chunks are numbered from its own first column (the rotation).
        check_block(m, start, size, "cols")
        g = self.group_of(m)
        return Int4Groups(g, tiles=self.is_tiled(m)).pack_groups(
            *group_cols("int4", self.groups_of(m), g, start, size)
        )
