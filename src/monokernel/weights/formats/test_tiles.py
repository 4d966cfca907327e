"""The 16-row tile layout (tiles.py) against PTX's mma.m16n8k16 fragment layout written out
here: which layout the kernel streams for a shape and format, the byte tiles fp8 packs, and
the fp8 tile GEMV's arithmetic (csrc/formats/fp8_tiles.cuh, csrc/gemv_tiles.cuh) emulated
from the packed bytes: each 16-bit half an f16 pair, x as f16 hi + lo, the row's scale last."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from monokernel import envs
from monokernel.testing.triton_interpreter import run_interpreted
from monokernel.weights.checkpoint_quant import block_scales, quantize_blocks
from monokernel.weights.formats import get_format
from monokernel.weights.formats.fp8 import Fp8Rows
from monokernel.weights.formats.int8 import Int8Rows
from monokernel.weights.formats.tiles import pack_byte_tiles, tiles_for, unpack_byte_tiles

LLAMA_8B = (4096, 4096, 1024, 14336)  # hidden, q heads x head_dim, kv, intermediate
QWEN_1_5B = (1536, 1536, 256, 8960)


def mma_a_position(lane: int, e: int) -> tuple[int, int]:
    """PTX's m16n8k16 A fragment: lane l's element e (0..7) is (row, column) of the tile."""
    g, t = lane // 4, lane % 4
    return g + 8 * ((e // 2) % 2), 2 * t + e % 2 + 8 * (e // 4)


@pytest.mark.parametrize(
    ("layout", "fmt", "sizes", "want"),
    [
        ("auto", "int4", LLAMA_8B, True),  # 256 tiles >= 132 SMs
        ("auto", "fp8", LLAMA_8B, True),
        ("auto", "int4", QWEN_1_5B, False),  # 96 tiles: rows
        ("auto", "fp8", QWEN_1_5B, False),
        ("auto", "int4", (4104, 4096, 1024, 14336), False),  # not whole 64-column loads
        ("auto", "bf16", LLAMA_8B, False),  # bf16 and int8 have no tiles
        ("auto", "int8", LLAMA_8B, False),
        ("tiles", "int8", LLAMA_8B, False),
        ("rows", "int4", LLAMA_8B, False),
        ("rows", "fp8", LLAMA_8B, False),
        ("tiles", "int4", (576, 576, 192, 1536), True),  # SmolLM2, forced
        ("tiles", "fp8", (576, 576, 192, 1536), True),
    ],
)
def test_which_layout_the_kernel_streams(
    layout: str, fmt: str, sizes: tuple[int, int, int, int], want: bool
) -> None:
    with envs.overridden(MONOKERNEL_WEIGHT_LAYOUT=layout):
        assert tiles_for(fmt, *sizes) is want


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_forced_tiles_refuse_a_shape_that_does_not_fit(fmt: str) -> None:
    with (
        envs.overridden(MONOKERNEL_WEIGHT_LAYOUT="tiles"),
        pytest.raises(ValueError, match="q heads x head_dim 672"),
    ):
        tiles_for(fmt, 640, 672, 96, 1408)


@pytest.mark.parametrize(("rows", "cols"), [(16, 64), (48, 192), (32, 576)])
def test_byte_tiles_hold_each_lanes_a_fragments(rows: int, cols: int) -> None:
    q = (torch.arange(rows * cols) % 251).to(torch.uint8).view(rows, cols)
    t = pack_byte_tiles(q)
    assert t.shape == (rows // 16, cols // 32, 32, 16) and t.is_contiguous()
    for tile in range(rows // 16):
        for j in range(cols // 32):
            for lane in range(32):
                for i in range(2):
                    for e in range(8):
                        r, c = mma_a_position(lane, e)
                        assert t[tile, j, lane, 8 * i + e] == q[16 * tile + r, 32 * j + 16 * i + c]
    assert torch.equal(unpack_byte_tiles(t), q)


def f16_hi_lo(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    hi = x.half().float()
    lo = (x - hi).half().float()
    return hi.numpy().astype(np.float64), lo.numpy().astype(np.float64)


def fp8_tile_kernel_dot(data: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> np.ndarray:
    """What gemv_tiles computes for every row of an fp8 tile matrix, from the bytes as the
    kernel reads them: lane l's 16-bit half h of word w of a load is A register 2(w % 2) + h
    of k-tile 2j + w // 2 (two E4M3 values, the low byte the lower column), x as f16 hi + lo,
    the row's scale times the sum."""
    tiles, loads = data.shape[:2]
    raw = data.contiguous().view(torch.uint8)
    vals = raw.view(torch.float8_e4m3fn).float().numpy().astype(np.float64)  # [T, J, 32, 16]
    hi, lo = f16_hi_lo(x.float())
    acc = np.zeros((tiles, 16))
    for j in range(loads):
        for i in range(2):  # the load's k-tiles
            kt = 2 * j + i
            a = np.zeros((tiles, 16, 16))
            for lane in range(32):
                for reg in range(4):
                    for half in range(2):
                        e = 2 * reg + half
                        r, c = mma_a_position(lane, e)
                        a[:, r, c] = vals[:, j, lane, 8 * i + e]
            acc += a @ hi[16 * kt : 16 * kt + 16] + a @ lo[16 * kt : 16 * kt + 16]
    return acc.reshape(16 * tiles) * scales.double().numpy()


@pytest.mark.parametrize(("rows", "cols"), [(16, 64), (48, 192), (32, 576)])
def test_fp8_tiles_are_what_the_tile_gemv_multiplies(rows: int, cols: int) -> None:
    g = torch.Generator().manual_seed(rows + cols)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 3
    m = Fp8Rows(tiles=True).pack(w)
    plain = Fp8Rows().pack(w)
    assert m.data.shape == (rows // 16, cols // 32, 32, 16)
    assert m.data.dtype == torch.float8_e4m3fn
    assert torch.equal(m.scales[0], plain.scales[0])
    x = torch.randn(cols, generator=g)
    want = Fp8Rows().dense(plain, torch.float32).double() @ x.double()
    got = fp8_tile_kernel_dot(m.data, m.scales[0], x)
    assert np.linalg.norm(got - want.numpy()) <= 1e-5 * np.linalg.norm(want.numpy())


def test_fp8_tiles_and_rows_hold_the_same_matrix_and_blocks() -> None:
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(3))
    fmt = get_format("fp8")  # the registry's instance reads either layout
    tiles, plain = Fp8Rows(tiles=True).pack(w), Fp8Rows().pack(w)
    dense = fmt.dense(plain, torch.float32)
    assert torch.equal(fmt.dense(tiles, torch.float32), dense)
    a, s = fmt.gemm_operands(tiles)
    assert torch.equal(a, plain.data.to(torch.bfloat16)) and torch.equal(s, plain.scales[0])
    assert fmt.matrix_bytes(48, 256) == tiles.data.numel() + 4 * tiles.scales[0].numel()
    rows = fmt.slice_rows(tiles, 16, 32)
    assert Fp8Rows.is_tiled(rows) and torch.equal(fmt.dense(rows, torch.float32), dense[16:48])
    cols = fmt.slice_cols(tiles, 64, 128)
    assert Fp8Rows.is_tiled(cols) and torch.equal(fmt.dense(cols, torch.float32), dense[:, 64:192])
    with pytest.raises(ValueError, match="cut tiles of 16"):
        fmt.slice_rows(tiles, 8, 16)
    with pytest.raises(ValueError, match="columns of 64"):
        fmt.slice_cols(tiles, 0, 32)
    with pytest.raises(ValueError, match="rows must be a multiple of 16"):
        Fp8Rows(tiles=True).pack(w[:40])
    with pytest.raises(ValueError, match="int8 has no tile layout"):
        Int8Rows(tiles=True)


# fp8_triton.py's untiling run by Triton's interpreter on the CPU (E4M3 to bf16 is exact, so
# the interpreter's truncation does not show), and on the GPU below.
_INTERPRETED = """
import torch
from monokernel.weights.formats.fp8 import Fp8Rows
from monokernel.weights.formats.fp8_triton import BLOCK, _kernel
for rows, cols in [(16, 64), (48, 576), (32, 1408)]:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols))
    m = Fp8Rows(tiles=True).pack(w)
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    _kernel()[(rows, -(-cols // BLOCK))](m.data, m.data, out, cols, BN=0, G=0, BLOCK=BLOCK)
    assert torch.equal(out, Fp8Rows().pack(w).data.to(torch.bfloat16)), (rows, cols)
    b = Fp8Rows(tiles=True, block=64).pack(w)
    _kernel()[(rows, -(-cols // BLOCK))](b.data, b.scales[0], out, cols, BN=64, G=0, BLOCK=BLOCK)
    dense = Fp8Rows().dense(b, torch.float32)
    truncated = (dense.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert torch.equal(out, truncated), (rows, cols)
print("ok")
"""


def test_the_triton_untiling_reads_the_layout() -> None:
    assert run_interpreted(_INTERPRETED, timeout_s=600) == "ok"


@pytest.mark.gpu
def test_the_prefill_multiplies_the_stored_fp8_values() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    for rows, cols in [(16, 64), (304, 1408), (1024, 4096)]:
        w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols)).cuda()
        plain = Fp8Rows().pack(w)
        for triton in ("1", "0"):
            with envs.overridden(MONOKERNEL_PREFILL_TRITON=triton):
                a, s = get_format("fp8").gemm_operands(Fp8Rows(tiles=True).pack(w))
            assert torch.equal(a, plain.data.to(torch.bfloat16)) and torch.equal(s, plain.scales[0])
            blocked = Fp8Rows(tiles=True, block=64).pack(w)
            with envs.overridden(MONOKERNEL_PREFILL_TRITON=triton):
                a, s = get_format("fp8").gemm_operands(blocked)
            assert s is None
            assert torch.equal(a, get_format("fp8").dense(blocked, torch.float32).bfloat16())


# ---- block scales (csrc Fp8BlockTiles) --------------------------------------------------------


def fp8_block_kernel_dot(data: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> np.ndarray:
    """Fp8BlockTiles' arithmetic from the packed bytes: each load's 2 k-tiles as in
    fp8_tile_kernel_dot, times the scale of its row and block (scales [T, blocks, 16])."""
    tiles, loads = data.shape[:2]
    vals = data.contiguous().view(torch.uint8).view(torch.float8_e4m3fn).float().double().numpy()
    sc = scales.double().numpy()
    bn = 32 * loads // sc.shape[1]
    hi, lo = f16_hi_lo(x.float())
    acc = np.zeros((tiles, 16))
    for j in range(loads):
        c = np.zeros((tiles, 16))
        for i in range(2):
            kt = 2 * j + i
            a = np.zeros((tiles, 16, 16))
            for lane in range(32):
                for e in range(8):
                    r, col = mma_a_position(lane, e)
                    a[:, r, col] = vals[:, j, lane, 8 * i + e]
            c += a @ hi[16 * kt : 16 * kt + 16] + a @ lo[16 * kt : 16 * kt + 16]
        acc += sc[:, 32 * j // bn, :] * c
    return acc.reshape(16 * tiles)


@pytest.mark.parametrize(("rows", "cols", "bm", "bn"), [(48, 256, 48, 64), (64, 512, 128, 128)])
def test_block_scales_are_what_the_tile_gemv_multiplies(
    rows: int, cols: int, bm: int, bn: int
) -> None:
    """A checkpoint's blocks packed from its dequantised weights (bf16, as the loader hands
    them over) keep the checkpoint's E4M3 values, and the kernel's arithmetic on the bytes is
    the dequantised matrix times x."""
    g = torch.Generator().manual_seed(rows + bn)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 3
    q, s = quantize_blocks(w, bm, bn)
    dense = q.float() * block_scales(s, bm, bn, rows, cols)
    row_scales = s.repeat_interleave(bm, 0)[:rows]
    m = Fp8Rows(tiles=True, block=bn).pack(dense.bfloat16(), row_scales)
    fmt = get_format("fp8")
    assert fmt.block_of(m) == bn and m.scales[0].shape == (rows // 16, cols // bn, 16)
    assert torch.equal(fmt.stored(m).view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(fmt.scales_of(m), row_scales)
    assert torch.equal(fmt.dense(m, torch.float32), dense)
    assert fmt.gemm_operands(m)[1] is None  # block scales stay inside the matrix
    assert fmt.matrix_bytes(rows, cols) == rows * cols + 4 * rows  # the registry's: rows
    assert Fp8Rows(tiles=True, block=bn).matrix_bytes(rows, cols) == (
        m.data.numel() + 4 * m.scales[0].numel()
    )
    x = torch.randn(cols, generator=g)
    want = dense.double() @ x.double()
    got = fp8_block_kernel_dot(m.data, m.scales[0], x)
    assert np.linalg.norm(got - want.numpy()) <= 1e-5 * np.linalg.norm(want.numpy())


def test_block_scaled_blocks_and_refusals() -> None:
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(5))
    fmt = get_format("fp8")
    m = Fp8Rows(tiles=True, block=64).pack(w)  # its own blocks: each row's block's amax
    dense = fmt.dense(m, torch.float32)
    rows = fmt.slice_rows(m, 16, 32)
    assert torch.equal(fmt.dense(rows, torch.float32), dense[16:48])
    cols = fmt.slice_cols(m, 64, 128)
    assert fmt.block_of(cols) == 64
    assert torch.equal(fmt.dense(cols, torch.float32), dense[:, 64:192])
    with pytest.raises(ValueError, match="cut blocks of 64"):
        fmt.slice_cols(m, 32, 64)
    with pytest.raises(ValueError, match="block scales \\(48, 3\\)"):
        Fp8Rows(tiles=True, block=64).pack(w, torch.ones(48, 3))
    with pytest.raises(ValueError, match="reads them in tiles"):
        Fp8Rows(block=128)
    with pytest.raises(ValueError, match="a power of two of at least 64"):
        Fp8Rows(tiles=True, block=192)
