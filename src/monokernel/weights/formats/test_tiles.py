"""The 16-row tile layout (tiles.py) against PTX's mma.m16n8k16 fragment layout written out
here: which layout the kernel streams for a shape and format, the byte tiles fp8 packs, and
the fp8 tile GEMV's arithmetic (csrc/formats/fp8_tiles.cuh, csrc/gemv_tiles.cuh) emulated
from the packed bytes: each 16-bit half an f16 pair, x as f16 hi + lo, the row's scale last."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from monokernel import envs
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
    _kernel()[(rows, -(-cols // BLOCK))](m.data, out, cols, BLOCK=BLOCK)
    assert torch.equal(out, Fp8Rows().pack(w).data.to(torch.bfloat16)), (rows, cols)
print("ok")
"""


def test_the_triton_untiling_reads_the_layout() -> None:
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.gpu
def test_the_prefill_multiplies_the_stored_fp8_values() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    for rows, cols in [(16, 64), (304, 1408), (1024, 4096)]:
        w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols)).cuda()
        plain = Fp8Rows().pack(w)
        for triton in (True, False):
            with envs.overridden(MONOKERNEL_PREFILL_TRITON=triton):
                a, s = get_format("fp8").gemm_operands(Fp8Rows(tiles=True).pack(w))
            assert torch.equal(a, plain.data.to(torch.bfloat16)) and torch.equal(s, plain.scales[0])
