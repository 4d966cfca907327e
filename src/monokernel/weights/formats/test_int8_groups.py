"""int8 groups (int8.py, csrc/formats/int8_tiles.cuh): a GGUF file's 5- to 8-bit values in
byte tiles with a pair a group. The packing holds the values, the slices are the matrix's,
and the tile GEMV's arithmetic emulated from the packed bytes (each byte the f16 1024 + u,
x as f16 hi + lo, a C + (b - 1024 a) s a group) is the matrix times x."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from monokernel.testing.triton_interpreter import run_interpreted
from monokernel.weights.formats import get_format
from monokernel.weights.formats.int8 import BASE, Int8Rows
from monokernel.weights.formats.test_tiles import f16_hi_lo, mma_a_position


def random_groups(
    rows: int, cols: int, group: int, top: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, top + 1, (rows, cols), generator=g, dtype=torch.uint8)
    a = torch.rand(rows, cols // group, generator=g) * 0.02 + 1e-3
    b = -a * (top + 1) / 2 + torch.randn(rows, cols // group, generator=g) * 1e-3
    return q, a, b


def int8_group_kernel_dot(data: torch.Tensor, pairs: torch.Tensor, x: torch.Tensor) -> np.ndarray:
    """What gemv_tiles computes for every row of an int8-group tile matrix, from the bytes
    and pairs as the kernel reads them."""
    tiles, loads = data.shape[:2]
    groups = pairs.shape[1]
    group = 32 * loads // groups
    u = data.contiguous().view(torch.uint8).double().numpy() + BASE  # [T, J, 32, 16]
    hi, lo = f16_hi_lo(x.float())
    s = (hi + lo).reshape(-1, group).sum(axis=1)  # tile_inputs' sums, a group
    ab = pairs.double().numpy()  # [T, G', 8, 4]: rows g, g + 8 as (a, b')
    acc = np.zeros((tiles, 16))
    for kt in range(2 * loads):
        j, i = divmod(kt, 2)
        a = np.zeros((tiles, 16, 16))
        for lane in range(32):
            for e in range(8):
                r, c = mma_a_position(lane, e)
                a[:, r, c] = u[:, j, lane, 8 * i + e]
        c_kt = a @ hi[16 * kt : 16 * kt + 16] + a @ lo[16 * kt : 16 * kt + 16]  # [T, 16]
        grp = 16 * kt // group
        scale = np.concatenate((ab[:, grp, :, 0], ab[:, grp, :, 2]), axis=1)  # [T, 16] rows
        offset = np.concatenate((ab[:, grp, :, 1], ab[:, grp, :, 3]), axis=1)
        acc += scale * c_kt
        if (16 * kt) % group == 0:
            acc += offset * s[grp]
    return acc.reshape(16 * tiles)


@pytest.mark.parametrize(("rows", "cols", "group", "top"), [(16, 64, 16, 63), (48, 192, 32, 255),
                                                            (32, 576, 16, 31)])  # fmt: skip
def test_int8_group_tiles_are_what_the_tile_gemv_multiplies(
    rows: int, cols: int, group: int, top: int
) -> None:
    q, a, b = random_groups(rows, cols, group, top, seed=rows + cols)
    m = Int8Rows(group=group).pack_groups(q, a, b)
    assert m.data.shape == (rows // 16, cols // 32, 32, 16) and m.data.dtype == torch.uint8
    assert m.scales[0].shape == (rows // 16, cols // group, 8, 4)
    want = (q.double() * a.double().repeat_interleave(group, 1)
            + b.double().repeat_interleave(group, 1))  # fmt: skip
    # a (1024 + u) + (b - 1024 a) in float32, as the kernel: an fp32 rounding of 1024 a.
    dense = get_format("int8").dense(m, torch.float32).double()
    assert torch.allclose(dense, want, rtol=0, atol=2**-22 * BASE * float(a.max()))
    x = torch.randn(cols, generator=torch.Generator().manual_seed(7))
    got = int8_group_kernel_dot(m.data, m.scales[0], x)
    ref = (want @ x.double()).numpy()
    assert np.linalg.norm(got - ref) <= 1e-5 * np.linalg.norm(ref)


def test_int8_groups_slices_bytes_and_refusals() -> None:
    q, a, b = random_groups(48, 256, 16, 63, seed=1)
    fmt = Int8Rows(group=16)
    m = fmt.pack_groups(q, a, b)
    reader = get_format("int8")  # the registry's instance reads grouped matrices too
    assert reader.is_grouped(m) and reader.group_of(m) == 16
    dense = reader.dense(m, torch.float32)
    qq, aa, bb = reader.groups_of(m)
    assert torch.equal(qq, q) and torch.equal(aa, a)
    assert torch.allclose(bb, b, rtol=0, atol=1e-6)
    assert fmt.matrix_bytes(48, 256) == m.data.numel() + 4 * m.scales[0].numel()
    rows = reader.slice_rows(m, 16, 32)
    assert torch.equal(reader.dense(rows, torch.float32), dense[16:48])
    cols = reader.slice_cols(m, 64, 128)
    assert torch.allclose(reader.dense(cols, torch.float32), dense[:, 64:192], rtol=0, atol=1e-6)
    w, s = reader.gemm_operands(m, torch.float32)
    assert s is None and torch.equal(w, dense)
    with pytest.raises(ValueError, match="cut tiles of 16"):
        reader.slice_rows(m, 8, 16)
    with pytest.raises(ValueError, match="cut groups of 16"):
        reader.slice_cols(m, 8, 64)
    with pytest.raises(ValueError, match="groups of"):
        Int8Rows(group=64)
    with pytest.raises(ValueError, match="pack_groups"):
        fmt.pack(torch.randn(16, 64))
    with pytest.raises(ValueError, match="rows must be a multiple of 16"):
        fmt.pack_groups(q[:40], a[:40], b[:40])
    with pytest.raises(ValueError, match="uint8"):
        fmt.pack_groups(q.to(torch.int16), a, b)


# fp8_triton.py's untiling of int8 groups, run by Triton's interpreter on the CPU.
_INTERPRETED = """
import torch
from monokernel.weights.formats.int8 import Int8Rows
from monokernel.weights.formats.fp8_triton import BLOCK, _kernel
for rows, cols, group in [(16, 64, 16), (48, 576, 32)]:
    g = torch.Generator().manual_seed(cols)
    q = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8)
    a = torch.rand(rows, cols // group, generator=g) * 0.01
    b = torch.randn(rows, cols // group, generator=g) * 0.1
    m = Int8Rows(group=group).pack_groups(q, a, b)
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    _kernel()[(rows, -(-cols // BLOCK))](m.data, m.scales[0], out, cols, BN=0, G=group,
                                         BLOCK=BLOCK)
    want = Int8Rows().dense(m, torch.float32)
    err = (out.float() - want).abs() / want.abs().clamp_min(1e-3)
    assert float(err.max()) <= 2 ** -7, (rows, cols, float(err.max()))
print("ok")
"""


def test_the_triton_untiling_reads_int8_groups() -> None:
    assert run_interpreted(_INTERPRETED, timeout_s=600) == "ok"
