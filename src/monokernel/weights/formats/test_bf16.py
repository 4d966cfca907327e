"""The bf16 weight format against plain PyTorch on the dense matrix, and the registry."""

from __future__ import annotations

import pytest
import torch

from monokernel.weights.formats import (
    DEFAULT_FORMAT,
    FORMATS,
    UnknownWeightFormatError,
    get_format,
)
from monokernel.weights.formats.bf16 import Bf16

SIZES = [(1, 1), (7, 13), (33, 5), (3, 130)]  # odd rows, odd columns, a row of one element

BF16 = get_format("bf16")


def _matrix(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g).to(dtype)


@pytest.mark.parametrize(("rows", "cols"), SIZES)
def test_a_bf16_matrix_packs_as_itself(rows: int, cols: int) -> None:
    w = _matrix(rows, cols, torch.bfloat16)
    m = BF16.pack(w)
    assert (m.format, m.shape, m.scales) == ("bf16", (rows, cols), ())
    assert m.data is w and BF16.dense(m) is w  # in place: no copy for repack nor prefill
    assert BF16.packs_in_place


@pytest.mark.parametrize(("rows", "cols"), SIZES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.float32])
def test_other_dtypes_round_to_bf16_and_float32_stays(
    rows: int, cols: int, dtype: torch.dtype
) -> None:
    w = _matrix(rows, cols, dtype, seed=1)
    dense = BF16.dense(BF16.pack(w))
    want = w if dtype == torch.float32 else w.to(torch.bfloat16)
    assert dense.dtype == want.dtype and dense.shape == (rows, cols)
    assert torch.equal(dense, want)


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float32])
def test_dense_in_a_dtype_copies_only_to_change_it(stored: torch.dtype) -> None:
    m = BF16.pack(_matrix(7, 13, stored, seed=5))
    assert BF16.dense(m, None) is m.data and BF16.dense(m, stored) is m.data
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        assert torch.equal(BF16.dense(m, dtype), m.data.to(dtype))


def test_a_strided_matrix_is_packed_contiguous() -> None:
    w = _matrix(9, 14, torch.bfloat16)
    m = BF16.pack(w.t())  # [14, 9], columns contiguous
    assert m.data.is_contiguous() and m.shape == (14, 9)
    assert torch.equal(BF16.dense(m), w.t())


@pytest.mark.parametrize("bad", [torch.ones(4, 4, dtype=torch.int8), torch.ones(8)])
def test_only_floating_point_matrices_pack(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="floating-point matrix"):
        BF16.pack(bad)


@pytest.mark.parametrize(("rows", "cols"), SIZES)
def test_bytes_are_what_the_packed_tensors_hold(rows: int, cols: int) -> None:
    m = BF16.pack(_matrix(rows, cols, torch.float16))
    assert BF16.matrix_bytes(rows, cols) == m.data.nbytes == 2 * rows * cols


@pytest.mark.parametrize(("rows", "cols"), [(7, 13), (33, 5), (3, 130)])
def test_row_and_column_blocks_are_the_dense_slices(rows: int, cols: int) -> None:
    w = _matrix(rows, cols, torch.bfloat16, seed=2)
    m = BF16.pack(w)
    for start, size in ((0, 1), (1, rows - 1), (rows // 2, rows - rows // 2), (rows, 0)):
        block = BF16.slice_rows(m, start, size)
        assert block.shape == (size, cols)
        assert torch.equal(BF16.dense(block), w[start : start + size])
        assert size == 0 or block.data.data_ptr() == w[start].data_ptr()  # a view
    for start, size in ((0, 1), (2, cols - 2), (cols - 1, 1)):
        block = BF16.slice_cols(m, start, size)
        assert block.shape == (rows, size) and block.data.is_contiguous()
        assert torch.equal(BF16.dense(block), w[:, start : start + size])


def test_column_blocks_of_ranks_sum_to_the_product() -> None:
    """What tensor parallelism relies on: row blocks stack back to W, and the partial
    products of the column blocks sum to W x."""
    w, x = _matrix(12, 30, torch.float32, seed=3), _matrix(30, 1, torch.float32, seed=4)
    m, tp = BF16.pack(w), 3
    rows = [BF16.dense(BF16.slice_rows(m, r * 4, 4)) for r in range(tp)]
    assert torch.equal(torch.cat(rows), w)
    partial = [
        BF16.dense(BF16.slice_cols(m, r * 10, 10)) @ x[r * 10 : r * 10 + 10] for r in range(tp)
    ]
    torch.testing.assert_close(sum(partial), w @ x)


@pytest.mark.parametrize(
    ("axis", "start", "size"), [("rows", 5, 3), ("cols", -1, 2), ("cols", 0, 14)]
)
def test_a_block_outside_the_matrix_is_refused(axis: str, start: int, size: int) -> None:
    m = BF16.pack(_matrix(7, 13, torch.bfloat16))
    cut = BF16.slice_rows if axis == "rows" else BF16.slice_cols
    with pytest.raises(ValueError, match=rf"{axis} \[{start}, {start + size}\) of a \[7, 13\]"):
        cut(m, start, size)


def test_the_registry() -> None:
    assert DEFAULT_FORMAT == "bf16" and isinstance(get_format("bf16"), Bf16)
    assert get_format("bf16").kernel_type == "Bf16Rows"
    assert "bf16" in FORMATS


@pytest.mark.parametrize("name", ["fp4", "BF16", "FP8", ""])
def test_an_unknown_format_names_the_accepted_ones(name: str) -> None:
    with pytest.raises(UnknownWeightFormatError) as e:
        get_format(name)
    assert isinstance(e.value, ValueError)
    assert (
        str(e.value) == f"unknown weight format {name!r}; accepted formats: bf16, fp8, int8, int4"
    )
