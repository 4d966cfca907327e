"""The int4 weight format (4-bit quants, a float32 scale and offset a group of a row's
columns): its bytes against the layout csrc/formats/int4.cuh reads, emulated here bit for
bit (the rotated words, the 1 + q/128 floats, the two sums), its bits kept from a
checkpoint's groups, and its row and column blocks; the same for the tile layout
(csrc/formats/int4_tiles.cuh, emulated as csrc/gemv_tiles.cuh multiplies it) and which of
the two the kernel streams."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from monokernel.testing.triton_interpreter import run_interpreted
from monokernel.weights.formats import FORMATS, get_format
from monokernel.weights.formats.int4 import (
    GROUPS,
    Int4Groups,
    pack_nibbles,
    unpack_nibbles,
    unpack_tiles,
)
from monokernel.weights.group_quant import quantize_rtn

SIZES = [(1, 32), (3, 64), (7, 96), (5, 256), (9, 576), (2, 1408)]


def groups_of(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gq = quantize_rtn(w, group)
    return gq.q, gq.scale, gq.offset


def random_matrix(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def kernel_dot(data: torch.Tensor, pairs: torch.Tensor, x: torch.Tensor) -> np.ndarray:
    """What Int4Groups::dot_chunk computes for every row, summed over its chunks in order,
    in float32: each byte 0x80 | q under 0x3f is the float 1 + q/128; the words of chunk c
    are read with the inputs of word (t + rho) & 3, rho = (c >> 1) & 3."""
    rows, half = data.shape
    cols, group = 2 * half, 2 * half // pairs.shape[1]
    b = data.numpy().reshape(rows, cols // 32, 4, 4).astype(np.uint32)  # [row, chunk, t, k]
    xs = x.numpy().astype(np.float32)
    out = np.zeros(rows, dtype=np.float32)
    for c in range(cols // 32):
        rho = (c >> 1) & 3
        f = np.zeros(rows, dtype=np.float32)
        s = np.float32(0)
        for t in range(4):
            unit = 32 * c + 8 * ((t + rho) & 3)
            for k in range(4):
                for nib, col in (
                    (b[:, c, t, k] & 15, unit + k),
                    (b[:, c, t, k] >> 4, unit + 4 + k),
                ):
                    word = (0x3F << 24) | ((0x80 | nib) << 16)
                    f = f + word.astype(np.uint32).view(np.float32) * xs[col]
        for col in range(32 * c, 32 * c + 32):
            s = s + xs[col]
        a, off = pairs[:, 32 * c // group, 0].numpy(), pairs[:, 32 * c // group, 1].numpy()
        out = out + (a * np.float32(128) * (f - s) + off * s).astype(np.float32)
    return out


@pytest.mark.parametrize(("rows", "cols"), SIZES)
def test_nibbles_unpack_to_what_was_packed(rows: int, cols: int) -> None:
    q = torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=torch.Generator())
    data = pack_nibbles(q)
    assert data.shape == (rows, cols // 2) and data.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(data), q)


def test_the_byte_layout() -> None:
    """Chunk 2 (rho 1): its first stored word is natural word 1, columns 72..79; byte k
    holds column 72 + k low and 76 + k high."""
    q = torch.randint(
        0, 16, (1, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
    )
    data = pack_nibbles(q)
    for k in range(4):
        byte = int(data[0, 32 + k])  # chunk 2's first word
        assert byte & 15 == int(q[0, 72 + k]) and byte >> 4 == int(q[0, 76 + k])
        byte = int(data[0, k])  # chunk 0 is not rotated
        assert byte & 15 == int(q[0, k]) and byte >> 4 == int(q[0, 4 + k])


@pytest.mark.parametrize(
    ("rows", "cols", "group"), [(r, c, g) for r, c in SIZES for g in GROUPS if c % g == 0]
)
def test_the_kernels_arithmetic_is_the_dense_matrix_times_x(
    rows: int, cols: int, group: int
) -> None:
    fmt = Int4Groups(group)
    m = fmt.pack(random_matrix(rows, cols, seed=rows))
    x = torch.randn(cols, generator=torch.Generator().manual_seed(cols))
    want = (fmt.dense(m, torch.float64) @ x.double()).numpy()
    got = kernel_dot(m.data, m.scales[0], x)
    bound = np.abs(fmt.dense(m, torch.float64).numpy()) @ np.abs(x.double().numpy())
    scale = float(bound.max())
    assert np.abs(got - want).max() <= 1e-5 * max(scale, 1.0)


def test_a_checkpoints_groups_keep_their_bits() -> None:
    q, a, b = groups_of(random_matrix(6, 256, seed=1), 32)
    a, b = a.half().float(), b.half().float()  # fp16 d and m, as a Q4_1 block has them
    fmt = Int4Groups(32)
    m = fmt.pack_groups(q, a, b)
    assert torch.equal(unpack_nibbles(m.data), q)
    assert torch.equal(m.scales[0][:, :, 0], a) and torch.equal(m.scales[0][:, :, 1], b)
    want = q.float().reshape(6, 8, 32) * a[:, :, None] + b[:, :, None]
    assert torch.equal(fmt.dense(m, torch.float32), want.reshape(6, 256))


def test_pack_is_quantize_rtn_in_groups() -> None:
    """pack rounds each group onto the grid quantize_rtn searched for it: within half a
    step of the grid inside its range, and clipped to its end steps outside it."""
    w = random_matrix(4, 256, seed=2)
    fmt = Int4Groups(128)
    m = fmt.pack(w)
    assert m.scales[0].shape == (4, 2, 2)
    gq = quantize_rtn(w, 128)
    assert torch.equal(fmt.dense(m, torch.float32), gq.dense())
    step = gq.scale.repeat_interleave(128, dim=1)
    low = gq.offset.repeat_interleave(128, dim=1)
    inside = (w >= low - step / 2) & (w <= low + 15.5 * step)
    err = (gq.dense() - w).abs()
    assert bool((err[inside] <= step[inside] / 2 + 1e-6).all())
    assert bool(((gq.q == 0) | (gq.q == 15))[~inside].all())


@pytest.mark.parametrize(("start", "size"), [(0, 256), (256, 128), (128, 384)])
def test_column_and_row_blocks_are_the_dense_blocks(start: int, size: int) -> None:
    fmt = Int4Groups(128)
    m = fmt.pack(random_matrix(10, 512, seed=4))
    dense = fmt.dense(m, torch.float32)
    cols = fmt.slice_cols(m, start, size)
    assert cols.cols == size and torch.equal(
        fmt.dense(cols, torch.float32), dense[:, start : start + size]
    )
    rows = fmt.slice_rows(m, 3, 5)
    assert torch.equal(fmt.dense(rows, torch.float32), dense[3:8])


def test_a_block_cutting_a_group_is_refused() -> None:
    fmt = Int4Groups(128)
    m = fmt.pack(random_matrix(2, 256))
    with pytest.raises(ValueError, match="cut groups of 128"):
        fmt.slice_cols(m, 64, 128)


def test_bytes_are_what_packing_allocates() -> None:
    for group in GROUPS:
        fmt = Int4Groups(group)
        m = fmt.pack(random_matrix(3, 512))
        held = m.data.numel() * m.data.element_size() + m.scales[0].numel() * 4
        assert fmt.matrix_bytes(3, 512) == held


def test_the_registry_and_refusals() -> None:
    assert get_format("int4") is FORMATS["int4"] and get_format("int4").group == 128
    with pytest.raises(ValueError, match="the kernel reads groups of"):
        Int4Groups(96)
    with pytest.raises(ValueError, match="not whole groups of 128"):
        Int4Groups(128).pack(random_matrix(2, 96))
    q, a, b = groups_of(random_matrix(2, 96), 32)
    with pytest.raises(ValueError, match="quants are uint8"):
        Int4Groups(32).pack_groups(q.to(torch.int32), a, b)


# The Triton dequantisation (int4_triton.py) run by Triton's interpreter on the CPU: it
# converts to bf16 by truncation (the GPU rounds to nearest), so it is checked against the
# float32 values truncated; the GPU test below checks the rounding.
_INTERPRETED = """
import torch
from monokernel.weights.formats.int4 import Int4Groups
from monokernel.weights.formats.int4_triton import BLOCK, TILE_CONSTANTS, _kernel
cases = [(5, 576, 64, 0), (3, 1408, 32, 0), (2, 4096, 128, 0), (1, 96, 32, 0),
         (32, 576, 32, 1), (16, 1024, 128, 1), (48, 256, 64, 1)]
for rows, cols, group, tiles in cases:
    fmt = Int4Groups(group, tiles=bool(tiles))
    m = fmt.pack(torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols)))
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    grid = (rows, -(-cols // BLOCK))
    _kernel()[grid](
        m.data, m.scales[0], out, cols, G=group, BLOCK=BLOCK, TILES=bool(tiles), **TILE_CONSTANTS
    )
    w = fmt.dense(m, torch.float32)
    truncated = (w.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert torch.equal(out, truncated), (rows, cols, group)
print("ok")
"""


def test_the_triton_dequantisation_reads_the_layout() -> None:
    assert run_interpreted(_INTERPRETED, timeout_s=600) == "ok"


@pytest.mark.gpu
def test_the_triton_dequantisation_is_the_dense_matrix_in_bf16() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from monokernel.weights.formats.int4_triton import dequantize_bf16

    for rows, cols, group, tiles in [
        (37, 576, 64, False),
        (300, 1408, 32, False),
        (1024, 4096, 128, False),
        (304, 1408, 32, True),
        (1024, 4096, 128, True),
    ]:
        fmt = Int4Groups(group, tiles=tiles)
        m = fmt.pack(random_matrix(rows, cols, seed=cols).cuda())
        got = dequantize_bf16(m.data, m.scales[0], cols).float()
        w = fmt.dense(m, torch.float32)
        # Triton may fuse a * q + b: one bf16 rounding of the float32 value, or where that is
        # 0 (q = the zero point) a residue far below the group's step (tiles: a' (1024 +
        # q / m) + (b - 1024 a'), a float32 rounding of 1024 a').
        ulp = torch.finfo(torch.bfloat16).eps * w.abs()
        step = fmt.groups_of(m)[1].repeat_interleave(group, dim=1)
        residue = (2048 * torch.finfo(torch.float32).eps if tiles else 1e-6) * step
        assert bool(((got - w).abs() <= torch.maximum(ulp, residue)).all())


# ---- the tile layout (csrc/formats/int4_tiles.cuh, csrc/gemv_tiles.cuh) ----------------------

TILE_SIZES = [(16, 64, 32), (32, 128, 64), (48, 256, 128), (16, 512, 256), (64, 576, 32)]


def mma_a_position(lane: int, e: int) -> tuple[int, int]:
    """PTX's m16n8k16 A fragment: lane l's element e (0..7) is (row, column) of the tile."""
    g, t = lane // 4, lane % 4
    return g + 8 * ((e // 2) % 2), 2 * t + e % 2 + 8 * (e // 4)


def tile_kernel_dot(data: torch.Tensor, pairs: torch.Tensor, x: torch.Tensor) -> np.ndarray:
    """What gemv_tiles computes for every row, emulated from the packed bytes as the kernel
    reads them: lane l's word m of load j is k-tile 4j + m; its A register i (elements 2i,
    2i + 1, nibbles 4i and 16 + 4i) is (w >> 8 (i / 2)) & 0x000F000F | 0x64006400 for even i
    (the f16 values 1024 + q, rows g) and & 0x00F000F0 for odd i (1024 + 16 q, rows g + 8);
    x as f16 hi + lo; each segment's a' C + (b - 1024 a') s."""
    tiles, loads = data.shape[:2]
    cols = 64 * loads
    group = cols // pairs.shape[1]
    seg = min(group, 64)
    words = data.contiguous().view(torch.int32).numpy().view(np.uint32).reshape(tiles, loads, 32, 4)
    xf = x.float()
    hi = xf.half().float()
    lo = (xf - hi).half().float()
    hi, lo = hi.numpy().astype(np.float64), lo.numpy().astype(np.float64)
    ab = pairs.numpy().astype(np.float64)  # [T, groups, 8, 4]
    acc = np.zeros((tiles, 16))
    for j in range(loads):
        for h in range(64 // seg):
            c = np.zeros((tiles, 16))
            for m in range(h * seg // 16, (h + 1) * seg // 16):
                kt = 4 * j + m
                a = np.zeros((tiles, 16, 16))
                for lane in range(32):
                    v = words[:, j, lane, m]
                    for i in range(4):
                        mask = 0x00F000F0 if i % 2 else 0x000F000F
                        reg = ((v >> (8 * (i // 2))) & mask) | 0x64006400
                        for half, e in ((0, 2 * i), (1, 2 * i + 1)):
                            r, col = mma_a_position(lane, e)
                            f16 = ((reg >> (16 * half)) & 0xFFFF).astype(np.uint16)
                            a[:, r, col] = f16.view(np.float16).astype(np.float64)
                c += a @ hi[16 * kt : 16 * kt + 16] + a @ lo[16 * kt : 16 * kt + 16]
            k0 = 64 * j + seg * h
            s = hi[k0 : k0 + seg].sum() + lo[k0 : k0 + seg].sum()
            p = ab[:, k0 // group]  # [T, 8, 4]: rows g (a, b'), rows g + 8 (a, b')
            acc[:, :8] += p[:, :, 0] * c[:, :8] + p[:, :, 1] * s
            acc[:, 8:] += p[:, :, 2] * c[:, 8:] + p[:, :, 3] * s
    return acc.reshape(16 * tiles)


@pytest.mark.parametrize(("rows", "cols", "group"), TILE_SIZES)
def test_tiles_are_what_the_tile_gemv_multiplies(rows: int, cols: int, group: int) -> None:
    """The tile kernel's arithmetic on the packed bytes is the dense matrix times x (to the
    hi + lo rounding of x), and unpacking gives back the quants."""
    w = random_matrix(rows, cols, seed=rows + cols)
    q, a, b = groups_of(w, group)
    m = Int4Groups(group, tiles=True).pack_groups(q, a, b)
    assert m.data.shape == (rows // 16, cols // 64, 32, 16)
    assert m.scales[0].shape == (rows // 16, cols // group, 8, 4)
    assert torch.equal(unpack_tiles(m.data), q)
    x = torch.randn(cols, generator=torch.Generator().manual_seed(7))
    want = (
        q.double() * a.double().repeat_interleave(group, 1) + b.double().repeat_interleave(group, 1)
    ) @ x.double()
    got = tile_kernel_dot(m.data, m.scales[0], x)
    assert np.linalg.norm(got - want.numpy()) <= 1e-4 * np.linalg.norm(want.numpy())


@pytest.mark.parametrize(("rows", "cols", "group"), TILE_SIZES)
def test_tiles_and_rows_hold_the_same_matrix(rows: int, cols: int, group: int) -> None:
    q, a, b = groups_of(random_matrix(rows, cols, seed=cols), group)
    tiles = Int4Groups(group, tiles=True).pack_groups(q, a, b)
    plain = Int4Groups(group).pack_groups(q, a, b)
    fmt = Int4Groups(group)
    assert fmt.matrix_bytes(rows, cols) == tiles.data.numel() + 4 * tiles.scales[0].numel()
    # a' (1024 + q / m) + (b - 1024 a'): within an fp32 rounding of 1024 a' (a' = a m, m 1
    # or 1/16) of a q + b.
    ulp = 1024 * a.abs().repeat_interleave(group, 1) * torch.finfo(torch.float32).eps
    diff = (fmt.dense(tiles, torch.float32) - fmt.dense(plain, torch.float32)).abs()
    assert bool((diff <= 2 * ulp).all())
    gq, ga, _ = fmt.groups_of(tiles)
    assert torch.equal(gq, q) and torch.equal(ga, a.float())


def test_tile_blocks_are_whole_tiles_and_groups() -> None:
    q, a, b = groups_of(random_matrix(48, 256, seed=3), 64)
    fmt = Int4Groups(64, tiles=True)
    m = fmt.pack_groups(q, a, b)
    dense = fmt.dense(m, torch.float32)
    rows = fmt.slice_rows(m, 16, 32)
    assert rows.rows == 32 and Int4Groups.is_tiled(rows)
    assert torch.equal(fmt.dense(rows, torch.float32), dense[16:48])
    cols = fmt.slice_cols(m, 64, 128)
    assert Int4Groups.is_tiled(cols)
    assert torch.allclose(fmt.dense(cols, torch.float32), dense[:, 64:192], atol=1e-4)
    with pytest.raises(ValueError, match="cut tiles of 16"):
        fmt.slice_rows(m, 8, 16)
    with pytest.raises(ValueError, match="rows must be a multiple of 16"):
        fmt.pack_groups(q[:40], a[:40], b[:40])
