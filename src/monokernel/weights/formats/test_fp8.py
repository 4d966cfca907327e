"""The fp8 weight format (one e4m3 byte a weight, a float32 scale a row) against plain
PyTorch: the bytes and scales it stores, how far they are from the input, and the blocks
tensor parallelism and the repack's fusing take of it."""

from __future__ import annotations

import pytest
import torch

from monokernel.weights.formats import FORMATS, PackedMatrix, get_format
from monokernel.weights.formats.fp8 import Fp8Rows

SIZES = [(1, 1), (7, 13), (33, 5), (3, 130), (5, 48)]  # odd rows and columns, a 1x1

FP8 = get_format("fp8")
E4M3 = torch.float8_e4m3fn


def _matrix(
    rows: int, cols: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g).to(dtype)


def _q(m: PackedMatrix) -> torch.Tensor:
    return m.data.float()  # e4m3 values are exact in float32


def _fp8_values() -> torch.Tensor:
    """Every finite e4m3fn value (254 of the 256 bytes; 0x7f and 0xff are NaN)."""
    v = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    return v[~v.isnan()]


def _error_bound(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Round to nearest on e4m3: in a binade [2^e, 2^(e+1)), e >= -6, the step is 2^(e-3),
    so the error is at most half a step, 2^(e-4) <= |x| 2^-4; below 2^-6 (subnormals) the
    step is 2^-9 and the error at most 2^-10. x = w / s, so in w's units
    max(|w| 2^-4, s 2^-10); plus float32's rounding of the division and the product."""
    s = s[:, None]
    return torch.maximum(w.abs() * 2**-4, s * 2**-10) + w.abs().amax(dim=1, keepdim=True) * 2**-20


@pytest.mark.parametrize(("rows", "cols"), SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_pack_stores_e4m3_bytes_and_a_float32_scale_a_row(
    rows: int, cols: int, dtype: torch.dtype
) -> None:
    w = _matrix(rows, cols, dtype, seed=1)
    m = FP8.pack(w)
    assert (m.format, m.shape) == ("fp8", (rows, cols))
    assert m.data.dtype == E4M3 and m.data.shape == (rows, cols) and m.data.is_contiguous()
    (s,) = m.scales
    assert s.dtype == torch.float32 and s.shape == (rows,) and s.is_contiguous()
    assert torch.equal(s, w.float().abs().amax(dim=1) / 448)
    assert torch.equal(_q(m).abs().amax(dim=1), torch.full((rows,), 448.0))  # full range
    assert not FP8.packs_in_place


@pytest.mark.parametrize(("rows", "cols"), SIZES)
def test_dense_is_the_bytes_times_the_row_scales(rows: int, cols: int) -> None:
    m = FP8.pack(_matrix(rows, cols, seed=2))
    want = _q(m) * m.scales[0][:, None]
    assert torch.equal(FP8.dense(m, torch.float32), want)  # exact: the kernel's values
    assert FP8.dense(m).dtype == torch.bfloat16  # the prefill's, on any device
    assert torch.equal(FP8.dense(m), want.to(torch.bfloat16))
    assert torch.equal(FP8.dense(m, torch.float16), want.to(torch.float16))


@pytest.mark.parametrize(("rows", "cols"), SIZES)
def test_each_weight_is_within_e4m3_rounding(rows: int, cols: int) -> None:
    w = _matrix(rows, cols, seed=3)
    m = FP8.pack(w)
    err = (FP8.dense(m, torch.float32) - w).abs()
    assert (err <= _error_bound(w, m.scales[0])).all()


def test_the_error_bound_is_tight() -> None:
    """The bound above is what round-to-nearest gives, not a loose one: on many weights
    some come close to it, and none past it."""
    w = _matrix(64, 257, seed=4)
    m = FP8.pack(w)
    ratio = (FP8.dense(m, torch.float32) - w).abs() / _error_bound(w, m.scales[0])
    assert 0.9 < ratio.max() <= 1


@pytest.mark.parametrize(("rows", "cols"), SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_representable_weights_round_trip_exactly(rows: int, cols: int, dtype: torch.dtype) -> None:
    """e4m3 values times a power of two, each row's amax exactly 448 x its scale: the
    scale is that power of two and the bytes are the values themselves."""
    g = torch.Generator().manual_seed(5)
    values = _fp8_values()
    q = values[torch.randint(len(values), (rows, cols), generator=g)]
    q[torch.arange(rows), torch.randint(cols, (rows,), generator=g)] = 448.0
    q[::2] = -q[::2]  # rows whose amax is a negative weight, too
    c = 2.0 ** torch.randint(-12, 4, (rows,), generator=g).float()
    w = (q * c[:, None]).to(dtype)  # exact in bf16 too: e4m3's 3 bits fit its 7
    m = FP8.pack(w)
    assert torch.equal(m.scales[0], c)
    assert torch.equal(_q(m), q)
    assert torch.equal(FP8.dense(m, torch.float32), w.float())


def test_an_all_zero_row_has_scale_one_and_stays_zero() -> None:
    w = _matrix(3, 9, seed=6)
    w[1] = 0
    m = FP8.pack(w)
    assert m.scales[0][1] == 1.0
    assert torch.equal(_q(m)[1], torch.zeros(9))
    assert torch.equal(FP8.dense(m, torch.float32)[1], torch.zeros(9))
    assert torch.isfinite(FP8.dense(m, torch.float32)).all()


def test_a_row_whose_largest_weight_is_negative() -> None:
    w = torch.tensor([[-3.0, 1.0, 2.0], [0.5, -0.25, 0.125]])
    m = FP8.pack(w)
    assert torch.equal(m.scales[0], torch.tensor([3.0 / 448, 0.5 / 448]))
    assert _q(m)[0, 0] == -448 and _q(m)[1, 0] == 448
    torch.testing.assert_close(FP8.dense(m, torch.float32), w, rtol=2**-4, atol=0)


@pytest.mark.parametrize(("rows", "cols"), SIZES)
def test_bytes_are_what_the_packed_tensors_hold(rows: int, cols: int) -> None:
    m = FP8.pack(_matrix(rows, cols, torch.bfloat16))
    held = m.data.nbytes + sum(s.nbytes for s in m.scales)
    assert FP8.matrix_bytes(rows, cols) == held == rows * cols + 4 * rows


@pytest.mark.parametrize(("rows", "cols"), [(7, 13), (33, 5), (3, 130), (5, 48)])
def test_row_and_column_blocks_are_the_dense_slices(rows: int, cols: int) -> None:
    m = FP8.pack(_matrix(rows, cols, seed=7))
    whole = FP8.dense(m, torch.float32)
    for start, size in ((0, 1), (1, rows - 1), (rows // 2, rows - rows // 2), (rows, 0)):
        block = FP8.slice_rows(m, start, size)
        assert block.shape == (size, cols) and block.scales[0].shape == (size,)
        assert torch.equal(FP8.dense(block, torch.float32), whole[start : start + size])
        if size:  # views of the packed tensors: a rank's rows cost no copy
            assert block.data.data_ptr() == m.data[start].data_ptr()
            assert block.scales[0].data_ptr() == m.scales[0][start].data_ptr()
    for start, size in ((0, 1), (2, cols - 2), (cols - 1, 1)):
        block = FP8.slice_cols(m, start, size)
        assert block.shape == (rows, size) and block.data.is_contiguous()
        assert block.scales[0] is m.scales[0]
        assert torch.equal(FP8.dense(block, torch.float32), whole[:, start : start + size])


def test_column_blocks_of_ranks_sum_to_the_product() -> None:
    """What tensor parallelism relies on: row blocks stack back to the matrix, and the
    partial products of the column blocks (each scaled by the whole row's scale) sum to
    dense(m) x."""
    w, x = _matrix(12, 30, seed=8), _matrix(30, 1, seed=9)
    m, tp = FP8.pack(w), 3
    whole = FP8.dense(m, torch.float32)
    rows = [FP8.dense(FP8.slice_rows(m, r * 4, 4), torch.float32) for r in range(tp)]
    assert torch.equal(torch.cat(rows), whole)
    partial = [
        FP8.dense(FP8.slice_cols(m, r * 10, 10), torch.float32) @ x[r * 10 : r * 10 + 10]
        for r in range(tp)
    ]
    torch.testing.assert_close(sum(partial), whole @ x)


def test_packing_is_deterministic_and_per_row() -> None:
    """The repack fuses Q/K/V (and gate/up) before packing: packing rows apart and stacking
    must give the same bytes and scales as packing the stack."""
    a, b, c = _matrix(5, 48, seed=10), _matrix(3, 48, seed=11) * 100, _matrix(1, 48, seed=12)
    whole = FP8.pack(torch.cat([a, b, c]))
    again = FP8.pack(torch.cat([a, b, c]))
    parts = [FP8.pack(t) for t in (a, b, c)]
    assert torch.equal(whole.data.view(torch.uint8), again.data.view(torch.uint8))
    assert torch.equal(whole.scales[0], again.scales[0])
    stacked = torch.cat([p.data.view(torch.uint8) for p in parts])
    assert torch.equal(whole.data.view(torch.uint8), stacked)
    assert torch.equal(whole.scales[0], torch.cat([p.scales[0] for p in parts]))


def test_the_registry() -> None:
    assert isinstance(get_format("fp8"), Fp8Rows) and FORMATS["fp8"] is get_format("fp8")
    assert get_format("fp8").kernel_type == "Fp8Rows"
    assert list(FORMATS) == ["bf16", "fp8", "int8"]


@pytest.mark.parametrize(
    "bad",
    [torch.ones(4, 4, dtype=torch.int8), torch.ones(8), torch.ones(2, 3, 4)],
)
def test_only_floating_point_matrices_pack(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="fp8 packs a floating-point matrix"):
        FP8.pack(bad)


@pytest.mark.parametrize(
    ("axis", "start", "size"), [("rows", 5, 3), ("cols", -1, 2), ("cols", 0, 14)]
)
def test_a_block_outside_the_matrix_is_refused(axis: str, start: int, size: int) -> None:
    m = FP8.pack(_matrix(7, 13))
    cut = FP8.slice_rows if axis == "rows" else FP8.slice_cols
    with pytest.raises(ValueError, match=rf"{axis} \[{start}, {start + size}\) of a \[7, 13\] fp8"):
        cut(m, start, size)
