"""GGUF's 5-, 6- and 8-bit blocks as 8-bit GroupQuants: each value as the gguf package's own
dequantisation gives it, and one width for a file that mixes them with 4-bit blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from monokernel.weights.gguf_8bit import (
    GGUF_8BIT_BLOCK_BYTES,
    GGUF_8BIT_GROUP,
    from_gguf_8bit,
    uniform_groups,
)
from monokernel.weights.group_quant import GroupQuant, GroupQuantError, quantize_rtn

gguf = pytest.importorskip("gguf")


def _f16(v: float) -> np.ndarray:
    return np.array([v], dtype=np.float16).view(np.uint8)


def random_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Stored bytes of a [rows, cols] ``kind`` tensor: random quants and scales, finite fp16
    fields (d, dmin, m) of either sign where the format has a sign."""
    qt = getattr(gguf.GGMLQuantizationType, kind)
    per, size = gguf.GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // per, size), dtype=np.uint8)
    d = lambda: _f16(float(rng.uniform(-0.02, 0.02)))  # noqa: E731
    for b in raw:
        if kind in ("Q8_0", "Q5_0"):
            b[0:2] = d()
        elif kind == "Q5_1":
            b[0:2], b[2:4] = d(), d()
        elif kind == "Q6_K":
            b[208:210] = d()
        else:  # Q5_K: d and dmin
            b[0:2], b[2:4] = _f16(abs(float(rng.uniform(0, 0.02)))), d()
    return raw.reshape(-1)


@pytest.mark.parametrize("kind", sorted(GGUF_8BIT_BLOCK_BYTES))
@pytest.mark.parametrize(("rows", "cols"), [(3, 256), (5, 512)])
def test_each_value_is_ggufs_own(kind: str, rows: int, cols: int) -> None:
    raw = random_blocks(kind, rows, cols, seed=rows + cols)
    qt = getattr(gguf.GGMLQuantizationType, kind)
    want = gguf.quants.dequantize(raw, qt).reshape(rows, cols).astype(np.float32)
    gq = from_gguf_8bit(torch.from_numpy(raw.copy()), kind, (rows, cols))
    assert gq.bits == 8 and gq.group == GGUF_8BIT_GROUP[kind] and gq.shape == (rows, cols)
    gq.check()
    got = gq.dense().numpy()
    # a u + b, a and b exact products of fp16 values and small integers: ggml's own value,
    # up to one float32 rounding where ggml rounds a product of three (Q6_K: d sc (q - 32)).
    np.testing.assert_allclose(got, want, rtol=2**-22, atol=0)
    top = {"Q8_0": 255, "Q6_K": 63}.get(kind, 31)
    assert int(gq.q.max()) <= top


def test_bad_blocks_are_refused_naming_the_sizes() -> None:
    with pytest.raises(GroupQuantError, match="Q4_1"):
        from_gguf_8bit(torch.zeros(20, dtype=torch.uint8), "Q4_1", (1, 32))
    with pytest.raises(GroupQuantError, match="columns in 256s"):
        from_gguf_8bit(torch.zeros(210, dtype=torch.uint8), "Q6_K", (2, 128))
    with pytest.raises(GroupQuantError, match="takes 68 bytes"):
        from_gguf_8bit(torch.zeros(34, dtype=torch.uint8), "Q8_0", (2, 32))


def _gq4(rows: int, cols: int, group: int, seed: int) -> GroupQuant:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    return quantize_rtn(w, group)


def test_one_width_for_a_mixed_file() -> None:
    four = {"a": _gq4(4, 256, 32, 0), "b": _gq4(4, 256, 32, 1)}
    assert uniform_groups(four) == four  # all 4 bits in one group: as they are
    raw = random_blocks("Q6_K", 4, 256, seed=2)
    mixed = {**four, "c": from_gguf_8bit(torch.from_numpy(raw), "Q6_K", (4, 256))}
    out = uniform_groups(mixed)
    assert {(g.bits, g.group) for g in out.values()} == {(8, 16)}
    for k, g in mixed.items():
        assert torch.equal(out[k].dense(), g.dense()), k  # the same values
        assert torch.equal(out[k].q, g.q), k
    # 4-bit groups of 128 and 32 side by side: 8 bits in groups of 32.
    two = uniform_groups({"a": _gq4(4, 256, 128, 3), "b": _gq4(4, 256, 32, 4)})
    assert {(g.bits, g.group) for g in two.values()} == {(8, 32)}


def test_group_quant_widths() -> None:
    gq = _gq4(4, 64, 32, 5)
    wide = gq.widened(16)
    assert (wide.bits, wide.group) == (8, 16) and torch.equal(wide.dense(), gq.dense())
    with pytest.raises(GroupQuantError, match="do not split"):
        gq.widened(64)
    q = torch.full((2, 16), 200, dtype=torch.uint8)
    ones = torch.ones(2, 1)
    GroupQuant(q, ones, ones, 16, 8).check()
    with pytest.raises(GroupQuantError, match=r"0\.\.15"):
        GroupQuant(q.repeat(1, 2), ones, ones, 32).check()
    with pytest.raises(GroupQuantError, match="multiple of 32"):
        GroupQuant(q, ones, ones, 16)  # 4 bits: groups of 32 at least
    with pytest.raises(GroupQuantError, match="bits"):
        GroupQuant(q, ones, ones, 16, 6)
