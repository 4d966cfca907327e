"""Build, pack for and launch the tensor-core skinny-GEMV benchmark (``csrc/skinny_gemv_bench.cu``).

y[n] = W x[n] for N = 1..16 vectors in one pass over W, the products on the tensor cores
(mma.m16n8k16, inputs as bf16 or f16 hi + lo): how fast bf16, FP8 and 4-bit weights stream
that way,
against the decode kernel's CUDA-core GEMV (issue 35's 4-bit speed, issue 36's verify pass of
K+1 positions). The same build conventions as ``allreduce.py`` (content-hashed cubin in the
cache, a lock, an atomic rename); the packers are plain torch, so the CPU tests check them
against the dequantised matrix.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from monokernel.kernels.build import CSRC, build_standalone
from monokernel.kernels.launcher import DeviceKernel
from monokernel.weights.formats.int4 import fragment_tables, pack_tiles

SOURCE = CSRC / "skinny_gemv_bench.cu"
HEADERS = (CSRC / "common.cuh", CSRC / "mma.cuh")  # what SOURCE includes: the cache key
NS = (1, 2, 4, 8, 16)  # the entry points' input counts
FORMATS = ("bf16", "fp8", "int4")
THREADS = 512  # kSkThreads
GROUP = 128  # int4 columns sharing a scale and an offset (kGroup)
TILE = 16  # rows of a row tile, columns of a k-tile


class SkinnyParams(ctypes.Structure):
    """Mirror of ``struct SkinnyParams`` in csrc/skinny_gemv_bench.cu (same order and widths)."""

    _fields_ = [
        ("w", ctypes.c_uint64),
        ("ab", ctypes.c_uint64),
        ("x", ctypes.c_uint64),
        ("y", ctypes.c_uint64),
        ("rows", ctypes.c_int32),
        ("k", ctypes.c_int32),
        ("ks", ctypes.c_int32),
        ("ctas_per_slice", ctypes.c_int32),
    ]


def entry_name(fmt: str, n: int) -> str:
    if fmt not in FORMATS or n not in NS:
        raise ValueError(f"no entry for {fmt} x {n}: formats {FORMATS}, N in {NS}")
    return f"skinny_{fmt}_n{n}"


def build() -> Path:
    """The benchmark's cubin, compiled now unless the cache already holds it."""
    return build_standalone(SOURCE, HEADERS, "skinny_gemv_bench", "the skinny-GEMV benchmark")


# Columns a CTA's K-slice is a multiple of: one batch of a lane's loads (bf16 8 k-tiles, fp8
# 8 loads of two, int4 two groups of 128).
SLICE_UNIT = {"bf16": 128, "fp8": 256, "int4": 2 * GROUP}


def check_shape(rows: int, k: int, fmt: str) -> None:
    if rows % TILE or k % SLICE_UNIT[fmt]:
        raise ValueError(
            f"W [{rows}, {k}]: rows must be a multiple of {TILE}, columns of "
            f"{SLICE_UNIT[fmt]} for {fmt}"
        )


def _fragments(m: torch.Tensor) -> torch.Tensor:
    """[R, K] -> [R/16, K/16, 32 lanes, 8]: each lane's A-fragment elements of each tile."""
    rows, k = m.shape
    frag_row, frag_col, _ = fragment_tables(m.device)
    tiles = m.reshape(rows // TILE, TILE, k // TILE, TILE).permute(0, 2, 1, 3)
    return tiles[:, :, frag_row, frag_col]


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """W [R, K] bf16 -> the kernel's bytes: [R/16][K/16][32][8] bf16."""
    check_shape(*w.shape, "bf16")
    return _fragments(w.to(torch.bfloat16)).contiguous().view(torch.uint8).flatten()


def pack_fp8(w8: torch.Tensor) -> torch.Tensor:
    """W [R, K] float8_e4m3fn -> the kernel's bytes: [R/16][K/32][32][2 k-tiles][8]."""
    rows, k = w8.shape
    check_shape(rows, k, "fp8")
    f = _fragments(w8.view(torch.uint8))  # [T, K/16, 32, 8]
    f = f.reshape(rows // TILE, k // 32, 2, 32, 8).permute(0, 1, 3, 2, 4)
    return f.contiguous().flatten()


def pack_int4(
    q: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [R, K] in 0..15, a and b [R, K/128] fp32 (w = a q + b) -> the kernel's bytes
    ([R/16][K/64][32][4] uint32 words) and its [R, K/128, 2] (a, b - 128 a) pairs."""
    rows, k = q.shape
    check_shape(rows, k, "int4")
    pairs = torch.stack([a, b - 128.0 * a], dim=-1).to(torch.float32).contiguous()
    return pack_tiles(q).flatten(), pairs  # the decode kernel's tile layout (int4.py)


def dequant_int4(q: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The fp32 matrix a q + b that pack_int4's bytes stand for."""
    return q.float() * a.repeat_interleave(GROUP, 1) + b.repeat_interleave(GROUP, 1)


def slice_for(k: int, n: int, fmt: str) -> int:
    """The K-slice a CTA holds: the most columns whose N hi + lo 16-bit rows fit ~64 KB, a
    multiple of the format's SLICE_UNIT dividing K."""
    unit = SLICE_UNIT[fmt]
    ks = k
    while ks > unit and (4 * n * ks > 64 * 1024 or k % ks):
        ks -= unit
    while k % ks:
        ks -= unit
    return ks


def smem_bytes(n: int, ks: int) -> int:
    return 2 * n * (ks // 2 + 4) * 4 + n * (ks // GROUP) * 4


class SkinnyGemv(DeviceKernel):
    """One entry point (format, N) loaded on ``device``, for a K-slice of ``ks`` columns."""

    def __init__(self, cubin: Path, device: int, fmt: str, n: int, ks: int) -> None:
        self.fmt, self.n, self.ks = fmt, n, ks
        super().__init__(cubin, device, entry_name(fmt, n), smem_bytes(n, ks), THREADS)


def params(
    packed: torch.Tensor,
    pairs: torch.Tensor | None,
    x: torch.Tensor,
    y: torch.Tensor,
    ks: int,
    ctas_per_slice: int,
) -> SkinnyParams:
    """A launch's parameters: x [N, K] and y [N, R] fp32 on the device, the packed weights
    and their scales (int4's pairs, fp8's row scales; None for bf16)."""
    return SkinnyParams(
        packed.data_ptr(),
        0 if pairs is None else pairs.data_ptr(),
        x.data_ptr(),
        y.data_ptr(),
        y.shape[1],
        x.shape[1],
        ks,
        ctas_per_slice,
    )


def grid_for(k: int, ks: int, sms: int) -> tuple[int, int]:
    """(CTAs, CTAs a slice): one CTA an SM, the slices dealt evenly."""
    slices = k // ks
    per = max(1, sms // slices)
    return slices * per, per
