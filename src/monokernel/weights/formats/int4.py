"""int4 groups: each weight 4 bits, each group of ``group`` input columns of a row one
float32 scale a and one float32 offset b; the weight is ``a * q + b`` with q in 0..15.

That one form holds every 4-bit format we read with its bits unchanged: GGUF Q4_0 (a = d,
b = -8d) and Q4_1 (a = d, b = m) in groups of 32, AWQ and GPTQ (a = s, b = -z * s) in groups
of 128 (weights/group_quant.py decodes them), and ``--quantize int4`` (asymmetric
round-to-nearest in groups of 128).

Layout (csrc/formats/int4.cuh reads it): ``data`` is uint8 [rows, cols / 2], row-major; the
16 bytes of chunk c of a row hold its columns 32c .. 32c + 31. Word u (4 bytes) of a chunk
holds columns 8u .. 8u + 7: byte k column 8u + k in its low nibble and 8u + 4 + k in its high
one. The words are stored rotated by rho = (c >> 1) & 3: stored word t is word (t + rho) & 3,
which spreads the lanes' reads of the input over the shared-memory banks. ``scales[0]`` is
float32 [rows, cols / group, 2]: each group's (a, b).
"""

from __future__ import annotations

import dataclasses

import torch

from monokernel import envs
from monokernel.weights.formats.base import PackedMatrix, WeightFormat, check_block
from monokernel.weights.group_quant import quantize_rtn

CHUNK = 32  # columns in one 16-byte load
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


class Int4Groups(WeightFormat):
    name = "int4"
    kernel_type = "Int4Groups"  # a template over the group: build.py adds <group>
    weights_per_load = CHUNK
    packs_in_place = False

    def __init__(self, group: int = DEFAULT_GROUP) -> None:
        if group not in GROUPS:
            raise ValueError(f"int4 group {group}: the kernel reads groups of {GROUPS}")
        self.group = group

    def pack(self, w: torch.Tensor, scales: torch.Tensor | None = None) -> PackedMatrix:
        """Round-to-nearest in groups of ``self.group`` (weights/group_quant.py)."""
        if scales is not None:
            raise ValueError("int4 packs with its groups' own scales (pack_groups)")
        if w.dim() != 2 or not w.is_floating_point():
            raise ValueError(f"int4 packs a floating-point matrix; got {w.dtype} {tuple(w.shape)}")
        if w.shape[1] % self.group:
            raise ValueError(f"int4: {w.shape[1]} columns are not whole groups of {self.group}")
        gq = quantize_rtn(w, self.group)
        return self.pack_groups(gq.q, gq.scale, gq.offset)

    def pack_groups(self, q: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> PackedMatrix:
        """q uint8 [rows, cols] (0..15), a and b [rows, cols / group] -> the packed matrix,
        its bits unchanged (a checkpoint's own 4-bit groups)."""
        rows, cols = q.shape
        group = cols // a.shape[1] if a.dim() == 2 and a.shape[1] else 0
        if group not in GROUPS or a.shape != (rows, cols // group) or b.shape != a.shape:
            raise ValueError(
                f"int4: groups {tuple(a.shape)} and {tuple(b.shape)} for a [{rows}, {cols}] "
                f"matrix; accepted groups of {GROUPS} columns"
            )
        if q.dtype != torch.uint8:
            raise ValueError(f"int4: quants are uint8 0..15; got {q.dtype}")
        pairs = torch.stack((a.float(), b.float()), dim=2).contiguous()  # [rows, groups, 2]
        return PackedMatrix(self.name, rows, cols, pack_nibbles(q), (pairs,))

    @staticmethod
    def group_of(m: PackedMatrix) -> int:
        return m.cols // m.scales[0].shape[1]

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
        end = start + size
        return dataclasses.replace(m, rows=size, data=m.data[start:end], scales=(pairs[start:end],))

    def slice_cols(self, m: PackedMatrix, start: int, size: int) -> PackedMatrix:
        # Repacked: a block's chunks are numbered from its own first column (the rotation).
        check_block(m, start, size, "cols")
        g = self.group_of(m)
        if start % g or size % g:
            raise ValueError(f"int4: columns [{start}, {start + size}) cut groups of {g}")
        (pairs,) = m.scales
        q = unpack_nibbles(m.data)[:, start : start + size]
        ab = pairs[:, start // g : (start + size) // g]
        return self.pack_groups(q.contiguous(), ab[:, :, 0], ab[:, :, 1])
