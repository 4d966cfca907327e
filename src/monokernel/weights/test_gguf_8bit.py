"""GGUF's 5-, 6- and 8-bit blocks as 8-bit GroupQuants: each value as the gguf package's own
dequantisation gives it, and one width for a file that mixes them with 4-bit blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from monokernel.models.config import ModelConfig
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


def test_one_width_a_stage_for_a_mixed_file() -> None:
    four = {f"layers.0.{m}": _gq4(4, 256, 32, i) for i, m in enumerate(("wq", "wv", "wo"))}
    assert uniform_groups(four) == four  # all 4 bits in one group: as they are
    q6 = from_gguf_8bit(torch.from_numpy(random_blocks("Q6_K", 4, 256, seed=2)), "Q6_K", (4, 256))
    # A Q4_K_M: V and the down projection in Q6_K. The whole QKV stage and the down
    # projection go to 8 bits in groups of 16; the O projection stays as it is.
    mixed = {**four, "layers.0.wv": q6, "layers.0.w_down": q6}
    out = uniform_groups(mixed)
    widths = {k.rsplit(".", 1)[1]: (g.bits, g.group) for k, g in out.items()}
    assert widths == {"wq": (8, 16), "wv": (8, 16), "w_down": (8, 16), "wo": (4, 32)}
    for k, g in mixed.items():
        assert torch.equal(out[k].dense(), g.dense()) and torch.equal(out[k].q, g.q), k
    # 4-bit groups of 128 and 32 in one stage: 8 bits in groups of 32.
    two = uniform_groups(
        {"layers.0.wo": _gq4(4, 256, 128, 3), "layers.0.w_up": _gq4(4, 256, 32, 4)}
    )
    assert {(g.bits, g.group) for g in two.values()} == {(8, 32)}


def test_groups_plan_streams_a_stage_in_its_own_width_where_int4_is_tiled() -> None:
    from monokernel.models.shapes import SHAPES
    from monokernel.weights.quantize import GroupsPlan, groups_plan

    def model(cfg: ModelConfig, down_bits: int) -> dict[str, GroupQuant]:
        g: dict[str, GroupQuant] = {}
        h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        shapes = {"wq": (q, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, q),
                  "w_gate": (i, h), "w_up": (i, h), "w_down": (h, i)}  # fmt: skip
        for m, (r, c) in shapes.items():
            eight = m == "wv" or (m == "w_down" and down_bits == 8)
            qq = torch.zeros(r, c, dtype=torch.uint8)
            ones = torch.ones(r, c // (16 if eight else 32))
            g[f"layers.0.{m}"] = GroupQuant(qq, ones, ones, 16 if eight else 32, 8 if eight else 4)
        return uniform_groups(g)

    big = SHAPES["llama-3.1-8b"]  # int4 in tiles
    plan, groups = groups_plan(big, model(big, 8))
    assert plan == GroupsPlan(("int4", 32), ("int8", 16), ("int8", 16))
    plan, _ = groups_plan(big, model(big, 4))
    assert plan == GroupsPlan(("int4", 32), ("int8", 16), ("", 0))
    eights = {k: g.widened(g.group) if g.bits == 4 else g for k, g in model(big, 8).items()}
    plan, _ = groups_plan(big, eights)  # a Q5_K_M: int8 groups of 32 beside 16s
    assert plan == GroupsPlan(("int8", 32), ("int8", 16), ("int8", 16))
    small = SHAPES["smollm2-135m"]  # int4 in rows: everything in int8 groups of 16
    plan, groups = groups_plan(small, model(small, 8))
    assert plan == GroupsPlan(("int8", 16))
    assert {(g.bits, g.group) for g in groups.values()} == {(8, 16)}


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
