"""GroupQuant: each 4-bit source decoded to the same bits, checked against packings written
here apart from the decoders (loops over words and nibbles), and the row operations and
the round-to-nearest quantiser."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from monokernel.weights import group_quant, repack
from monokernel.weights.gguf_loader import _dequantize_blocks
from monokernel.weights.group_quant import (
    _ANCHORS,
    _REFITS,
    _SHRINKS,
    GroupQuant,
    GroupQuantError,
    from_awq,
    from_gguf_blocks,
    from_gptq,
    fuse_rows,
    interleave_rows,
    permute_rows,
    pick_group,
    quantize_rtn,
)
from monokernel.weights.quantize import UnsupportedQuantizationError

# --------------------------------------------------------------------------- helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns, with -0.0 counted as +0.0 (adding +0.0 turns one into the
    other and changes nothing else)."""
    return (t + 0.0).view(torch.int32)


def word(nibbles: list[int]) -> int:
    """One int32 holding ``nibbles[i]`` in bits 4i..4i+3, as a signed value."""
    value = 0
    for i, n in enumerate(nibbles):
        assert 0 <= n <= 15
        value |= n << (4 * i)
    return value - (1 << 32) if value >= 1 << 31 else value


def random_case(
    out: int, cols: int, group: int, seed: int, zmin: int = 0, zmax: int = 15
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [out, cols] 0..15, zeros [out, cols/group] in zmin..zmax, fp16 scales of mixed
    sign and size [out, cols/group]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out, cols), generator=g)
    z = torch.randint(zmin, zmax + 1, (out, cols // group), generator=g)
    s = (torch.randn(out, cols // group, generator=g) * 0.02).to(torch.float16)
    return q, z, s


def expected_dense(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group: int) -> torch.Tensor:
    """s * (q - z) in float64, exact there, then float32 (where it is exact too)."""
    s64 = s.double().repeat_interleave(group, dim=1)
    z64 = z.double().repeat_interleave(group, dim=1)
    return (s64 * (q.double() - z64)).float()


def assert_decoded(
    gq: GroupQuant, q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group: int
) -> None:
    assert gq.group == group and gq.shape == tuple(q.shape)
    assert gq.q.dtype == torch.uint8 and torch.equal(gq.q, q.to(torch.uint8))
    assert torch.equal(gq.scale, s.float())
    assert torch.equal(gq.offset, (-z.double() * s.double()).float())
    assert torch.equal(bits(gq.dense()), bits(expected_dense(q, z, s, group)))
    assert gq.check() is gq


# --------------------------------------------------------------------------- GGUF


def gguf_raw(rows: int, cols: int, kind: str, seed: int) -> torch.Tensor:
    """Random Q4_0/Q4_1 blocks: fp16 d (some zero, some negative), m, random quant bytes."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 32
    d = (rng.standard_normal(n) * rng.uniform(1e-4, 2, n)).astype(np.float16)
    d[::7] = 0.0
    parts = [d.view(np.uint8).reshape(n, 2)]
    if kind == "Q4_1":
        m = (rng.standard_normal(n) * 3).astype(np.float16)
        parts.append(m.view(np.uint8).reshape(n, 2))
    parts.append(rng.integers(0, 256, (n, 16), dtype=np.uint8))
    return torch.from_numpy(np.concatenate(parts, axis=1).reshape(-1).copy())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (13, 64), (3, 576)])
def test_gguf_blocks_give_the_loaders_floats(kind: str, shape: tuple[int, int]) -> None:
    raw = gguf_raw(*shape, kind, seed=shape[0] * 1000 + shape[1])
    gq = from_gguf_blocks(raw, kind, shape)
    want = _dequantize_blocks(raw.clone(), kind, shape)
    assert gq.dense().dtype == torch.float32
    assert torch.equal(bits(gq.dense()), bits(want))
    assert gq.check() is gq and gq.group == 32


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_blocks_decoded_weight_by_weight(kind: str) -> None:
    rows, cols = 3, 64
    raw = gguf_raw(rows, cols, kind, seed=3)
    gq = from_gguf_blocks(raw, kind, (rows, cols))
    size = 18 if kind == "Q4_0" else 20
    data = raw.numpy().tobytes()
    for r in range(rows):
        for c in range(cols):
            b = (r * cols + c) // 32
            block = data[b * size : (b + 1) * size]
            d = float(np.frombuffer(block[0:2], np.float16)[0])
            qs = block[size - 16 :]
            j = c % 32
            q = qs[j] & 0x0F if j < 16 else qs[j - 16] >> 4
            offset = -8.0 * d if kind == "Q4_0" else float(np.frombuffer(block[2:4], np.float16)[0])
            assert int(gq.q[r, c]) == q
            assert float(gq.scale[r, c // 32]) == d
            assert float(gq.offset[r, c // 32]) == offset


def test_gguf_blocks_of_a_real_quantiser() -> None:
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(1)
    a = rng.standard_normal((5, 128)).astype(np.float32)
    a[1] = np.abs(a[1])
    for qtype in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1):
        raw = torch.from_numpy(np.array(gguf.quants.quantize(a, qtype)).reshape(-1))
        gq = from_gguf_blocks(raw, qtype.name, a.shape)
        want = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype).reshape(a.shape))
        assert torch.equal(bits(gq.dense()), bits(want.float()))
        assert (gq.dense() - torch.from_numpy(a)).abs().max() < 0.4


@pytest.mark.parametrize("shape", [(1, 256), (3, 768), (5, 512)])
def test_q4_k_blocks_are_ggufs_dequantisation(shape: tuple[int, int]) -> None:
    """Q4_K (8 sub-blocks of 32 a block of 256, 6-bit scales and mins): each sub-block is a
    group of 32 whose dense() is gguf's own dequantisation bit for bit."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(shape[1] + shape[0])
    n = shape[0] * shape[1] // 256
    d = (rng.standard_normal(n) * 1e-2).astype(np.float16).view(np.uint8).reshape(n, 2)
    dmin = (rng.random(n) * 1e-2).astype(np.float16).view(np.uint8).reshape(n, 2)
    raw = np.concatenate((d, dmin, rng.integers(0, 256, (n, 140), dtype=np.uint8)), axis=1)
    gq = from_gguf_blocks(torch.from_numpy(raw.reshape(-1).copy()), "Q4_K", shape)
    want = gguf.quants.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType.Q4_K)
    assert gq.group == 32 and gq.scale.shape == (shape[0], shape[1] // 32)
    assert torch.equal(bits(gq.dense()), bits(torch.from_numpy(want.reshape(shape)).float()))


def test_gguf_blocks_refusals() -> None:
    raw = gguf_raw(2, 64, "Q4_1", seed=0)
    with pytest.raises(GroupQuantError, match="not 4-bit"):
        from_gguf_blocks(raw, "Q8_0", (2, 64))
    with pytest.raises(GroupQuantError, match="takes 80 bytes"):
        from_gguf_blocks(raw[:-1], "Q4_1", (2, 64))
    with pytest.raises(GroupQuantError, match="columns in 32s"):
        from_gguf_blocks(raw, "Q4_1", (4, 40))
    with pytest.raises(GroupQuantError, match="columns in 256s"):
        from_gguf_blocks(raw, "Q4_K", (1, 128))


# --------------------------------------------------------------------------- AWQ


AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack: nibble i <- column order[i]


def pack_awq(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """AutoAWQ's WQLinear_GEMM tensors for q [out, in], z/s [out, in/group], word by word."""
    out = q.shape[0]
    qt, zt = q.t().tolist(), z.t().tolist()  # AWQ stores [in, out]

    def pack(rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor(
            [
                [word([r[8 * c + AWQ_PACK_ORDER[i]] for i in range(8)]) for c in range(out // 8)]
                for r in rows
            ],
            dtype=torch.int32,
        )

    return pack(qt), pack(zt), s.t().contiguous()


@pytest.mark.parametrize(
    ("out", "cols", "group"), [(8, 32, 32), (24, 96, 32), (40, 256, 128), (104, 192, 64)]
)
def test_awq(out: int, cols: int, group: int) -> None:
    q, z, s = random_case(out, cols, group, seed=out + cols)
    qweight, qzeros, scales = pack_awq(q, z, s)
    assert qweight.shape == (cols, out // 8) and qzeros.shape == (cols // group, out // 8)
    assert_decoded(from_awq(qweight, qzeros, scales, group), q, z, s, group)


def test_awq_nibble_order_of_one_word() -> None:
    # Nibble i holds the value i: AutoAWQ put column order[i] there, so columns 0..7 read
    # 0, 4, 1, 5, 2, 6, 3, 7.
    qweight = torch.full((32, 1), word(list(range(8))), dtype=torch.int32)
    qzeros = torch.zeros(1, 1, dtype=torch.int32)
    gq = from_awq(qweight, qzeros, torch.ones(1, 8, dtype=torch.float16), 32)
    assert gq.q[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_awq_refusals() -> None:
    q, z, s = random_case(16, 64, 32, seed=0)
    qweight, qzeros, scales = pack_awq(q, z, s)
    with pytest.raises(GroupQuantError, match="multiple of 32 dividing the input size 64"):
        from_awq(qweight, qzeros, scales, 48)
    with pytest.raises(GroupQuantError, match=r"qzeros must have shape \(2, 2\)"):
        from_awq(qweight, qzeros[:1], scales, 32)
    with pytest.raises(GroupQuantError, match="scales must be floating point"):
        from_awq(qweight, qzeros, scales[:, :8], 32)
    with pytest.raises(GroupQuantError, match="must be int32"):
        from_awq(qweight.long(), qzeros, scales, 32)


# --------------------------------------------------------------------------- GPTQ


def pack_gptq(
    q: torch.Tensor, zstored: torch.Tensor, s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoGPTQ's QuantLinear tensors for q [out, in], stored zeros / s [out, in/group]:
    qweight [in/8, out] (input rows 8k..8k+7 in a word), qzeros [in/group, out/8]."""
    out, cols = q.shape
    qt, zt = q.t().tolist(), zstored.t().tolist()
    qweight = torch.tensor(
        [
            [word([qt[8 * k + i][o] for i in range(8)]) for o in range(out)]
            for k in range(cols // 8)
        ],
        dtype=torch.int32,
    )
    qzeros = torch.tensor(
        [[word([r[8 * c + j] for j in range(8)]) for c in range(out // 8)] for r in zt],
        dtype=torch.int32,
    )
    return qweight, qzeros, s.t().contiguous()


def trivial_g_idx(cols: int, group: int) -> torch.Tensor:
    return torch.tensor([c // group for c in range(cols)], dtype=torch.int32)


@pytest.mark.parametrize(("out", "cols", "group"), [(8, 32, 32), (24, 96, 32), (40, 256, 128)])
def test_gptq_asymmetric_v1_stores_zero_minus_one(out: int, cols: int, group: int) -> None:
    # v1 cannot store a zero point of 0 (AutoGPTQ's -1 would spill into the next nibble):
    # its zero points are 1..16.
    q, z, s = random_case(out, cols, group, seed=cols, zmin=1, zmax=16)
    qweight, qzeros, scales = pack_gptq(q, z - 1, s)
    for g_idx in (None, trivial_g_idx(cols, group)):
        gq = from_gptq(qweight, qzeros, scales, g_idx, group, sym=False)
        assert_decoded(gq, q, z, s, group)


def test_gptq_asymmetric_v2_stores_the_zero() -> None:
    q, z, s = random_case(16, 128, 64, seed=9)
    qweight, qzeros, scales = pack_gptq(q, z, s)
    gq = from_gptq(qweight, qzeros, scales, None, 64, sym=False, checkpoint_format="gptq_v2")
    assert_decoded(gq, q, z, s, 64)


@pytest.mark.parametrize(("fmt", "stored"), [("gptq", 7), ("gptq_v2", 8)])
def test_gptq_symmetric_zero_is_eight(fmt: str, stored: int) -> None:
    q, _, s = random_case(24, 64, 32, seed=4)
    z = torch.full_like(s, 8, dtype=torch.long)
    qweight, qzeros, scales = pack_gptq(q, torch.full_like(z, stored), s)
    gq = from_gptq(
        qweight, qzeros, scales, trivial_g_idx(64, 32), 32, sym=True, checkpoint_format=fmt
    )
    assert_decoded(gq, q, z, s, 32)


def test_gptq_group_minus_one_is_one_group_a_row() -> None:
    q, z, s = random_case(8, 96, 96, seed=2, zmin=1, zmax=16)
    qweight, qzeros, scales = pack_gptq(q, z - 1, s)
    gq = from_gptq(qweight, qzeros, scales, torch.zeros(96, dtype=torch.int32), -1, sym=False)
    assert_decoded(gq, q, z, s, 96)


def test_gptq_act_order_is_refused() -> None:
    q, z, s = random_case(8, 64, 32, seed=5, zmin=1)
    qweight, qzeros, scales = pack_gptq(q, z - 1, s)
    act_order = trivial_g_idx(64, 32)[
        torch.randperm(64, generator=torch.Generator().manual_seed(0))
    ]
    with pytest.raises(UnsupportedQuantizationError, match=r"act-order \(desc_act"):
        from_gptq(qweight, qzeros, scales, act_order, 32, sym=False)
    with pytest.raises(UnsupportedQuantizationError, match="'marlin' is not supported"):
        from_gptq(qweight, qzeros, scales, None, 32, sym=False, checkpoint_format="marlin")


def test_gptq_bit_layout_of_one_word() -> None:
    # Input rows 8k + i sit in nibble i of qweight[k]: a word 0x76543210 is rows valued 0..7.
    qweight = torch.full((4, 8), word(list(range(8))), dtype=torch.int32)
    qzeros = torch.full((1, 1), word([0, 1, 2, 3, 4, 5, 6, 15]), dtype=torch.int32)
    gq = from_gptq(qweight, qzeros, torch.ones(1, 8, dtype=torch.float16), None, 32, sym=False)
    assert gq.q[0].tolist() == list(range(8)) * 4
    assert (-gq.offset[:, 0]).tolist() == [1, 2, 3, 4, 5, 6, 7, 16]


# --------------------------------------------------------------------------- row operations


def some(rows: int, cols: int, group: int, seed: int) -> GroupQuant:
    q, z, s = random_case(rows, cols, group, seed=seed)
    return GroupQuant(q.to(torch.uint8), s.float(), -(z * s.float()), group)


def test_row_operations_match_the_dense_ones() -> None:
    a, b, c = some(5, 64, 32, 1), some(5, 64, 32, 2), some(3, 64, 32, 3)
    fused = fuse_rows(a, b, c)
    assert torch.equal(fused.dense(), repack.fuse_rows(a.dense(), b.dense(), c.dense()))
    mixed = interleave_rows(a, b)
    assert torch.equal(mixed.dense(), repack.interleave_rows(a.dense(), b.dense()))
    assert mixed.q[2].tolist() == a.q[1].tolist() and mixed.q[3].tolist() == b.q[1].tolist()
    index = torch.tensor([4, 0, 3, 1, 2])
    assert torch.equal(permute_rows(a, index).dense(), a.dense()[index])
    for g in (fused, mixed):
        assert g.q.is_contiguous() and g.scale.is_contiguous() and g.offset.is_contiguous()


def test_row_operations_refuse_mismatches() -> None:
    a = some(4, 64, 32, 1)
    with pytest.raises(
        GroupQuantError, match="groups of 64 onto rows of 64 columns in groups of 32"
    ):
        fuse_rows(a, some(4, 64, 64, 2))
    with pytest.raises(GroupQuantError, match="cannot interleave"):
        interleave_rows(a, some(3, 64, 32, 2))
    with pytest.raises(GroupQuantError, match="out of range"):
        permute_rows(a, torch.tensor([0, 4]))


def test_dense_in_another_dtype_rounds_the_float32_values() -> None:
    a = some(6, 96, 32, 7)
    assert torch.equal(a.dense(torch.bfloat16), a.dense().bfloat16())


def test_construction_and_check_refuse_bad_tensors() -> None:
    q = torch.zeros(4, 64, dtype=torch.uint8)
    s = torch.ones(4, 2)
    with pytest.raises(GroupQuantError, match="uint8"):
        GroupQuant(q.int(), s, s, 32)
    with pytest.raises(GroupQuantError, match="multiple of 32 dividing the 64 columns"):
        GroupQuant(q, torch.ones(4, 4), torch.ones(4, 4), 16)
    with pytest.raises(GroupQuantError, match=r"offset must be float32 \(4, 2\)"):
        GroupQuant(q, s, s.double(), 32)
    with pytest.raises(GroupQuantError, match=r"scale must be float32 \(4, 2\)"):
        GroupQuant(q, torch.ones(4, 1), s, 32)
    with pytest.raises(GroupQuantError, match=r"0\.\.15; found 16"):
        GroupQuant(q + 16, s, s, 32).check()
    with pytest.raises(GroupQuantError, match="non-finite scale"):
        GroupQuant(q, s / 0.0, s, 32).check()


# --------------------------------------------------------------------------- quantize_rtn


def group_errors(gq: GroupQuant, w: torch.Tensor) -> torch.Tensor:
    """Each group's squared error sum (dense - w)^2, in float64 [rows, groups]."""
    d = gq.dense().double() - w.double()
    return (d * d).view(gq.rows, -1, gq.group).sum(dim=2)


def minmax_errors(w: torch.Tensor, group: int) -> torch.Tensor:
    """Each group's squared error under plain min/max rounding (scale = range / 15, offset
    = min, nearest step), in float64 [rows, groups]."""
    x = w.double().view(w.shape[0], -1, group)
    lo, hi = x.amin(dim=2, keepdim=True), x.amax(dim=2, keepdim=True)
    s = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(lo))
    d = ((x - lo) / s).round().clamp(0, 15) * s + lo - x
    return (d * d).sum(dim=2)


def reference_search(v: torch.Tensor) -> float:
    """The least squared error the search reaches on one group v, written apart from
    quantize_rtn's: in float64, from the weights themselves (no closed forms), one group
    and one start at a time."""
    lo, hi = float(v.min()), float(v.max())
    span = hi - lo
    if span == 0:
        return 0.0

    def nearest(scale: float, offset: float) -> torch.Tensor:
        return ((v - offset) / scale).round().clamp(0, 15)

    best = (float("inf"), 0.0, 0.0)
    starts = [(1.0, 0.0)] + [(f, a) for f in _SHRINKS for a in _ANCHORS]
    for f, a in starts:
        scale = f * span / 15
        offset = lo + (span - f * span) * (1 + a) / 2
        for _ in range(_REFITS):
            q = nearest(scale, offset)
            if q.min() < q.max():
                # Least squares v ~ scale * q + offset, as numpy's polyfit gives it.
                scale, offset = (float(c) for c in np.polyfit(q.numpy(), v.numpy(), 1))
            best = min(best, (float(((scale * q + offset - v) ** 2).sum()), scale, offset))
    _, scale, offset = best
    return float(((scale * nearest(scale, offset) + offset - v) ** 2).sum())


def q4_1_like(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Weights as a GGUF Q4_1 file holds them: each block of 32 on its own 16-step grid (a
    random scale and min), the quants bell-shaped around the middle."""
    g = torch.Generator().manual_seed(seed)
    blocks = rows * cols // 32
    d = torch.rand(blocks, 1, generator=g) * 0.01 + 0.002
    m = -7.5 * d * (1 + 0.3 * torch.randn(blocks, 1, generator=g))
    q = (torch.randn(blocks, 32, generator=g) * 3 + 7.5).round().clamp(0, 15)
    q[:, 0], q[:, 1] = 0, 15  # each block uses its whole grid
    return (d * q + m).reshape(rows, cols)


@pytest.mark.parametrize(("rows", "cols", "group"), [(1, 576, 64), (3, 96, 32), (33, 384, 128)])
def test_rtn_never_loses_to_min_max_rounding(rows: int, cols: int, group: int) -> None:
    torch.manual_seed(rows)
    w = torch.randn(rows, cols) * torch.rand(rows, 1) * 3
    w[:, 5] = 0.0
    w[0, : group // 2] += 4.0  # a lopsided group
    gq = quantize_rtn(w, group)
    assert gq.group == group and gq.shape == (rows, cols) and gq.check() is gq
    assert gq.q.dtype == torch.uint8 and int(gq.q.max()) <= 15
    ours, minmax = group_errors(gq, w), minmax_errors(w, group)
    assert bool((ours <= minmax * (1 + 1e-5)).all())
    # And by more than a little: the search's point.
    assert float(ours.sum()) < 0.9 * float(minmax.sum())


def test_rtn_rounds_each_weight_to_its_nearest_step() -> None:
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    gq = quantize_rtn(w, 64)
    steps = torch.arange(16, dtype=torch.float64)
    s = gq.scale.double().repeat_interleave(64, dim=1)[..., None]
    o = gq.offset.double().repeat_interleave(64, dim=1)[..., None]
    dist = (steps * s + o - w.double()[..., None]).abs()  # [16, 256, 16 steps]
    chosen = dist.gather(2, gq.q.long()[..., None])[..., 0]
    assert bool((chosen <= dist.amin(dim=2) + 1e-6 * s[..., 0]).all())


def test_rtn_reaches_the_references_error() -> None:
    """The vectorised search against a per-group float64 one (reference_search): the same
    error, up to float32 flipping a rounding on the way in a rare group."""
    w = torch.cat((q4_1_like(6, 256, seed=2), torch.randn(6, 256) * 0.02))
    ours = group_errors(quantize_rtn(w, 64), w).view(-1)
    ref = torch.tensor([reference_search(v) for v in w.double().view(-1, 64)])
    close = (ours - ref).abs() <= 1e-4 * ref + 1e-12
    assert float(close.double().mean()) >= 0.95
    assert abs(float(ours.sum()) / float(ref.sum()) - 1) < 1e-3


def test_rtn_on_4_bit_blocks() -> None:
    """Q4_1 blocks (the default model's): in groups of 32, each block's own grid, given
    back; in groups of 64, two blocks on one grid, well under min/max rounding's error."""
    w = q4_1_like(24, 576, seed=3)
    back = quantize_rtn(w, 32).dense()
    assert bool(((back - w).abs() <= 1e-6 * w.abs().amax()).all())
    ours, minmax = group_errors(quantize_rtn(w, 64), w), minmax_errors(w, 64)
    assert float(ours.sum()) < 0.8 * float(minmax.sum())


def test_rtn_is_deterministic_in_dtype_and_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(40, 384, generator=torch.Generator().manual_seed(4)).bfloat16()
    a, b = quantize_rtn(w, 128), quantize_rtn(w.float(), 128)  # bf16 widens exactly
    monkeypatch.setattr(group_quant, "_CHUNK", 3 * 384)  # 14 chunks, the last of 1 row
    c = quantize_rtn(w, 128)
    for x in (b, c):
        assert torch.equal(a.q, x.q) and torch.equal(bits(a.scale), bits(x.scale))
        assert torch.equal(bits(a.offset), bits(x.offset))


def test_rtn_constant_and_tiny_groups() -> None:
    tiny = torch.finfo(torch.float32).tiny
    w = torch.zeros(4, 64)
    w[1, 32:] = 2.5  # constant: offset 2.5 and q 0, exact, scale 2.5 / 15
    w[2, :32] = -1e-42  # constant and subnormal
    w[3, :32] = torch.linspace(0, 1e-37, 32)  # a range too small for a normal scale / 15
    w[3, 32:] = torch.linspace(-1, 1, 32)  # beside a plain one
    gq = quantize_rtn(w, 32)
    assert gq.check() is gq and bool((gq.scale >= tiny).all())
    assert gq.scale[0].tolist() == [1.0, 1.0] and bool((gq.dense()[0] == 0).all())
    assert float(gq.scale[1, 1]) == float(torch.tensor(2.5) / 15)
    assert bool((gq.q[1, 32:] == 0).all()) and float(gq.offset[1, 1]) == 2.5
    assert bool((gq.dense()[1, 32:] == 2.5).all()) and bool((gq.dense()[2, :32] == -1e-42).all())
    assert float(gq.scale[3, 0]) == tiny
    assert bool(((gq.dense()[3, :32] - w[3, :32]).abs() <= tiny).all())
    # (Min/max rounding's own step, 1e-37 / 15, would be subnormal: not comparable there.)
    assert float(group_errors(gq, w)[3, 1]) <= float(minmax_errors(w, 32)[3, 1])


def test_rtn_refusals_and_pick_group() -> None:
    assert [pick_group(c) for c in (4096, 576, 1536, 160, 32)] == [128, 64, 128, 32, 32]
    assert pick_group(576, 256) == 64 and pick_group(1536, 256) == 256
    with pytest.raises(GroupQuantError, match=r"\[2, 576\].*groups of 128.*chooses 64"):
        quantize_rtn(torch.randn(2, 576), 128)
    with pytest.raises(GroupQuantError, match="multiple of 32; it is 520"):
        pick_group(520)
    with pytest.raises(GroupQuantError, match="NaN"):
        quantize_rtn(torch.full((1, 32), float("nan")), 32)


# --------------------------------------------------------------------------- weighted by inputs


def weighted_errors(gq: GroupQuant, w: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
    """Each group's activation-weighted squared error sum act_j (dense - w)_j^2, float64
    [rows, groups]."""
    d = gq.dense().double() - w.double()
    return (d * d * act.double()).view(gq.rows, -1, gq.group).sum(dim=2)


def skewed_case(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights and input statistics as a real layer's: most columns' mean x^2 small, a few
    a hundred to a thousand times larger (AWQ's salient channels)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    act = torch.rand(cols, generator=g) * 0.1 + 0.01
    salient = torch.randperm(cols, generator=g)[: cols // 32]
    act[salient] = torch.rand(salient.numel(), generator=g) * 900 + 100
    return w, act


@pytest.mark.parametrize(("rows", "cols", "group"), [(48, 576, 64), (17, 384, 128), (5, 96, 32)])
def test_weighted_search_lowers_the_weighted_error(rows: int, cols: int, group: int) -> None:
    w, act = skewed_case(rows, cols, seed=rows)
    plain, weighted = quantize_rtn(w, group), quantize_rtn(w, group, act)
    assert weighted.check() is weighted and weighted.shape == (rows, cols)
    ours, theirs = weighted_errors(weighted, w, act), weighted_errors(plain, w, act)
    # In all by a good margin, and in nearly every group (the two searches refit from the
    # same starts along other paths: a group may end in a worse local minimum); the
    # unweighted error it gives up is the price.
    assert float(ours.sum()) < 0.7 * float(theirs.sum())
    assert float((ours <= theirs * (1 + 1e-4) + 1e-12).double().mean()) >= 0.9
    assert float(group_errors(weighted, w).sum()) > float(group_errors(plain, w).sum())


def test_weighted_search_keeps_what_the_plain_one_guarantees() -> None:
    """Never more weighted error (in the search's weights) than min/max rounding; a grid
    that holds a group exactly is given back (to float32 rounding); each weight rounds to
    its nearest step; constant groups stay exact."""
    w, act = skewed_case(24, 576, seed=7)
    w[3, :64] = 0.5  # constant
    w[4] = q4_1_like(1, 576, seed=5)[0]  # Q4_1 blocks: in groups of 32, their own grids
    gq = quantize_rtn(w, 32, act)
    d = gq.dense().double() - w.double()
    x = w.double().view(24, -1, 32)
    lo, hi = x.amin(dim=2, keepdim=True), x.amax(dim=2, keepdim=True)
    s = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(lo))
    dm = (((x - lo) / s).round().clamp(0, 15) * s + lo - x).view(24, 576)
    # The weights the search minimises with: act relative to its group's mean, damped.
    a = group_quant.group_weights(act, 576, 32).double()
    ours, minmax = (d * d).view(24, -1, 32), (dm * dm).view(24, -1, 32)
    assert bool(((ours * a).sum(2) <= (minmax * a).sum(2) * (1 + 1e-4) + 1e-12).all())
    assert bool((gq.dense()[3, :64] == 0.5).all())
    # Up to the float32 products in its sums (weights of very unequal size refit it with
    # ~1e-6 of the row's range to spare; plain, the grid comes back exact).
    assert bool(((gq.dense()[4] - w[4]).abs() <= 1e-5 * w[4].abs().amax()).all())
    steps = torch.arange(16, dtype=torch.float64)
    sc = gq.scale.double().repeat_interleave(32, dim=1)[..., None]
    of = gq.offset.double().repeat_interleave(32, dim=1)[..., None]
    dist = (steps * sc + of - w.double()[..., None]).abs()
    chosen = dist.gather(2, gq.q.long()[..., None])[..., 0]
    assert bool((chosen <= dist.amin(dim=2) + 1e-6 * sc[..., 0]).all())


def assert_same(a: GroupQuant, b: GroupQuant) -> None:
    assert torch.equal(a.q, b.q) and torch.equal(bits(a.scale), bits(b.scale))
    assert torch.equal(bits(a.offset), bits(b.offset))


def test_weighted_row_and_column_blocks_quantise_as_the_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tensor-parallel rank's block: rows [a, b) of the matrix, or whole groups of its
    columns with the matching slice of the statistics, give the whole matrix's bits for
    those rows or groups; and so do other chunkings and w's bf16 widened."""
    w, act = skewed_case(40, 512, seed=11)
    w = w.bfloat16()
    whole = quantize_rtn(w, 128, act)
    assert_same(quantize_rtn(w[8:24], 128, act), whole.row_block(8, 16))
    assert_same(quantize_rtn(w[:, 256:512], 128, act[256:512]), whole.col_block(256, 256))
    assert_same(quantize_rtn(w[:, 128:256], 128, act[128:256]), whole.col_block(128, 128))
    assert_same(quantize_rtn(w.float(), 128, act), whole)
    monkeypatch.setattr(group_quant, "_CHUNK", 3 * 512)  # 14 chunks, the last of 1 row
    assert_same(quantize_rtn(w, 128, act), whole)


def test_the_statistics_scale_and_damping() -> None:
    """Only each group's act relative to its mean counts (a group's scale is its own), and
    a group whose statistics are all zero weighs its columns alike."""
    w, act = skewed_case(8, 256, seed=2)
    assert_same(quantize_rtn(w, 64, act * 4), quantize_rtn(w, 64, act))
    scaled = act.clone()
    scaled[64:128] *= 1024  # one group's statistics only: the others' weights unchanged
    assert_same(quantize_rtn(w, 64, scaled), quantize_rtn(w, 64, act))
    zero = act.clone()
    zero[:64] = 0
    ws = group_quant.group_weights(zero, 256, 64)
    assert ws.shape == (4, 64) and bool((ws[0] == ws[0, 0]).all())
    assert_same(quantize_rtn(w[:, :64], 64, zero[:64]), quantize_rtn(w[:, :64], 64, zero[:64] + 1))


@pytest.mark.parametrize(
    ("act", "match"),
    [
        (torch.ones(128), r"float vector \[256\]"),
        (torch.ones(256, 1), r"float vector \[256\]"),
        (torch.ones(256, dtype=torch.int32), r"float vector \[256\]"),
        (torch.full((256,), -1.0), "finite and non-negative"),
        (torch.full((256,), float("nan")), "finite and non-negative"),
    ],
)
def test_bad_statistics_are_refused(act: torch.Tensor, match: str) -> None:
    with pytest.raises(GroupQuantError, match=match):
        quantize_rtn(torch.randn(4, 256), 64, act)
