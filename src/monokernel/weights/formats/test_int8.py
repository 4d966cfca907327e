"""The int8 weight format (one signed byte a weight, a float32 scale a row, symmetric)
against plain PyTorch: the bytes and scales it stores, how far they are from the input, and
the blocks tensor parallelism and the repack's fusing take of it."""

from __future__ import annotations

import pytest
import torch

from monokernel.weights.formats import FORMATS, PackedMatrix, get_format
from monokernel.weights.formats.int8 import Int8Rows

SIZES = [(1, 1), (7, 13), (33, 5), (3, 130), (5, 48)]  # odd rows and columns, a 1x1

INT8 = get_format("int8")


def _matrix(
    rows: int, cols: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g).to(dtype)


def _q(m: PackedMatrix) -> torch.Tensor:
    return m.data.float()


def _error_bound(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Round to nearest on a uniform grid of step s: half a step, plus float32's rounding of
    the division and the product."""
    return s[:, None] / 2 + w.abs().amax(dim=1, keepdim=True) * 2**-20


@pytest.mark.parametrize(("rows", "cols"), SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_pack_stores_int8_and_a_float32_scale_a_row(
    rows: int, cols: int, dtype: torch.dtype
) -> None:
    w = _matrix(rows, cols, dtype, seed=1)
    m = INT8.pack(w)
    assert (m.format, m.shape) == ("int8", (rows, cols))
    assert m.data.dtype == torch.int8 and m.data.shape == (rows, cols)
    assert m.data.is_contiguous()
    (s,) = m.scales
    assert s.dtype == torch.float32 and s.shape == (rows,) and s.is_contiguous()
    assert torch.equal(s, w.float().abs().amax(dim=1) / 127)
    assert torch.equal(_q(m).abs().amax(dim=1), torch.full((rows,), 127.0))  # full range
    assert m.data.min() >= -127  # symmetric: -128 never used
    assert not INT8.packs_in_place


@pytest.mark.parametrize(("rows", "cols"), SIZES)
def test_dense_is_the_integers_times_the_row_scales(rows: int, cols: int) -> None:
    m = INT8.pack(_matrix(rows, cols, seed=2))
    want = _q(m) * m.scales[0][:, None]
    assert torch.equal(INT8.dense(m, torch.float32), want)  # exact: the kernel's values
    assert INT8.dense(m).dtype == torch.bfloat16  # the prefill's, on any device
    assert torch.equal(INT8.dense(m), want.to(torch.bfloat16))
    assert torch.equal(INT8.dense(m, torch.float16), want.to(torch.float16))


@pytest.mark.parametrize(("rows", "cols"), SIZES)
def test_each_weight_is_within_half_a_step(rows: int, cols: int) -> None:
    w = _matrix(rows, cols, seed=3)
    m = INT8.pack(w)
    err = (INT8.dense(m, torch.float32) - w).abs()
    assert (err <= _error_bound(w, m.scales[0])).all()


def test_the_error_bound_is_tight() -> None:
    """Round to nearest, not a floor or a coarser grid: on many weights some come close to
    half a step, and none past it."""
    w = _matrix(64, 257, seed=4)
    m = INT8.pack(w)
    ratio = (INT8.dense(m, torch.float32) - w).abs() / _error_bound(w, m.scales[0])
    assert 0.9 < ratio.max() <= 1


@pytest.mark.parametrize(("rows", "cols"), SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_representable_weights_round_trip_exactly(rows: int, cols: int, dtype: torch.dtype) -> None:
    """Integers in [-127, 127] times a power of two, each row's amax exactly 127 x its
    scale: the scale is that power of two and the bytes are the integers themselves."""
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (rows, cols), generator=g).float()
    q[torch.arange(rows), torch.randint(cols, (rows,), generator=g)] = 127.0
    q[::2] = -q[::2]  # rows whose amax is a negative weight, too
    c = 2.0 ** torch.randint(-12, 4, (rows,), generator=g).float()
    w = (q * c[:, None]).to(dtype)  # exact in bf16 too: 127 needs 7 bits
    m = INT8.pack(w)
    assert torch.equal(m.scales[0], c)
    assert torch.equal(_q(m), q)
    assert torch.equal(INT8.dense(m, torch.float32), w.float())


def test_an_all_zero_row_has_scale_one_and_stays_zero() -> None:
    w = _matrix(3, 9, seed=6)
    w[1] = 0
    m = INT8.pack(w)
    assert m.scales[0][1] == 1.0
    assert torch.equal(m.data[1], torch.zeros(9, dtype=torch.int8))
    assert torch.equal(INT8.dense(m, torch.float32)[1], torch.zeros(9))
    assert torch.isfinite(INT8.dense(m, torch.float32)).all()


def test_a_row_whose_largest_weight_is_negative() -> None:
    w = torch.tensor([[-3.0, 1.0, 2.0], [0.5, -0.25, 0.125]])
    m = INT8.pack(w)
    assert torch.equal(m.scales[0], torch.tensor([3.0 / 127, 0.5 / 127]))
    assert m.data.tolist() == [[-127, 42, 85], [127, -64, 32]]
    torch.testing.assert_close(INT8.dense(m, torch.float32), w, rtol=0, atol=3.0 / 127 / 2)


@pytest.mark.parametrize(("rows", "cols"), SIZES)
def test_bytes_are_what_the_packed_tensors_hold(rows: int, cols: int) -> None:
    m = INT8.pack(_matrix(rows, cols, torch.bfloat16))
    held = m.data.nbytes + sum(s.nbytes for s in m.scales)
    assert INT8.matrix_bytes(rows, cols) == held == rows * cols + 4 * rows


@pytest.mark.parametrize(("rows", "cols"), [(7, 13), (33, 5), (3, 130), (5, 48)])
def test_row_and_column_blocks_are_the_dense_slices(rows: int, cols: int) -> None:
    m = INT8.pack(_matrix(rows, cols, seed=7))
    whole = INT8.dense(m, torch.float32)
    for start, size in ((0, 1), (1, rows - 1), (rows // 2, rows - rows // 2), (rows, 0)):
        block = INT8.slice_rows(m, start, size)
        assert block.shape == (size, cols) and block.scales[0].shape == (size,)
        assert torch.equal(INT8.dense(block, torch.float32), whole[start : start + size])
        if size:  # views of the packed tensors: a rank's rows cost no copy
            assert block.data.data_ptr() == m.data[start].data_ptr()
            assert block.scales[0].data_ptr() == m.scales[0][start].data_ptr()
    for start, size in ((0, 1), (2, cols - 2), (cols - 1, 1)):
        block = INT8.slice_cols(m, start, size)
        assert block.shape == (rows, size) and block.data.is_contiguous()
        assert block.scales[0] is m.scales[0]
        assert torch.equal(INT8.dense(block, torch.float32), whole[:, start : start + size])


def test_column_blocks_of_ranks_sum_to_the_product() -> None:
    """What tensor parallelism relies on: row blocks stack back to the matrix, and the
    partial products of the column blocks (each scaled by the whole row's scale) sum to
    dense(m) x."""
    w, x = _matrix(12, 30, seed=8), _matrix(30, 1, seed=9)
    m, tp = INT8.pack(w), 3
    whole = INT8.dense(m, torch.float32)
    rows = [INT8.dense(INT8.slice_rows(m, r * 4, 4), torch.float32) for r in range(tp)]
    assert torch.equal(torch.cat(rows), whole)
    partial = [
        INT8.dense(INT8.slice_cols(m, r * 10, 10), torch.float32) @ x[r * 10 : r * 10 + 10]
        for r in range(tp)
    ]
    torch.testing.assert_close(sum(partial), whole @ x)


def test_packing_is_deterministic_and_per_row() -> None:
    """The repack fuses Q/K/V (and gate/up) before packing: packing rows apart and stacking
    must give the same bytes and scales as packing the stack."""
    a, b, c = _matrix(5, 48, seed=10), _matrix(3, 48, seed=11) * 100, _matrix(1, 48, seed=12)
    whole = INT8.pack(torch.cat([a, b, c]))
    again = INT8.pack(torch.cat([a, b, c]))
    parts = [INT8.pack(t) for t in (a, b, c)]
    assert torch.equal(whole.data, again.data)
    assert torch.equal(whole.scales[0], again.scales[0])
    assert torch.equal(whole.data, torch.cat([p.data for p in parts]))
    assert torch.equal(whole.scales[0], torch.cat([p.scales[0] for p in parts]))


def test_the_registry() -> None:
    assert isinstance(get_format("int8"), Int8Rows) and FORMATS["int8"] is get_format("int8")
    assert get_format("int8").kernel_type == "Int8Rows"
    assert list(FORMATS) == ["bf16", "fp8", "int8"]


@pytest.mark.parametrize(
    "bad",
    [torch.ones(4, 4, dtype=torch.int8), torch.ones(8), torch.ones(2, 3, 4)],
)
def test_only_floating_point_matrices_pack(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="int8 packs a floating-point matrix"):
        INT8.pack(bad)


@pytest.mark.parametrize(
    ("axis", "start", "size"), [("rows", 5, 3), ("cols", -1, 2), ("cols", 0, 14)]
)
def test_a_block_outside_the_matrix_is_refused(axis: str, start: int, size: int) -> None:
    m = INT8.pack(_matrix(7, 13))
    cut = INT8.slice_rows if axis == "rows" else INT8.slice_cols
    with pytest.raises(ValueError, match=rf"{axis} \[{start}, {start + size}\) of a \[7, 13\]"):
        cut(m, start, size)
