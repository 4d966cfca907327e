"""LazyWeights: a matrix backed by its groups is made when read, once, and never before."""

from __future__ import annotations

import pytest
import torch

from monokernel.weights.group_quant import GroupQuant, quantize_rtn
from monokernel.weights.lazy_weights import DenseSource, LazyWeights, cast_mapping


def _gq(rows: int = 4, cols: int = 64, seed: int = 0) -> GroupQuant:
    g = torch.Generator().manual_seed(seed)
    return quantize_rtn(torch.randn(rows, cols, generator=g), 32)


def _weights() -> tuple[LazyWeights, GroupQuant]:
    gq = _gq()
    norm = torch.ones(64)
    return LazyWeights({"norm": norm, "layers.0.wq": DenseSource(gq)}), gq


def test_reading_makes_a_matrix_once(made: list[tuple[int, ...]]) -> None:
    w, gq = _weights()
    assert list(w) == ["norm", "layers.0.wq"] and len(w) == 2 and "layers.0.wq" in w
    assert w.shape("layers.0.wq") == torch.Size([4, 64]) and w.unread() == ["layers.0.wq"]
    assert made == []  # names, length, membership and shapes read nothing
    first = w["layers.0.wq"]
    assert torch.equal(first, gq.dense()) and first.dtype == torch.float32
    assert w["layers.0.wq"] is first  # kept, as a dict keeps it: the reference reads it often
    assert made == [(4, 64)] and w.unread() == []


def test_zero_point_form_is_the_source_of_the_values() -> None:
    # scale (q - zero) for an offset of -zero scale: GGUF Q6_K's order of operations.
    q = torch.randint(0, 64, (2, 32), dtype=torch.uint8)
    scale = torch.tensor([[3.0e-3], [7.1e-4]])
    gq = GroupQuant(q, scale, scale * -32.0, 32, 8)
    want = (q.float() - 32.0) * scale
    got = LazyWeights({"w": DenseSource(gq, zero=32)})["w"]
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_cast_keeps_unread_matrices_unread(made: list[tuple[int, ...]]) -> None:
    w, gq = _weights()
    half = w.cast(torch.bfloat16)  # the monokernel's bf16 copy (not consuming)
    assert w.unread() == half.unread() == ["layers.0.wq"] and len(w) == 2
    assert half["norm"].dtype == torch.bfloat16 and made == []
    assert torch.equal(half["layers.0.wq"], gq.dense().to(torch.bfloat16))
    assert half["layers.0.wq"].dtype == torch.bfloat16 and made == [(4, 64)]
    assert w.unread() == ["layers.0.wq"]  # the copy made its own


def test_cast_mapping_consumes_as_cast_weights_does(made: list[tuple[int, ...]]) -> None:
    w, _ = _weights()
    out = cast_mapping(w, torch.bfloat16, "cpu", consume=True)
    assert isinstance(out, LazyWeights) and len(w) == 0 and out.unread() == ["layers.0.wq"]
    plain = {"a": torch.ones(2), "b": torch.zeros(3)}
    cast = cast_mapping(plain, torch.float64, consume=True)
    assert plain == {} and type(cast) is dict and cast["b"].dtype == torch.float64
    assert made == []


def test_deleting_and_clearing_read_nothing(made: list[tuple[int, ...]]) -> None:
    w, _ = _weights()
    copy = w.copy()
    del w["layers.0.wq"]  # repack's consume deletes each layer's names once packed
    assert list(w) == ["norm"] and copy.unread() == ["layers.0.wq"]
    copy.clear()  # MutableMapping's own clear would pop, reading each entry
    assert len(copy) == 0 and made == []
    w["x"] = torch.ones(1)
    assert w.pop("x").shape == (1,) and "x" not in w


def test_a_source_stands_in_for_its_tensor_in_to() -> None:
    src = DenseSource(_gq())
    moved = src.to(device="cpu", dtype=torch.float16)
    assert (moved.dtype, moved.device, moved.gq) == (torch.float16, torch.device("cpu"), src.gq)
    assert src.to().dtype == torch.float32 and src.to().device is None
    assert moved.dense().dtype == torch.float16


def test_widens_says_which_casts_round_nothing() -> None:
    from monokernel.weights.lazy_weights import widens

    f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
    assert widens(bf16, f32) and widens(f16, f32) and widens(f32, f64) and widens(bf16, bf16)
    assert not widens(f32, bf16) and not widens(bf16, f16) and not widens(f16, bf16)
    assert not widens(torch.int32, f32)


@pytest.mark.parametrize(
    "casts",
    [
        (torch.bfloat16, torch.float32),  # a GPU's bf16 load, read on the CPU in float32
        (torch.float16, torch.bfloat16),
        (torch.bfloat16, torch.float32, torch.float16),
        (torch.float32, torch.bfloat16, torch.bfloat16),
        (torch.float64, torch.float32),
    ],
)
def test_a_source_cast_twice_rounds_as_its_tensor_would(casts: tuple[torch.dtype, ...]) -> None:
    # Offsets that no bf16 or fp16 holds, so a rounding left out shows.
    gq = _gq(8, 64, seed=3)
    want, src = gq.dense(), DenseSource(gq)
    for dtype in casts:
        want, src = want.to(dtype), src.to(dtype=dtype)
    got = LazyWeights({"w": src})["w"]
    assert got.dtype == want.dtype == casts[-1]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # And the first cast alone would not have given those bits: the test sees a lost rounding.
    if casts[:2] == (torch.bfloat16, torch.float32):
        assert not torch.equal(got, gq.dense().to(casts[-1]))
