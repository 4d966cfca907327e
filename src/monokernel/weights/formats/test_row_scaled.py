"""What fp8 and int8 share (``RowScaled`` in fp8.py: one byte a weight, a float32 scale a
row) against plain PyTorch, each test run for both formats: the bytes and scales they store,
how far they are from the input and which weights they keep exactly, the blocks tensor
parallelism and the repack's fusing take of them, the registry and what they refuse. How each
rounds a scaled row to a byte (its error bound and the values it stores exactly) is stated in
test_fp8.py and test_int8.py, with the tests only that format has."""

from __future__ import annotations

import pytest
import torch

from monokernel.weights.formats import FORMATS, PackedMatrix, get_format, test_fp8, test_int8
from monokernel.weights.formats.fp8 import Fp8Rows
from monokernel.weights.formats.int8 import Int8Rows

SIZES = [(1, 1), (7, 13), (33, 5), (3, 130), (5, 48)]  # odd rows and columns, a 1x1

# Per format: the class, the kernel's type, the stored dtype and the largest stored magnitude
# (a row's amax maps onto it). Written out, not read off the classes, so a change fails here.
CLASS = {"fp8": Fp8Rows, "int8": Int8Rows}
KERNEL_TYPE = {"fp8": "Fp8Rows", "int8": "Int8Rows"}
STORED = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
QMAX = {"fp8": 448.0, "int8": 127.0}
# How each rounds: its error_bound(w, scales) and the values it stores exactly, representable().
ROUNDING = {"fp8": test_fp8, "int8": test_int8}

pytestmark = pytest.mark.parametrize("name", ["fp8", "int8"])


def matrix(rows: int, cols: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g).to(dtype)


def stored(m: PackedMatrix) -> torch.Tensor:
    """The stored values as float32 (e4m3 values and int8 integers are exact in it)."""
    return m.data.float()


@pytest.mark.parametrize(("rows", "cols"), SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_pack_stores_a_byte_a_weight_and_a_float32_scale_a_row(
    name: str, rows: int, cols: int, dtype: torch.dtype
) -> None:
    fmt = get_format(name)
    w = matrix(rows, cols, dtype, seed=1)
    m = fmt.pack(w)
    assert (m.format, m.shape) == (name, (rows, cols))
    assert m.data.dtype == STORED[name] and m.data.shape == (rows, cols)
    assert m.data.is_contiguous()
    (s,) = m.scales
    assert s.dtype == torch.float32 and s.shape == (rows,) and s.is_contiguous()
    assert torch.equal(s, w.float().abs().amax(dim=1) / QMAX[name])
    assert torch.equal(stored(m).abs().amax(dim=1), torch.full((rows,), QMAX[name]))  # full range
    assert not fmt.packs_in_place


@pytest.mark.parametrize(("rows", "cols"), SIZES)
def test_dense_is_the_stored_values_times_the_row_scales(name: str, rows: int, cols: int) -> None:
    fmt = get_format(name)
    m = fmt.pack(matrix(rows, cols, seed=2))
    want = stored(m) * m.scales[0][:, None]
    assert torch.equal(fmt.dense(m, torch.float32), want)  # exact: the kernel's values
    assert fmt.dense(m).dtype == torch.bfloat16  # the prefill's, on any device
    assert torch.equal(fmt.dense(m), want.to(torch.bfloat16))
    assert torch.equal(fmt.dense(m, torch.float16), want.to(torch.float16))


def test_an_all_zero_row_has_scale_one_and_stays_zero(name: str) -> None:
    fmt = get_format(name)
    w = matrix(3, 9, seed=6)
    w[1] = 0
    m = fmt.pack(w)
    assert m.scales[0][1] == 1.0
    assert torch.equal(stored(m)[1], torch.zeros(9))
    assert torch.equal(m.data[1].view(torch.uint8), torch.zeros(9, dtype=torch.uint8))  # +0
    assert torch.equal(fmt.dense(m, torch.float32)[1], torch.zeros(9))
    assert torch.isfinite(fmt.dense(m, torch.float32)).all()


@pytest.mark.parametrize(("rows", "cols"), SIZES)
def test_each_weight_is_within_the_formats_rounding(name: str, rows: int, cols: int) -> None:
    fmt = get_format(name)
    w = matrix(rows, cols, seed=3)
    m = fmt.pack(w)
    err = (fmt.dense(m, torch.float32) - w).abs()
    assert (err <= ROUNDING[name].error_bound(w, m.scales[0])).all()


def test_the_error_bound_is_tight(name: str) -> None:
    """The bound is what round-to-nearest gives, not a loose one (not a floor, nor a coarser
    grid): on many weights some come close to it, and none past it."""
    fmt = get_format(name)
    w = matrix(64, 257, seed=4)
    m = fmt.pack(w)
    ratio = (fmt.dense(m, torch.float32) - w).abs() / ROUNDING[name].error_bound(w, m.scales[0])
    assert 0.9 < ratio.max() <= 1


@pytest.mark.parametrize(("rows", "cols"), SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_representable_weights_round_trip_exactly(
    name: str, rows: int, cols: int, dtype: torch.dtype
) -> None:
    """Values the format stores exactly (e4m3 values, integers in [-127, 127]) times a power
    of two, each row's amax exactly qmax x its scale: the scale is that power of two and the
    bytes are the values themselves."""
    fmt, qmax = get_format(name), QMAX[name]
    g = torch.Generator().manual_seed(5)
    values = ROUNDING[name].representable()
    q = values[torch.randint(len(values), (rows, cols), generator=g)]
    q[torch.arange(rows), torch.randint(cols, (rows,), generator=g)] = qmax
    q[::2] = -q[::2]  # rows whose amax is a negative weight, too
    c = 2.0 ** torch.randint(-12, 4, (rows,), generator=g).float()
    w = (q * c[:, None]).to(dtype)  # exact in bf16 too: e4m3's 3 bits and 127's 7 fit its 7
    m = fmt.pack(w)
    assert torch.equal(m.scales[0], c)
    assert torch.equal(stored(m), q)
    assert torch.equal(fmt.dense(m, torch.float32), w.float())


def test_a_row_whose_largest_weight_is_negative(name: str) -> None:
    """The scales and the stored amax; how the other weights round is each format's (the
    same matrix in test_fp8.py and test_int8.py)."""
    fmt, qmax = get_format(name), QMAX[name]
    m = fmt.pack(torch.tensor([[-3.0, 1.0, 2.0], [0.5, -0.25, 0.125]]))
    assert torch.equal(m.scales[0], torch.tensor([3.0 / qmax, 0.5 / qmax]))
    assert stored(m)[0, 0] == -qmax and stored(m)[1, 0] == qmax


@pytest.mark.parametrize(("rows", "cols"), SIZES)
def test_bytes_are_what_the_packed_tensors_hold(name: str, rows: int, cols: int) -> None:
    fmt = get_format(name)
    m = fmt.pack(matrix(rows, cols, torch.bfloat16))
    held = m.data.nbytes + sum(s.nbytes for s in m.scales)
    assert fmt.matrix_bytes(rows, cols) == held == rows * cols + 4 * rows


@pytest.mark.parametrize(("rows", "cols"), [(7, 13), (33, 5), (3, 130), (5, 48)])
def test_row_and_column_blocks_are_the_dense_slices(name: str, rows: int, cols: int) -> None:
    fmt = get_format(name)
    m = fmt.pack(matrix(rows, cols, seed=7))
    whole = fmt.dense(m, torch.float32)
    for start, size in ((0, 1), (1, rows - 1), (rows // 2, rows - rows // 2), (rows, 0)):
        block = fmt.slice_rows(m, start, size)
        assert block.shape == (size, cols) and block.scales[0].shape == (size,)
        assert torch.equal(fmt.dense(block, torch.float32), whole[start : start + size])
        if size:  # views of the packed tensors: a rank's rows cost no copy
            assert block.data.data_ptr() == m.data[start].data_ptr()
            assert block.scales[0].data_ptr() == m.scales[0][start].data_ptr()
    for start, size in ((0, 1), (2, cols - 2), (cols - 1, 1)):
        block = fmt.slice_cols(m, start, size)
        assert block.shape == (rows, size) and block.data.is_contiguous()
        assert block.scales[0] is m.scales[0]
        assert torch.equal(fmt.dense(block, torch.float32), whole[:, start : start + size])


def test_column_blocks_of_ranks_sum_to_the_product(name: str) -> None:
    """What tensor parallelism relies on: row blocks stack back to the matrix, and the
    partial products of the column blocks (each scaled by the whole row's scale) sum to
    dense(m) x."""
    fmt = get_format(name)
    w, x = matrix(12, 30, seed=8), matrix(30, 1, seed=9)
    m, tp = fmt.pack(w), 3
    whole = fmt.dense(m, torch.float32)
    rows = [fmt.dense(fmt.slice_rows(m, r * 4, 4), torch.float32) for r in range(tp)]
    assert torch.equal(torch.cat(rows), whole)
    partial = [
        fmt.dense(fmt.slice_cols(m, r * 10, 10), torch.float32) @ x[r * 10 : r * 10 + 10]
        for r in range(tp)
    ]
    torch.testing.assert_close(sum(partial), whole @ x)


def test_packing_is_deterministic_and_per_row(name: str) -> None:
    """The repack fuses Q/K/V (and gate/up) before packing: packing rows apart and stacking
    must give the same bytes and scales as packing the stack."""
    fmt = get_format(name)
    a, b, c = matrix(5, 48, seed=10), matrix(3, 48, seed=11) * 100, matrix(1, 48, seed=12)
    whole = fmt.pack(torch.cat([a, b, c]))
    again = fmt.pack(torch.cat([a, b, c]))
    parts = [fmt.pack(t) for t in (a, b, c)]
    assert torch.equal(whole.data.view(torch.uint8), again.data.view(torch.uint8))
    assert torch.equal(whole.scales[0], again.scales[0])
    stacked = torch.cat([p.data.view(torch.uint8) for p in parts])
    assert torch.equal(whole.data.view(torch.uint8), stacked)
    assert torch.equal(whole.scales[0], torch.cat([p.scales[0] for p in parts]))


def test_the_registry(name: str) -> None:
    assert isinstance(get_format(name), CLASS[name]) and FORMATS[name] is get_format(name)
    assert get_format(name).kernel_type == KERNEL_TYPE[name]
    assert list(FORMATS) == ["bf16", "fp8", "int8", "int4"]


@pytest.mark.parametrize(
    "bad",
    [torch.ones(4, 4, dtype=torch.int8), torch.ones(8), torch.ones(2, 3, 4)],
)
def test_only_floating_point_matrices_pack(name: str, bad: torch.Tensor) -> None:
    with pytest.raises(ValueError, match=f"{name} packs a floating-point matrix"):
        get_format(name).pack(bad)


@pytest.mark.parametrize(
    ("axis", "start", "size"), [("rows", 5, 3), ("cols", -1, 2), ("cols", 0, 14)]
)
def test_a_block_outside_the_matrix_is_refused(name: str, axis: str, start: int, size: int) -> None:
    fmt = get_format(name)
    m = fmt.pack(matrix(7, 13))
    cut = fmt.slice_rows if axis == "rows" else fmt.slice_cols
    with pytest.raises(
        ValueError, match=rf"{axis} \[{start}, {start + size}\) of a \[7, 13\] {name}"
    ):
        cut(m, start, size)
