"""The skinny-GEMV benchmark's packers (kernels/skinny_gemv.py) against the layout its kernel
reads (csrc/skinny_gemv_bench.cu), decoded here element by element as the kernel's registers
hold them; the kernel's sum rule for 4-bit groups; the cubin builds (nvcc, no GPU). The
GPU run against the fp64 product is in tools/skinny_gemv.py (its rel_l2 column) and
test_skinny_gemv_gpu below.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from monokernel.kernels import skinny_gemv as sk
from monokernel.testing.cuda_structs import struct_mismatch

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


def _lane_elements(lane: int) -> list[tuple[int, int]]:
    """mma.m16n8k16's A fragment of lane ``lane``: (row, column) of its 8 elements, in
    register order (PTX ISA, "Matrix Fragments for mma.m16n8k16")."""
    g, t = lane // 4, lane % 4
    return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1),
            (g, 2 * t + 8), (g, 2 * t + 9), (g + 8, 2 * t + 8), (g + 8, 2 * t + 9)]  # fmt: skip


def test_bf16_layout_is_each_lanes_fragment() -> None:
    rows, k = 32, 256
    w = torch.randn(rows, k).to(torch.bfloat16)
    packed = sk.pack_bf16(w).view(torch.bfloat16).view(rows // 16, k // 16, 32, 8)
    for tile in (0, rows // 16 - 1):
        for kt in (0, 5, k // 16 - 1):
            for lane in (0, 7, 13, 31):
                for e, (r, c) in enumerate(_lane_elements(lane)):
                    assert packed[tile, kt, lane, e] == w[16 * tile + r, 16 * kt + c]


def test_fp8_layout_is_each_lanes_fragment_two_tiles_a_load() -> None:
    rows, k = 32, 512
    w8 = torch.randn(rows, k).to(torch.float8_e4m3fn)
    packed = sk.pack_fp8(w8).view(rows // 16, k // 32, 32, 2, 8)
    raw = w8.view(torch.uint8)
    for tile in (0, 1):
        for j in (0, 7, k // 32 - 1):
            for lane in (0, 18, 31):
                for h in range(2):  # bytes 8h .. 8h + 7: k-tile 2j + h
                    for e, (r, c) in enumerate(_lane_elements(lane)):
                        want = raw[16 * tile + r, 16 * (2 * j + h) + c]
                        assert packed[tile, j, lane, h, e] == want


def test_int4_words_give_the_kernels_registers() -> None:
    rows, k = 48, 1024
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (rows, k), generator=gen, dtype=torch.uint8)
    a = torch.rand(rows, k // sk.GROUP, generator=gen)
    b = torch.randn(rows, k // sk.GROUP, generator=gen)
    packed, pairs = sk.pack_int4(q, a, b)
    words = packed.view(torch.int32).view(rows // 16, k // 64, 32, 4).to(torch.int64) & 0xFFFFFFFF
    for tile in (0, 2):
        for j4 in (0, 3, k // 64 - 1):
            for lane in (0, 9, 31):
                for i in range(4):  # word i: k-tile 4 j4 + i
                    v = int(words[tile, j4, lane, i])
                    els = _lane_elements(lane)
                    for m in range(4):  # register m = ((v >> 4m) & 0x000F000F) | 0x43004300
                        reg = ((v >> (4 * m)) & 0x000F000F) | 0x43004300
                        lo, hi = reg & 0xFFFF, reg >> 16
                        for half, e in ((lo, 2 * m), (hi, 2 * m + 1)):
                            as_bf16 = torch.tensor([half], dtype=torch.int16).view(torch.bfloat16)
                            r, c = els[e]
                            want = 128 + int(q[16 * tile + r, 64 * j4 + 16 * i + c])
                            assert float(as_bf16) == want
    assert torch.equal(pairs[..., 0], a) and torch.allclose(pairs[..., 1], b - 128 * a)


def test_int4_group_rule_is_the_dequantised_product() -> None:
    """sum over groups of a C + (b - 128 a) s, C = sum (128 + q) x and s = sum x (the
    kernel's rule), equals x @ (a q + b)^T."""
    rows, k = 16, 512
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (rows, k), generator=gen, dtype=torch.uint8)
    a = torch.rand(rows, k // sk.GROUP, generator=gen, dtype=torch.float64)
    b = torch.randn(rows, k // sk.GROUP, generator=gen, dtype=torch.float64)
    x = torch.randn(k, generator=gen, dtype=torch.float64)
    _, pairs = sk.pack_int4(q, a, b)
    xg = x.view(-1, sk.GROUP)
    c = ((128 + q.double()).view(rows, -1, sk.GROUP) * xg).sum(-1)  # [rows, groups]
    y = (pairs[..., 0].double() * c + pairs[..., 1].double() * xg.sum(-1)).sum(-1)
    want = sk.dequant_int4(q, a, b).double() @ x
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-5)


def test_slices_fit_and_divide() -> None:
    for fmt in sk.FORMATS:
        for k in (512, 2048, 4096, 14336 // 512 * 512, 8192):
            for n in sk.NS:
                ks = sk.slice_for(k, n, fmt)
                assert k % ks == 0 and ks % sk.SLICE_UNIT[fmt] == 0
                assert sk.smem_bytes(n, ks) <= 227 * 1024
    with pytest.raises(ValueError, match="multiple of 16"):
        sk.check_shape(24, 512, "bf16")
    with pytest.raises(ValueError, match="no entry"):
        sk.entry_name("int8", 1)


@needs_nvcc
def test_builds_a_cubin_with_every_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONOKERNEL_CACHE", str(tmp_path))
    path = sk.build()
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF"
    for fmt in sk.FORMATS:
        for n in sk.NS:
            assert sk.entry_name(fmt, n).encode() in data


@needs_nvcc
def test_ctypes_params_match_the_cuda_struct(tmp_path: Path) -> None:
    assert struct_mismatch(sk.SkinnyParams, "SkinnyParams", sk.SOURCE, tmp_path) is None


_HOPPER = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs a Hopper GPU (sm_90)",
)


@pytest.mark.gpu
@_HOPPER
@pytest.mark.parametrize("fmt", sk.FORMATS)
@pytest.mark.parametrize("n", [1, 3, 16])
def test_skinny_gemv_gpu(fmt: str, n: int) -> None:
    """The kernel against the fp64 product on the same weights, odd N included (3: an
    entry for 4 with one column unused is what a caller gets; here the 4 entry with x's
    fourth row zero)."""
    entry_n = min(m for m in sk.NS if m >= n)
    rows, k = 16 * 37, 1536
    gen = torch.Generator(device="cuda").manual_seed(n)
    packed, pairs, dense = _gpu_weights(fmt, rows, k, gen)
    x = torch.zeros(entry_n, k, device="cuda")
    x[:n] = torch.randn(n, k, generator=gen, device="cuda")
    ks = sk.slice_for(k, entry_n, fmt)
    y = _run(fmt, packed, pairs, x, ks, rows)
    want = x.double() @ dense.T
    err = float((y.double() - want).norm() / want.norm())
    # bf16: x's hi + lo carry ~16 bits (~5e-6 measured); int4: the groups' sums carry
    # 128 s beside sum q x, which costs a few bits of fp32 (~2e-5 to 9e-5 measured).
    assert err < (3e-4 if fmt == "int4" else 3e-5), err


@pytest.mark.gpu
@_HOPPER
@pytest.mark.parametrize("fmt", sk.FORMATS)
def test_each_position_of_a_pass_is_its_own_one_position_pass(fmt: str) -> None:
    """What an in-kernel verify pass rests on (docs/speculative.md): with the same K-slices,
    position p of a 4-position pass is bitwise a 1-position pass over x[p] (the tensor cores
    sum each of B's columns on its own). One slice, so each output is one warp's sum and the
    benchmark's atomicAdd adds it to zero: exact."""
    rows, k = 16 * 37, 1024
    gen = torch.Generator(device="cuda").manual_seed(11)
    packed, pairs, _ = _gpu_weights(fmt, rows, k, gen)
    x = torch.randn(4, k, generator=gen, device="cuda")
    together = _run(fmt, packed, pairs, x, k, rows)
    for p in range(4):
        alone = _run(fmt, packed, pairs, x[p : p + 1].contiguous(), k, rows)
        assert torch.equal(alone[0], together[p]), (fmt, p)


def _gpu_weights(
    fmt: str, rows: int, k: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Random weights of ``fmt`` packed for the benchmark: (packed, pairs or row scales,
    the dense matrix in fp64)."""
    if fmt == "bf16":
        w = torch.randn(rows, k, generator=gen, device="cuda").to(torch.bfloat16)
        return sk.pack_bf16(w), None, w.double()
    if fmt == "fp8":
        w8 = torch.randn(rows, k, generator=gen, device="cuda").to(torch.float8_e4m3fn)
        scale = torch.rand(rows, generator=gen, device="cuda") + 0.5
        return sk.pack_fp8(w8), scale, w8.double() * scale.double()[:, None]
    q = torch.randint(0, 16, (rows, k), generator=gen, dtype=torch.uint8, device="cuda")
    a = torch.rand(rows, k // sk.GROUP, generator=gen, device="cuda") * 0.01
    b = torch.randn(rows, k // sk.GROUP, generator=gen, device="cuda") * 0.01
    packed, pairs = sk.pack_int4(q, a, b)
    return packed, pairs, sk.dequant_int4(q, a, b).double()


def _run(
    fmt: str, packed: torch.Tensor, pairs: torch.Tensor | None, x: torch.Tensor, ks: int, rows: int
) -> torch.Tensor:
    """y [N, rows] of one launch of the entry for x's N positions, K-slices of ``ks``."""
    n, k = x.shape
    y = torch.zeros(n, rows, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid, per = sk.grid_for(k, ks, sms)
    kern = sk.SkinnyGemv(sk.build(), torch.cuda.current_device(), fmt, n, ks)
    try:
        kern.launch(
            grid, sk.params(packed, pairs, x, y, ks, per), torch.cuda.current_stream().cuda_stream
        )
        torch.cuda.synchronize()
    finally:
        kern.unload()
    return y
