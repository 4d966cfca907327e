"""4-bit weights with a scale and an offset per group of input columns: ``GroupQuant``.

One representation for every 4-bit source the engine reads or makes, so the kernel's int4
packer has one input: w[r, c] = scale[r, c // group] * q[r, c] + offset[r, c // group],
q in 0..15. Each source maps onto it without changing a bit:

- GGUF Q4_0 (w = d * (q - 8)): scale d, offset -8d; Q4_1 (w = d * q + m): scale d,
  offset m; group 32 (a block); Q4_K (a block of 256 in 8 sub-blocks of 32, w = d sc q -
  dmin m with 6-bit sc and m a sub-block): scale d sc, offset -dmin m (products of an fp16
  value and a 6-bit integer: exact in float32), group 32;
- AutoAWQ GEMM and AutoGPTQ / GPTQModel (w = s * (q - z)): scale s, offset -z * s, exact
  in float32 (s is fp16, z at most 16: the product needs 16 bits of mantissa);
- ``quantize_rtn``: ``--quantize int4``'s asymmetric round-to-nearest, each group's grid
  searched for its least squared error, weighted by the inputs' statistics where given
  (runtime/calibration.py).

``q`` is one weight a byte, unpacked: the kernel's packer lays the nibbles out as the kernel
streams them. Rows are output features and columns input features ([out, in], as every
weight of ours), so fusing and interleaving rows (weights/repack.py) keeps each row's
groups whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from monokernel.errors import WeightLoadError

QMAX = 15  # 4-bit unsigned
GROUP_MULTIPLE = 32  # the kernel reads a row in 32-weight steps: a group never splits one
# 8 bits (gguf_groups.py: Q8_0, Q6_K, Q5_K, ...) stream as byte tiles, a k-tile of 16
# columns at a time: Q6_K's groups of 16 are whole k-tiles.
GROUP_MULTIPLE_8 = 16
BITS = (4, 8)
GGUF_GROUP = 32  # a Q4_0/Q4_1 block, a Q4_K sub-block
# Bytes of a block: Q4_0/Q4_1 fp16 d, [fp16 m,] 16 bytes of quants (32 weights); Q4_K fp16 d
# and dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of quants (256 weights).
GGUF_BLOCK_BYTES: dict[str, int] = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}
GGUF_BLOCK_WEIGHTS: dict[str, int] = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 256}
# The block types GGUF dequantises as d (q - zero), and their zeros: the decoders store the
# offset -zero d, and the loader's dense copies subtract the zero first, as gguf's do
# (GroupQuant.zero_point_dense), so they are gguf's bits. The others (Q4_1, Q4_K, Q5_1,
# Q5_K: d q + m) are dense()'s.
GGUF_ZERO_POINTS: dict[str, int] = {"Q4_0": 8, "Q8_0": 128, "Q5_0": 16, "Q6_K": 32}
# AutoAWQ packs the eight columns of an int32 in this order: nibble i (bits 4i..4i+3) holds
# column AWQ_ORDER[i] of the eight (its GEMM kernel's dequantisation wants them so); a
# column's nibble is therefore AWQ_NIBBLE[column], the inverse permutation.
AWQ_ORDER: tuple[int, ...] = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_NIBBLE: tuple[int, ...] = (0, 4, 1, 5, 2, 6, 3, 7)
GPTQ_FORMATS: tuple[str, ...] = ("gptq", "gptq_v2")  # v1: stored zeros are zero - 1
GPTQ_SYM_ZERO = 8  # 2 ** (bits - 1): a symmetric GPTQ checkpoint's zero point


class GroupQuantError(WeightLoadError, ValueError):
    """A 4-bit matrix whose tensors do not fit together, or that cannot be made."""


@dataclass(frozen=True, slots=True, eq=False)
class GroupQuant:
    """A [rows, cols] weight matrix in 4 bits: w = scale * q + offset, per group of ``group``
    consecutive columns of a row. All three tensors are on one device; construction checks
    their shapes and dtypes (``check`` also the values, which reads them all)."""

    q: torch.Tensor  # uint8 [rows, cols], 0..2**bits - 1
    scale: torch.Tensor  # float32 [rows, cols // group]
    offset: torch.Tensor  # float32 [rows, cols // group]
    group: int  # a multiple of 32 (bits 4) or 16 (bits 8) dividing cols
    bits: int = 4  # 4: streamed as int4; 8: as int8 groups (weights/formats/int8.py)

    def __post_init__(self) -> None:
        _check_layout(self.q, self.scale, self.offset, self.group, self.bits)

    @property
    def rows(self) -> int:
        return int(self.q.shape[0])

    @property
    def cols(self) -> int:
        return int(self.q.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [rows, cols] matrix, computed in float32 (scale * q rounds nowhere: q has 4
        bits; adding the offset rounds once), then cast to ``dtype``."""
        w = self.q.to(torch.float32).view(self.rows, -1, self.group)
        # Two separate in-place passes, never one fused multiply-add: the same rounding on
        # every device, and the same bits as GGUF's own Q4_1 dequantisation.
        w.mul_(self.scale[:, :, None]).add_(self.offset[:, :, None])
        return w.view(self.rows, self.cols).to(dtype)

    def zero_point_dense(self, zero: int) -> torch.Tensor:
        """The [rows, cols] float32 matrix as scale * (q - zero), for one whose offset is
        -zero * scale (GGUF Q4_0, Q8_0, Q5_0, Q6_K): the same value as dense() up to one
        rounding, and the bits GGUF's own dequantisation gives, which subtracts the zero
        point (exact: small integers) before it scales; dense() rounds the product and then
        the sum (a Q6_K product d sc q can take 25 bits)."""
        w = self.q.to(torch.float32).view(self.rows, -1, self.group).sub_(zero)
        return w.mul_(self.scale[:, :, None]).view(self.rows, self.cols)

    def check(self) -> GroupQuant:
        """``self`` when q is in 0..15 and every scale and offset is finite; else
        GroupQuantError saying which."""
        _check_layout(self.q, self.scale, self.offset, self.group, self.bits)
        top = (1 << self.bits) - 1
        if self.q.numel() and int(self.q.max()) > top:
            raise GroupQuantError(
                f"{self.bits}-bit quants must be 0..{top}; found {int(self.q.max())}"
            )
        for name in ("scale", "offset"):
            if not bool(torch.isfinite(getattr(self, name)).all()):
                raise GroupQuantError(f"a {self.bits}-bit matrix has a non-finite {name}")
        return self

    def to(self, device: torch.device | str) -> GroupQuant:
        return GroupQuant(
            self.q.to(device), self.scale.to(device), self.offset.to(device), self.group, self.bits
        )

    def row_block(self, start: int, size: int) -> GroupQuant:
        """Rows [start, start + size), views (a tensor-parallel rank's output features)."""
        rows = slice(start, start + size)
        return GroupQuant(self.q[rows], self.scale[rows], self.offset[rows], self.group, self.bits)

    def widened(self, group: int) -> GroupQuant:
        """The same values as 8 bits in groups of ``group`` (a divisor of this one's): each
        group's scale and offset repeated over its parts, q unchanged. A file that mixes 4-
        and 8-bit matrices (a GGUF Q4_K_M's Q4_K with Q6_K) streams them all alike."""
        if group <= 0 or self.group % group:
            raise GroupQuantError(f"groups of {self.group} do not split into groups of {group}")
        k = self.group // group
        return GroupQuant(
            self.q,
            self.scale.repeat_interleave(k, dim=1),
            self.offset.repeat_interleave(k, dim=1),
            group,
            8,
        )

    def col_block(self, start: int, size: int) -> GroupQuant:
        """Columns [start, start + size), copies (a rank's input features): whole groups
        only, or GroupQuantError naming the cut."""
        if start % self.group or size % self.group:
            raise GroupQuantError(
                f"columns [{start}, {start + size}) would cut this matrix's groups of "
                f"{self.group} columns"
            )
        g0, gs = start // self.group, size // self.group
        return GroupQuant(
            self.q[:, start : start + size].contiguous(),
            self.scale[:, g0 : g0 + gs].contiguous(),
            self.offset[:, g0 : g0 + gs].contiguous(),
            self.group,
            self.bits,
        )


def _check_layout(
    q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int, bits: int
) -> None:
    if bits not in BITS:
        raise GroupQuantError(f"bits {bits!r}: a GroupQuant holds {BITS} bits a weight")
    if q.dtype != torch.uint8 or q.dim() != 2:
        raise GroupQuantError(f"q must be a 2-D uint8 tensor; got {q.dtype} {tuple(q.shape)}")
    rows, cols = q.shape
    unit = GROUP_MULTIPLE if bits == 4 else GROUP_MULTIPLE_8
    if not isinstance(group, int) or group <= 0 or group % unit or cols % group:
        raise GroupQuantError(
            f"group {group!r} must be a positive multiple of {unit} dividing the {cols} columns"
        )
    want = (rows, cols // group)
    for name, t in (("scale", scale), ("offset", offset)):
        if t.dtype != torch.float32 or tuple(t.shape) != want:
            raise GroupQuantError(
                f"{name} must be float32 {want} for q {tuple(q.shape)} in groups of {group}; "
                f"got {t.dtype} {tuple(t.shape)}"
            )
        if t.device != q.device:
            raise GroupQuantError(f"{name} is on {t.device}, q on {q.device}")


# --------------------------------------------------------------------------- row operations


def fuse_rows(*gqs: GroupQuant) -> GroupQuant:
    """The matrices one above the other (wq, wk, wv -> wqkv), as repack.fuse_rows does for
    dense ones; all must have the same columns and group."""
    if not gqs:
        raise GroupQuantError("fuse_rows needs at least one matrix")
    first = gqs[0]
    for g in gqs[1:]:
        if (g.cols, g.group, g.bits) != (first.cols, first.group, first.bits):
            raise GroupQuantError(
                f"cannot fuse rows of {g.cols} columns in groups of {g.group} onto rows of "
                f"{first.cols} columns in groups of {first.group} ({g.bits} and {first.bits} "
                "bits a weight)"
            )
    return GroupQuant(
        torch.cat([g.q for g in gqs]).contiguous(),
        torch.cat([g.scale for g in gqs]).contiguous(),
        torch.cat([g.offset for g in gqs]).contiguous(),
        first.group,
        first.bits,
    )


def interleave_rows(a: GroupQuant, b: GroupQuant) -> GroupQuant:
    """Rows a0, b0, a1, b1, ... (gate and up -> wgu), as repack.interleave_rows does."""
    if (a.shape, a.group, a.bits) != (b.shape, b.group, b.bits):
        raise GroupQuantError(
            f"cannot interleave {a.shape} (group {a.group}, {a.bits} bits) with {b.shape} "
            f"(group {b.group}, {b.bits} bits)"
        )

    def mix(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.stack((x, y), dim=1).reshape(2 * x.shape[0], x.shape[1]).contiguous()

    return GroupQuant(
        mix(a.q, b.q), mix(a.scale, b.scale), mix(a.offset, b.offset), a.group, a.bits
    )


def permute_rows(gq: GroupQuant, index: torch.Tensor) -> GroupQuant:
    """Rows index[0], index[1], ... of ``gq`` (a permutation, such as the GGUF Q/K row
    unpermute, or any selection of rows)."""
    if index.dim() != 1 or index.dtype.is_floating_point or index.dtype == torch.bool:
        raise GroupQuantError(f"a row index must be 1-D integers; got {index.dtype} {index.shape}")
    i = index.to(device=gq.q.device, dtype=torch.long)
    if i.numel() and (int(i.min()) < 0 or int(i.max()) >= gq.rows):
        raise GroupQuantError(f"a row index is out of range for {gq.rows} rows")
    # index_select, not q[i]: advanced indexing of uint8 rows is ~50x slower on the CPU.
    return GroupQuant(
        gq.q.index_select(0, i),
        gq.scale.index_select(0, i),
        gq.offset.index_select(0, i),
        gq.group,
        gq.bits,
    )


# --------------------------------------------------------------------------- --quantize int4


def pick_group(cols: int, preferred: int = 128) -> int:
    """The largest of ``preferred``, its half, its quarter, ... down to 32 that divides
    ``cols``: 128 where it divides, else a smaller power-of-two group (64 for the default
    model's 576 columns; the kernel reads groups that divide its 8-chunk step, never 96).
    GroupQuantError when ``cols`` is not a multiple of 32."""
    group = preferred
    while group >= GROUP_MULTIPLE:
        if group % GROUP_MULTIPLE == 0 and cols % group == 0:
            return group
        group //= 2
    raise GroupQuantError(
        f"4-bit groups need the input size to be a multiple of {GROUP_MULTIPLE}; it is {cols}"
    )


def quantize_rtn(w: torch.Tensor, group: int = 128, act: torch.Tensor | None = None) -> GroupQuant:
    """``w`` [rows, cols] to 4 bits in groups of ``group`` columns, each group's grid
    (scale and a float offset) chosen to minimise its squared error, then each weight
    rounded to the nearest of its group's 16 steps.

    The search, per group, as llama.cpp's make_qkx quantisers and AWQ's clip search do:
    from the group's [min, max] range (min/max rounding: scale = range / 15, offset = min)
    and from ranges shrunk to ``_SHRINKS`` of it at ``_ANCHORS`` within it, ``_REFITS``
    times round to the grid and refit scale and offset to those quants by least squares;
    keep the grid of least squared error. The first refit starts from min/max rounding's
    quants, so no group has more squared error than min/max rounding gives it (up to the
    float rounding of its sums); a grid that holds a group exactly (a GGUF Q4_1 block's own)
    gives it back (weighted, up to the rounding of the float32 products in its sums, ~1e-6
    of the group's range). The offset is any float: 0 is not a step of its own.

    ``act``: float [cols], the matrix's input statistics (mean x^2 of each input column
    over a calibration text: runtime/calibration.py). The error is then activation-weighted,
    sum_j s_j (w_j - v_j)^2 over each group's columns j (v: the dequantised weights) with
    s_j = act_j / (the group's mean act) + ``_DAMP``: for inputs whose columns are
    uncorrelated, the squared error the layer's output gets from that group (AWQ's
    observation, in GPTQ's terms the Hessian's diagonal). The search and its least-squares
    refits are weighted alike; rounding to the nearest step stays optimal weight by weight.
    Without it every weight counts the same. A group's weights depend only on its own
    columns' statistics, so a column block at group boundaries with the matching slice of
    ``act`` quantises as the whole matrix does.

    Deterministic; on w's device, in float32 whatever w's dtype, a chunk of rows at a time.
    A constant group is exact: offset the constant, q 0, scale |constant| / 15 (1 for
    zeros). No scale is below the smallest normal float32, so the kernel never meets a
    subnormal or zero scale."""
    if w.dim() != 2 or not w.dtype.is_floating_point:
        raise GroupQuantError(f"quantize_rtn takes a 2-D float matrix; got {w.dtype} {w.shape}")
    rows, cols = w.shape
    if group <= 0 or group % GROUP_MULTIPLE or cols % group:
        raise GroupQuantError(
            f"a [{rows}, {cols}] matrix cannot be quantised in groups of {group}: the group "
            f"must be a multiple of {GROUP_MULTIPLE} dividing {cols} "
            f"(pick_group chooses {_group_hint(cols, group)})"
        )
    ngroups = cols // group
    weights = None if act is None else group_weights(act.to(w.device), cols, group)
    q = torch.empty(rows, cols, dtype=torch.uint8, device=w.device)
    scale = torch.empty(rows, ngroups, dtype=torch.float32, device=w.device)
    offset = torch.empty_like(scale)
    step = max(1, (_CHUNK if w.device.type == "cpu" else _CHUNK_GPU) // cols)
    for r in range(0, rows, step):
        x = w[r : r + step].to(torch.float32).reshape(-1, group)
        if not bool(torch.isfinite(x).all()):
            raise GroupQuantError("cannot quantise a matrix with an infinite or NaN weight")
        sw = None
        if weights is not None:  # every row of the chunk weighs its columns alike
            sw = weights.expand(x.shape[0] // ngroups, ngroups, group).reshape(-1, group)
        s, o, qc = _search_grid(x, sw)
        scale[r : r + step] = s.view(-1, ngroups)
        offset[r : r + step] = o.view(-1, ngroups)
        q[r : r + step] = qc.view(-1, cols)
    return GroupQuant(q, scale, offset, group)


def group_weights(act: torch.Tensor, cols: int, group: int) -> torch.Tensor:
    """The search's weights [cols / group, group] float32 from input statistics ``act``
    [cols] (quantize_rtn): each group's act over its mean, plus ``_DAMP``. A group whose
    statistics are all zero weighs its columns alike. GroupQuantError for a wrong shape or
    a negative or non-finite value."""
    if act.dim() != 1 or act.shape[0] != cols or not act.dtype.is_floating_point:
        raise GroupQuantError(
            f"input statistics for {cols} columns must be a float vector [{cols}]; got "
            f"{act.dtype} {tuple(act.shape)}"
        )
    a = act.to(torch.float32).reshape(cols // group, group)
    if not bool(torch.isfinite(a).all()) or bool((a < 0).any()):
        raise GroupQuantError("input statistics must be finite and non-negative")
    # Only a group's own columns: the weights are the same bits in any column block.
    mean = (_rowsum(a) / group).float()
    ones = torch.ones_like(a)
    rel = torch.where(mean[:, None] > 0, a / mean.clamp_min(_TINY)[:, None], ones)
    return rel.add_(_DAMP)


# The starts besides [min, max]: ranges shrunk to these fractions of it, placed at these
# points between its low end (-1) and its high end (1). Each round is ~9 passes over the
# weights; on the default model 66 rounds (7 shrinks x 3 places x 3 refits) leave 0.6%
# less squared error than these 21, 14 rounds 1% more, 12 from centred ranges 5% more.
_SHRINKS: tuple[float, ...] = (0.9, 0.75)
_ANCHORS: tuple[float, ...] = (-0.5, 0.0, 0.5)
_REFITS = 3
# Added to each column's weight (its group's mean is 1): no column counts for nothing, as
# the calibration text cannot have shown every input the model will meet.
_DAMP = 0.01
# Weights a chunk: the working memory is a few chunks of float32. The CPU is fastest at
# 4M; a GPU takes 16M, as each round launches ~30 kernels a chunk (an 8B model's 7e9
# weights in 4M chunks would take seconds of launches alone).
_CHUNK = 1 << 22
_CHUNK_GPU = 1 << 24
_TINY = torch.finfo(torch.float32).tiny
# A weighted refit's quants are all equal (its determinant zero but for rounding) below
# this fraction of sum(s) sum(s q^2); unweighted, the determinant is an integer, >= 1 else.
_FLAT = 1e-9


def _search_grid(
    x: torch.Tensor, s: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups x [n, group] float32 -> scale [n], offset [n] and quants [n, group] (uint8),
    as quantize_rtn describes; ``s`` [n, group] float32: each weight's weight in the error
    (None: 1 each).

    The search runs in units of each group's min/max step (u = (x - min) / step, 0..15), so
    its sums are of like size whatever the group's scale. A grid f q + c there is refitted
    from three sums (of s q, s q u and s q^2), and its squared error comes from the same
    sums in float64, not from another pass over the weights."""
    n, g = x.shape
    lo, hi = x.amin(dim=1), x.amax(dim=1)
    span = hi - lo
    # A constant group is its offset (q = 0) with a scale of its size: the tile kernel's
    # a' (1024 + q / m) + (b - 1024 a') rounds relative to a. A group of zeros takes scale 1.
    flat = torch.where(hi != 0, hi.abs() / QMAX, torch.ones_like(hi))
    unit = torch.where(span > 0, span / QMAX, flat).clamp_min(_TINY)
    u = (x - lo[:, None]).div_(unit[:, None])
    t = torch.empty_like(u)
    st = None if s is None else torch.empty_like(u)
    if s is None:
        sw: torch.Tensor | float = float(g)
        su, suu = _rowsum(u), _dots(u, u)
    else:
        sw, su, suu = _rowsum(s), _dots(s, u), _dots(s * u, u)

    best_e = torch.full((n,), float("inf"), dtype=torch.float64, device=x.device)
    best_f = torch.ones(n, dtype=torch.float64, device=x.device)
    best_c = torch.zeros(n, dtype=torch.float64, device=x.device)
    starts = [(1.0, 0.0)] + [
        (f, 0.5 * QMAX * (1.0 - f) * (1.0 + a)) for f in _SHRINKS for a in _ANCHORS
    ]
    for f0, c0 in starts:
        f = torch.full((n,), f0, dtype=torch.float64, device=x.device)
        c = torch.full((n,), c0, dtype=torch.float64, device=x.device)
        for _ in range(_REFITS):
            # t = clamp(round((u - c) / f), 0, 15), in place.
            torch.mul(u, (1.0 / f).float()[:, None], out=t).add_((-c / f).float()[:, None])
            t.round_().clamp_(0, QMAX)
            if s is None or st is None:
                # sq and sqq are sums of small integers (exact in any order); squ is _dots'.
                sq, squ, sqq = t.sum(dim=1).double(), _dots(t, u), _dots(t, t)
            else:
                torch.mul(s, t, out=st)
                sq, squ, sqq = _rowsum(st), _dots(st, u), _dots(st, t)
            # Least squares of u ~ f q + c over the group, for these quants: never more
            # error than (f, c) with them, which is never more than (f, c) with the last.
            den = sw * sqq - sq * sq
            nf = (sw * squ - sq * su) / den.clamp_min(1.0 if s is None else 1e-300)
            # Else all the group's quants are equal: keep (f, c).
            ok = (den > _FLAT * sw * sqq) & (nf > 0)
            f = torch.where(ok, nf, f)
            c = torch.where(ok, (su - f * sq) / sw, c)
            e = f * (f * sqq + 2 * c * sq - 2 * squ) + c * (sw * c - 2 * su) + suu
            better = e < best_e
            best_e = torch.where(better, e, best_e)
            best_f = torch.where(better, f, best_f)
            best_c = torch.where(better, c, best_c)

    scale = (best_f * unit.double()).float().clamp_min(_TINY)
    offset = (lo.double() + best_c * unit.double()).float()
    torch.sub(x, offset[:, None], out=t).div_(scale[:, None]).round_().clamp_(0, QMAX)
    return scale, offset, t.to(torch.uint8)


def _dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot products of a and b [n, g] float32, as float64 [n]: products summed by
    _rowsum. Not a batched matmul, which TF32 (where a caller allows it) would round to 10
    bits: the search's errors are differences of these sums."""
    return _rowsum(a * b)


def _rowsum(p: torch.Tensor) -> torch.Tensor:
    """Row sums of p [n, g] (g a power of two) in one fixed order, pairs then pairs of those,
    as float64. A sum of two numbers rounds alike whichever comes first, so each row's sum
    is the same bits whatever n and the device, where torch's reductions pick their order
    by shape: on a GPU a tensor-parallel rank's block of a matrix would round its groups'
    sums otherwise than the whole matrix does, and the search pick other grids."""
    while p.shape[1] > 1:
        p = p[:, 0::2] + p[:, 1::2]
    return p[:, 0].double()


def _group_hint(cols: int, group: int) -> str:
    try:
        return str(pick_group(cols, max(group, GROUP_MULTIPLE)))
    except GroupQuantError:
        return f"none: {cols} is not a multiple of {GROUP_MULTIPLE}"


# --------------------------------------------------------------------------- GGUF


def from_gguf_blocks(raw: torch.Tensor, kind: str, shape: tuple[int, ...]) -> GroupQuant:
    """A GGUF Q4_0, Q4_1 or Q4_K tensor's stored bytes (uint8, whole blocks in row-major
    order) as a GroupQuant of ``shape`` [rows, cols] in groups of 32 (a Q4_0/Q4_1 block, a
    Q4_K sub-block). ``dense()`` equals the GGUF dequantisation in float32 (Q4_0 up to the
    sign of a zero: d * (q - 8) is -0.0 where the scale form gives +0.0)."""
    if kind not in GGUF_BLOCK_BYTES:
        raise GroupQuantError(
            f"GGUF type {kind} is not 4-bit; 4-bit types: {', '.join(GGUF_BLOCK_BYTES)}"
        )
    per = GGUF_BLOCK_WEIGHTS[kind]
    if len(shape) != 2 or shape[1] % per:
        raise GroupQuantError(f"a {kind} matrix must be 2-D with columns in {per}s; got {shape}")
    rows, cols = (int(s) for s in shape)
    size = GGUF_BLOCK_BYTES[kind]
    if raw.dtype != torch.uint8 or raw.numel() != rows * cols // per * size:
        raise GroupQuantError(
            f"{kind} {shape} takes {rows * cols // per * size} bytes; "
            f"got {raw.numel()} of {raw.dtype}"
        )
    blocks = raw.reshape(-1, size)
    ngroups = cols // GGUF_GROUP
    if kind == "Q4_K":
        scale, offset, q = _q4_k_groups(blocks)
        return GroupQuant(
            q.reshape(rows, cols), scale.reshape(rows, ngroups), offset.reshape(rows, ngroups),
            GGUF_GROUP,
        )  # fmt: skip
    d = blocks[:, 0:2].contiguous().view(torch.float16).to(torch.float32).reshape(-1)
    if kind == "Q4_0":
        offset = d * -float(GGUF_ZERO_POINTS[kind])  # exact: 2^k times an fp16 value
        qs = blocks[:, 2:]
    else:
        offset = blocks[:, 2:4].contiguous().view(torch.float16).to(torch.float32).reshape(-1)
        qs = blocks[:, 4:]
    # Within a block the low nibbles are weights 0-15 and the high nibbles 16-31.
    q = torch.empty(blocks.shape[0], GGUF_GROUP, dtype=torch.uint8, device=raw.device)
    torch.bitwise_and(qs, 0x0F, out=q[:, :16])
    torch.bitwise_right_shift(qs, 4, out=q[:, 16:])
    return GroupQuant(
        q.reshape(rows, cols), d.reshape(rows, ngroups), offset.reshape(rows, ngroups), GGUF_GROUP
    )


def q4_k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes [n, 12] of a Q4_K or Q5_K block's 6-bit sub-block scales and mins ->
    sc, m uint8 [n, 8]: for sub-block j < 4 the low 6 bits of bytes j and j + 4; for j >= 4
    the nibbles of byte j + 4 with the top 2 bits of bytes j - 4 and j above them."""
    # In uint8 (every value fits 6 bits): a 32B model has 86M such blocks.
    lo, mid, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat((lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)), dim=1)
    mn = torch.cat((mid & 63, (hi >> 4) | ((mid >> 6) << 4)), dim=1)
    return sc, mn


def _q4_k_groups(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K blocks [n, 144] -> each sub-block's scale d sc and offset -dmin m [n, 8] and the
    quants [n, 256] (q4_k_scales_mins: sub-block j's 6-bit sc and m). The 128 quant bytes
    are 4 runs of 32: run i's low nibbles are sub-block 2i, its high nibbles 2i + 1."""
    d = blocks[:, 0:2].contiguous().view(torch.float16).to(torch.float32)
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).to(torch.float32)
    sc, mn = q4_k_scales_mins(blocks[:, 4:16])
    # d sc and dmin m: an fp16 value times a 6-bit integer, exact in float32; ggml's
    # d1 * q - m1 is then q * scale + offset bit for bit.
    scale = d * sc.to(torch.float32)
    offset = -(dmin * mn.to(torch.float32))
    runs = blocks[:, 16:144].reshape(-1, 4, 32)
    q = torch.empty(runs.shape[0], 4, 2, 32, dtype=torch.uint8, device=blocks.device)
    torch.bitwise_and(runs, 0x0F, out=q[:, :, 0])  # [n, 4 runs, low / high, 32]
    torch.bitwise_right_shift(runs, 4, out=q[:, :, 1])
    return scale, offset, q.view(-1, 256)


# --------------------------------------------------------------------------- AWQ and GPTQ


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> uint8 [..., n, 8]: nibble i (bits 4i..4i+3) of each word at i."""
    if packed.dtype not in (torch.int32, torch.uint32):
        raise GroupQuantError(f"packed 4-bit weights must be int32; got {packed.dtype}")
    words = packed.view(torch.int32) if packed.dtype == torch.uint32 else packed
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    # An arithmetic shift drags the sign bit in from the left; the mask drops it again.
    return ((words[..., None] >> shifts) & 0x0F).to(torch.uint8)


def _scales_of(scales: torch.Tensor, want: tuple[int, int], what: str) -> torch.Tensor:
    if not scales.dtype.is_floating_point or tuple(scales.shape) != want:
        raise GroupQuantError(
            f"{what} scales must be floating point {want}; got {scales.dtype} {tuple(scales.shape)}"
        )
    # [in / group, out] -> [out, in / group]; float16 and bfloat16 widen to float32 exactly.
    return scales.to(torch.float32).t().contiguous()


def _expect(t: torch.Tensor, want: tuple[int, ...], what: str) -> None:
    if tuple(t.shape) != want:
        raise GroupQuantError(f"{what} must have shape {want}; got {tuple(t.shape)}")


def _group_of(group: int, cols: int, what: str) -> int:
    if group == -1:  # GPTQ's "no groups": one a row
        group = cols
    if group <= 0 or group % GROUP_MULTIPLE or cols % group:
        raise GroupQuantError(
            f"{what}: group size {group} must be a multiple of {GROUP_MULTIPLE} dividing the "
            f"input size {cols}"
        )
    return group


def from_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int
) -> GroupQuant:
    """An AutoAWQ GEMM module: qweight int32 [in, out/8], qzeros int32 [in/group, out/8]
    (eight output columns a word, in AWQ_ORDER), scales [in/group, out] ->
    GroupQuant [out, in] with scale s and offset -z * s (w = s * (q - z))."""
    if qweight.dim() != 2:
        raise GroupQuantError(f"AWQ qweight must be 2-D; got {tuple(qweight.shape)}")
    cols, out = int(qweight.shape[0]), int(qweight.shape[1]) * 8
    group = _group_of(group, cols, "AWQ")
    ngroups = cols // group
    _expect(qzeros, (ngroups, out // 8), "AWQ qzeros")
    reorder = torch.tensor(AWQ_NIBBLE, device=qweight.device)
    # [in, out/8, 8 nibbles] -> [in, out/8, 8 columns] -> [in, out] -> [out, in]
    q = _nibbles(qweight)[..., reorder].reshape(cols, out).t().contiguous()
    z = _nibbles(qzeros)[..., reorder].reshape(ngroups, out).t().to(torch.float32)
    s = _scales_of(scales, (ngroups, out), "AWQ")
    return GroupQuant(q, s, (-z * s).contiguous(), group)


def gptq_trivial_g_idx(g_idx: torch.Tensor | None, cols: int, group: int) -> bool:
    """Whether a GPTQ module's g_idx is the one without act-order (input column c in group
    c // group), or absent."""
    if g_idx is None:
        return True
    want = torch.arange(cols, device=g_idx.device) // _group_of(group, cols, "GPTQ")
    return tuple(g_idx.shape) == (cols,) and bool(torch.equal(g_idx.to(torch.long), want))


def from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group: int,
    sym: bool,
    checkpoint_format: str = "gptq",
) -> GroupQuant:
    """An AutoGPTQ / GPTQModel module: qweight int32 [in/8, out] (eight input rows a word,
    row 8k + i in nibble i), qzeros int32 [in/group, out/8] (eight output columns a word, in
    order), scales [in/group, out], g_idx [in] or None -> GroupQuant [out, in] with scale s
    and offset -z * s (w = s * (q - z)). ``group`` -1: one group a row.

    ``checkpoint_format`` "gptq" (AutoGPTQ's, v1, the default) stores each zero point
    minus one, decoded as AutoGPTQ's and vLLM's kernels do (stored + 1, so 1..16);
    "gptq_v2" (GPTQModel's) stores it as it is. ``sym``: the zero point is 8 by definition,
    as vLLM's Marlin kernels take it (the stored zeros are not read).
    Act-order (a g_idx other than arange(in) // group) is refused."""
    # Imported here: weights/formats (which quantize.py imports) may import this module.
    from monokernel.weights.quantize import UnsupportedQuantizationError

    if checkpoint_format not in GPTQ_FORMATS:
        raise UnsupportedQuantizationError(
            f"GPTQ checkpoint_format {checkpoint_format!r} is not supported; supported: "
            f"{', '.join(GPTQ_FORMATS)}"
        )
    if qweight.dim() != 2:
        raise GroupQuantError(f"GPTQ qweight must be 2-D; got {tuple(qweight.shape)}")
    cols, out = int(qweight.shape[0]) * 8, int(qweight.shape[1])
    group = _group_of(group, cols, "GPTQ")
    ngroups = cols // group
    _expect(qzeros, (ngroups, -(-out // 8)), "GPTQ qzeros")
    if not gptq_trivial_g_idx(g_idx, cols, group):
        raise UnsupportedQuantizationError(
            "GPTQ act-order (desc_act, a g_idx other than arange(in) // group) is not "
            "supported; supported: GPTQ checkpoints quantised with desc_act=false"
        )
    # [in/8, out, 8 nibbles] -> [in/8, 8, out] -> [in, out] -> [out, in]
    q = _nibbles(qweight).permute(0, 2, 1).reshape(cols, out).t().contiguous()
    s = _scales_of(scales, (ngroups, out), "GPTQ")
    if sym:
        z = torch.full_like(s, float(GPTQ_SYM_ZERO))
    else:
        stored = _nibbles(qzeros).reshape(ngroups, -1)[:, :out].t().to(torch.float32)
        z = stored + 1.0 if checkpoint_format == "gptq" else stored
    return GroupQuant(q, s, (-z * s).contiguous(), group)
