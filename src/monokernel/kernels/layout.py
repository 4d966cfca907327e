"""Every buffer the host and the decode kernel share, described once.

The kernel's Params and LayerWeights structs, the timing buffer's named marks, the hand-off
buffer's regions, the barrier, flag and token words, and the shared-memory carve-up are
described here. ``python -m monokernel.kernels.layout`` writes ``csrc/layout.cuh`` (checked
in; kernels/test_layout.py fails when it is not current) and the host builds its ctypes
structs and buffer sizes from the same description, so nothing is copied by hand between
Python and CUDA.

Sizes that depend on the model are ``Expr`` objects: integer expressions over the build's
dimensions that evaluate here and print as C++ constant expressions in the header.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from monokernel.weights.formats import PackedMatrix
    from monokernel.weights.repack import LayerPack

HEADER = Path(__file__).parent / "csrc" / "layout.cuh"

# ---- fixed tunables the layout depends on (csrc/tunables.cuh; the header asserts both agree)

THREADS = 512  # kThreads: threads a CTA
WARPS = THREADS // 32
SPLIT_SLOTS = 32  # kSplitSlots: split-K partial sums a warp
TICKET_STRIDE = 32  # kTicketStride: barrier words between two LM-head ticket counters
FLOW_COPIES = 2  # kFlowCopies: copies of each hand-off vector every CTA polls
ATTN_STAGES = 2  # kAttnStages: ring stages of the K/V window
ATTN_PMAX = 256  # kAttnPmax: positions per ring stage at most
TP_MAX_RANKS = 8  # peer receive buffers in Params (MK_TP_MAX)
MAX_SMEM_BYTES = 227 * 1024  # dynamic shared memory one CTA may have on sm_90

TUNABLES: dict[str, int] = {
    "kThreads": THREADS,
    "kSplitSlots": SPLIT_SLOTS,
    "kTicketStride": TICKET_STRIDE,
    "kFlowCopies": FLOW_COPIES,
    "kAttnStages": ATTN_STAGES,
    "kAttnPmax": ATTN_PMAX,
}


# ---- integer expressions over the build's dimensions ---------------------------------------

Env = Mapping[str, int]


class Expr:
    """An integer expression: ``expr(env)`` evaluates it, ``expr.cxx`` is the same expression
    in C++ (non-negative operands only, so ``//`` and C++'s ``/`` agree)."""

    __slots__ = ("_f", "cxx", "prec")

    def __init__(self, cxx: str, f: Callable[[Env], int], prec: int = 3) -> None:
        self.cxx, self._f, self.prec = cxx, f, prec  # prec: 1 for + -, 2 for * /, 3 atoms

    def __call__(self, env: Env) -> int:
        return self._f(env)

    def _bin(self, other: Expr | int, op: str, f: Callable[[int, int], int]) -> Expr:
        o = lit(other) if isinstance(other, int) else other
        prec = 1 if op in "+-" else 2
        left = self.cxx if self.prec >= prec else f"({self.cxx})"
        # C++ groups left to right: a right operand of the same precedence keeps its
        # parentheses (a - (b - c), a * (b / c)), except under +.
        right = o.cxx if o.prec > prec or (o.prec == prec and op == "+") else f"({o.cxx})"
        return Expr(f"{left} {op} {right}", lambda e: f(self(e), o(e)), prec)

    def __add__(self, other: Expr | int) -> Expr:
        return self._bin(other, "+", lambda a, b: a + b)

    def __radd__(self, other: int) -> Expr:
        return lit(other) + self

    def __sub__(self, other: Expr | int) -> Expr:
        return self._bin(other, "-", lambda a, b: a - b)

    def __mul__(self, other: Expr | int) -> Expr:
        return self._bin(other, "*", lambda a, b: a * b)

    def __rmul__(self, other: int) -> Expr:
        return lit(other) * self

    def __floordiv__(self, other: Expr | int) -> Expr:
        return self._bin(other, "/", lambda a, b: a // b)


def lit(n: int) -> Expr:
    return Expr(str(n), lambda e: n)


def sym(name: str, cxx: str) -> Expr:
    """A dimension: ``env[name]`` here, the define or constant ``cxx`` in the header."""
    return Expr(cxx, lambda e: e[name])


def emax(a: Expr | int, b: Expr | int) -> Expr:
    x, y = (lit(v) if isinstance(v, int) else v for v in (a, b))
    return Expr(f"cmax({x.cxx}, {y.cxx})", lambda e: max(x(e), y(e)))


def emin(a: Expr | int, b: Expr | int) -> Expr:
    x, y = (lit(v) if isinstance(v, int) else v for v in (a, b))
    return Expr(f"cmin({x.cxx}, {y.cxx})", lambda e: min(x(e), y(e)))


def round4(x: Expr) -> Expr:
    return (x + 3) // 4 * 4


NAMED: list[tuple[str, Expr]] = []  # in order: the header defines each as a constant


def named(cxx: str, x: Expr) -> Expr:
    """``x``, which the header defines as the constant ``cxx`` and later expressions use."""
    NAMED.append((cxx, x))
    return Expr(cxx, x)


# The build's dimensions (build.py's -D defines) and the tunables above.
H = sym("hidden", "MK_H")
Q = sym("q", "MK_Q")
KV = sym("kv", "MK_KV")
I = sym("intermediate", "MK_I")  # noqa: E741 (the intermediate size, as in the kernel)
D = sym("head_dim", "MK_D")
NH = sym("heads", "MK_NH")
NKV = sym("kv_heads", "MK_NKV")
ATTN_CHUNK = sym("attn_chunk", "MK_ATTN_CHUNK")
TILES = sym("tiles", "MK_TILES")  # 1: the layers' format streams 16-row tiles (gemv_tiles.cuh)
# A tile GEMV's input sums a 32 columns: 2 where its groups are 16 columns (int8 groups of a
# GGUF Q6_K), else 1.
SUM_SPLIT = sym("sum_split", "MK_SUM_SPLIT")
# Positions a verify pass computes (1: the one-token step; build.py KernelDims.positions).
P = sym("positions", "MK_P")
T = Expr("kThreads", lambda e: THREADS)
W = Expr("kWarps", lambda e: WARPS)
SLOTS = Expr("kSplitSlots", lambda e: SPLIT_SLOTS)
PMAX = Expr("kAttnPmax", lambda e: ATTN_PMAX)
STAGES = Expr("kAttnStages", lambda e: ATTN_STAGES)
GROUP = Expr("kGroup", lambda e: e["heads"] // e["kv_heads"])  # dims.cuh


class Shape(Protocol):
    """What the layout needs of a build (kernels/build.py KernelDims has it)."""

    hidden: int
    q_size: int
    kv_size: int
    intermediate: int
    head_dim: int
    heads: int
    kv_heads: int
    weight_tiles: bool | None
    positions: int

    def stage_formats(self) -> list[tuple[str, int]]: ...


def env(shape: Shape, attn_chunk: int = 0) -> dict[str, int]:
    """The values of the symbols above for one build (``attn_chunk``: its K/V window)."""
    return {
        "hidden": shape.hidden,
        "q": shape.q_size,
        "kv": shape.kv_size,
        "intermediate": shape.intermediate,
        "head_dim": shape.head_dim,
        "heads": shape.heads,
        "kv_heads": shape.kv_heads,
        "attn_chunk": attn_chunk,
        "tiles": int(bool(shape.weight_tiles)),
        "sum_split": sum_split(shape),
        "positions": shape.positions,
    }


def sum_split(shape: Shape) -> int:
    """SUM_SPLIT for a build: 2 for int8 groups of 16 (csrc Int8GroupTiles<16>), else 1."""
    return 2 if ("int8", 16) in shape.stage_formats() else 1


# ---- shared memory, in floats ---------------------------------------------------------------

# The longest input vector a stage reads (one position's).
XS = named("kXsFloats", emax(emax(H, Q), I))
CH = named("kAttnCh", D // 8)  # 16-byte chunks in a key or value row
GV = named("kAttnGv", T // CH)  # head units' P·V position groups
# Stage B's scratch, head units (attention.cuh): q, k, v [3D] | probabilities [THREADS] |
# per-group partial outputs [GV, D] | per-warp score maxima [WARPS] + per-group exp-sums [GV].
ATTN_SCRATCH_HEAD = named("kAttnScratchHead", 3 * D + T + GV * D + round4(W + GV))
# A pass's head units (attention_pass.cuh): the same with q, k, v [3D] one a query.
ATTN_SCRATCH_QUERIES = named("kAttnScratchQueries", 3 * P * D + T + GV * D + round4(W + GV))
# Group units (attention_group.cuh): running and stage max [4G] | k, v [2D] | exp-sums
# [THREADS / CH] | q [G, D] + padded q [G, 3D/2] + probabilities [G, PMAX], all three reused
# as the per-group partial outputs [NG, G, D] (<= 8 THREADS).
ATTN_SCRATCH_GROUP = named(
    "kAttnScratchGroup",
    4 * GROUP + 2 * D + round4(T // CH) + emax(GROUP * (5 * D // 2 + PMAX), 8 * T),
)
# A warp's split-K partials: SLOTS rows, or a tile GEMV's 8 tiles of 16 (gemv_tiles.cuh).
PART = named("kPartFloats", SLOTS + TILES * (8 * 16 - SPLIT_SLOTS))
# Stage D borrows the scratch: the split-K partials [WARPS, PART] | its normalised input [H] |
# the next norm's staged gain [H] | a tile GEMV's input sums [XS / 32 per SUM_SPLIT].
# A pass's D input is one [H] a position.
D_INPUT = named("kDInputFloats", W * PART + (P + 1) * H + TILES * SUM_SPLIT * XS // 32)
ATTN_SCRATCH = named("kAttnScratch", emax(emax(ATTN_SCRATCH_QUERIES, ATTN_SCRATCH_GROUP), D_INPUT))
# The same at one position: the reader merge's bound below must not move with the positions (a
# pass's attention is planned exactly as a step's).
ATTN_SCRATCH_STEP = named(
    "kAttnScratchStep",
    emax(
        emax(ATTN_SCRATCH_HEAD, ATTN_SCRATCH_GROUP), W * PART + 2 * H + TILES * SUM_SPLIT * XS // 32
    ),
)
RED_FLOATS = 64
# The K/V window: K and V rows [CHUNK, D] bf16 | the RoPE rows [P, D] (cos [P, D/2] | sin
# [P, D/2]: a pass's positions) | per ring stage an mbarrier (2 floats) and two counters.
WINDOW = named("kWindowFloats", ATTN_CHUNK * D + P * D + 4 * STAGES)
# Stage C's reader merge: ranges whose partials [ns, Q] fit xs and statistics [ns, NH, 4] the
# scratch.
MERGE_NS = named("kMergeNs", emin(XS // Q, ATTN_SCRATCH_STEP // (4 * NH)))


@dataclass(frozen=True, slots=True)
class Region:
    name: str
    floats: Expr
    doc: str


# In order; each region starts 16-byte aligned (every size above is a multiple of 4 floats
# except the window's tail, and the sampling scratch after it is rounded up).
SMEM: tuple[Region, ...] = (
    Region(
        "xs", P * XS, "the current stage's input vectors (the longest of H, Q, I), one a position"
    ),
    Region("xres", P * H, "the residual after attention, from stage D to E, one a position"),
    Region("att", ATTN_SCRATCH, "stage B's scratch; stage D's input and gain borrow it"),
    Region("red", lit(RED_FLOATS), "block reductions"),
    Region("window", WINDOW, "the K/V window ring (attention_window.cuh)"),
)
# After the regions above, rounded up to 4 floats: sampling's radix histograms (64-bit mass
# and 32-bit counts) and a few words.
SAMPLE_FLOATS = 256 * 2 + 256 + 16


def smem_bytes(shape: Shape, attn_chunk: int) -> int:
    """Dynamic shared memory of one CTA with a K/V window of ``attn_chunk`` positions."""
    e = env(shape, attn_chunk)
    before = sum(r.floats(e) for r in SMEM)
    return 4 * ((before + 3) // 4 * 4 + SAMPLE_FLOATS)


def max_attn_chunk(shape: Shape) -> int:
    """The most window positions shared memory leaves room for: a multiple of 32, at most
    512 (0 when not even 32 fit)."""
    e = env(shape)
    tail = WINDOW(e)  # the window without its rows (attn_chunk = 0)
    free = MAX_SMEM_BYTES // 4 - SAMPLE_FLOATS - 4 - tail  # 4: the rounding before sampling's
    free -= sum(r.floats(e) for r in SMEM if r.name != "window")
    return max(0, min(512, free // shape.head_dim // 32 * 32))


def merge_ranges(shape: Shape) -> int:
    """Head-unit ranges stage C's input load merges at most (MK_MERGE_NS)."""
    return MERGE_NS(env(shape))


# ---- the Params struct ----------------------------------------------------------------------

_PTR = ctypes.c_uint64


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    cxx: str  # C type
    ctype: type  # ctypes type (one element)
    doc: str  # shape and meaning
    count: int = 0  # array length; 0: a scalar

    @property
    def ctypes_type(self) -> type:
        return self.ctype * self.count if self.count else self.ctype


def _p(name: str, cxx: str, doc: str) -> Field:
    return Field(name, cxx, _PTR, doc)


class MatrixView(ctypes.Structure):
    """A streamed matrix's view (csrc/formats/format.cuh Matrix): its packed rows and, for a
    scaled format, its [rows] fp32 scales (0 otherwise)."""

    _fields_ = [("rows", ctypes.c_uint64), ("scales", ctypes.c_uint64)]


def _m(name: str, cxx: str, doc: str) -> Field:
    return Field(name, cxx, MatrixView, doc)


def matrix_view(m: PackedMatrix) -> MatrixView:
    """The kernel's view of a packed matrix (weights/formats: its data, then its scales)."""
    return MatrixView(m.data.data_ptr(), m.scales[0].data_ptr() if m.scales else 0)


LAYER_WEIGHTS: tuple[Field, ...] = (
    _m("wqkv", "QkvMatrix", "[Q + 2KV, H] q heads, k heads, v heads; attn_norm folded"),
    _p("bqkv", "const float*", "[Q + 2KV] or null"),
    _p("q_norm", "const float*", "[D] or null"),
    _p("k_norm", "const float*", "[D] or null"),
    _m("wo", "WeightMatrix", "[H, Q]"),
    _p("bo", "const float*", "[H] or null"),
    _m("wgu", "WeightMatrix", "[2I, H] row 2r = gate r, 2r+1 = up r; ffn_norm folded"),
    _m("wdown", "DownMatrix", "[H, I]"),
    _p("attn_gain", "const float*", "[H] or null (null: folded into wqkv)"),
    _p("ffn_gain", "const float*", "[H] or null (null: folded into wgu)"),
)

PARAMS: tuple[Field, ...] = (
    _p("layers", "const LayerWeights*", "[L]"),
    _p("embed", "const bf16*", "[V, H] unfolded"),
    _m("lm_head", "HeadMatrix", "[V, H] final norm folded (unless norm_gain)"),
    _p("norm_gain", "const float*", "[H] or null"),
    _p("rope_cos", "const float*", "[max_len, D/2]"),
    _p("rope_sin", "const float*", "[max_len, D/2]"),
    _p("k_cache", "bf16*", "[L, NKV, max_len, D]"),
    _p("v_cache", "bf16*", "[L, NKV, max_len, D]"),
    _p("x", "float*", "hand-off region x: [H] the residual stream"),
    _p("qkv", "float*", "hand-off region qkv: [Q + 2KV] projections before norm and RoPE"),
    _p("attn", "float*", "hand-off region attn: [slots, D] ranges' unnormalised outputs"),
    _p("attn_ml", "float*", "hand-off region attn_ml: [slots, 4] their max and exp-sum"),
    _p("delta", "float*", "hand-off region delta: [H] the O projection's output"),
    _p("attn_out", "float*", "hand-off region attn_out: [Q] the merged attention output"),
    _p("attn_count", "unsigned*", "[NH + NKV] ranges finished per head, then per KV head"),
    _p("act", "float*", "hand-off region act: [I] silu(gate) * up"),
    _p("logits", "float*", "[V] this step's logits"),
    _p("part_score", "float*", "[2 grid] each CTA's best score, or [grid] token words"),
    _p("part_id", "int*", "[grid] each CTA's best id"),
    _p("flags", "int*", "[FLAG_WORDS] see Flag"),
    _p("barrier", "unsigned*", "[barrier_words()] grid counter, then LM-head tickets"),
    _p("forced", "const int*", "[n_steps] each step's input token (teacher forcing) or null"),
    _p("debug_logits", "float*", "[n_steps, V] or null"),
    _p("stop_ids", "const int*", "[n_stop]"),
    _p("host_out", "volatile int*", "host-mapped: [0] count, [1] done, [2 + i] token i + 1"),
    _p("host_cancel", "volatile int*", "host-mapped: nonzero asks the kernel to stop"),
    _p("timing", "long long*", "[timing_words()] the profiled step's marks, or null"),
    _p(
        "mask",
        "const unsigned long long*",
        "[2, ceil(V/32)] grammar: step s's allowed ids in parity s&1, bits | tag << 32, or null",
    ),
    _p(
        "sample_part",
        "unsigned long long*",
        "[2, grid, SAMPLE_PART] each CTA's partials of a whole-vocabulary draw (sampling.cuh)",
    ),
    _p("logit_bias", "const float*", "[V_all] added to each logit (logit_bias), or null"),
    _p("seen", "unsigned*", "[V_all] penalties: 1 if in the prompt, + 2 a time generated; or null"),
    _p(
        "raw_logits",
        "float*",
        "[V_all] logits before the mask and penalties (logprobs; TP: rank 0 gathers them), or null",
    ),
    _p(
        "lp_out",
        "volatile float*",
        "host-mapped: [n_steps, LOGPROB_WORDS] each step's logprob, then (id bits, logprob) "
        "pairs; or null",
    ),
    _p(
        "history",
        "int*",
        "[max_len] the request's tokens by position: a pass build drafts from it and appends "
        "what it accepts (csrc/draft.cuh); or null",
    ),
    Field("max_len", "int", ctypes.c_int32, "cache positions"),
    Field("first_token", "int", ctypes.c_int32, "the first step's input token"),
    Field("start_pos", "int", ctypes.c_int32, "position of first_token"),
    Field("n_steps", "int", ctypes.c_int32, "tokens to produce at most"),
    Field("n_stop", "int", ctypes.c_int32, "stop ids"),
    Field("top_k", "int", ctypes.c_int32, "0: off"),
    Field("temperature", "float", ctypes.c_float, "0: greedy"),
    Field("top_p", "float", ctypes.c_float, "1: off"),
    Field("seed_lo", "unsigned", ctypes.c_uint32, "sampling seed, low word"),
    Field("seed_hi", "unsigned", ctypes.c_uint32, "sampling seed, high word"),
    Field("eps", "float", ctypes.c_float, "RMSNorm epsilon"),
    Field("timing_step", "int", ctypes.c_int32, "the step whose marks `timing` records"),
    Field("attn_splits", "int", ctypes.c_int32, "head units: ranges a head at most (grid/NH)"),
    Field("attn_group_splits", "int", ctypes.c_int32, "group units: ranges a KV head (grid/NKV)"),
    Field("attn_group_from", "int", ctypes.c_int32, "context from which group units are used"),
    Field("debug_stall_step", "int", ctypes.c_int32, "-1, or the step CTA 0 stalls at (tests)"),
    Field("debug_stall_hard", "int", ctypes.c_int32, "1: that stall ignores the cancel word"),
    Field("mask_tag", "unsigned", ctypes.c_uint32, "step s's mask carries tag mask_tag + s"),
    Field("presence", "float", ctypes.c_float, "presence_penalty (with seen)"),
    Field("frequency", "float", ctypes.c_float, "frequency_penalty (with seen)"),
    Field("repetition", "float", ctypes.c_float, "repetition_penalty (with seen; 1: off)"),
    Field("min_p", "float", ctypes.c_float, "0: off"),
    Field("n_logprobs", "int", ctypes.c_int32, "alternatives a step's lp_out record holds"),
    Field("pass_len", "int", ctypes.c_int32, "positions each pass computes (a pass build, MK_P)"),
    Field("draft_min", "int", ctypes.c_int32, "the shortest suffix a draft matches (n-gram)"),
    Field("draft_max", "int", ctypes.c_int32, "the longest suffix a draft matches (n-gram)"),
    Field("draft_exit", "int", ctypes.c_int32, "1: drafting ends where drafts stop paying"),
)

# Appended in a -DMK_TP=N build (tp.cuh): the peers' receive buffers and this rank's place.
PARAMS_TP: tuple[Field, ...] = (
    Field("tp_recv", "unsigned*", _PTR, "rank k's receive buffer (peer pointers)", TP_MAX_RANKS),
    _p("tp_mine", "unsigned*", "this rank's own buffer (== tp_recv[tp_rank])"),
    Field("tp_rank", "int", ctypes.c_int32, "this GPU's rank"),
    Field("vocab_start", "int", ctypes.c_int32, "global id of this rank's first LM-head row"),
    Field("tp_tag", "unsigned", ctypes.c_uint32, "first generation of this launch, never 0"),
    Field("tp_pad_", "int", ctypes.c_int32, "alignment"),
)


def _struct(name: str, fields: tuple[Field, ...], base: type = ctypes.Structure) -> type:
    return type(name, (base,), {"_fields_": [(f.name, f.ctypes_type) for f in fields]})


def c_offsets(fields: tuple[Field, ...], start: int = 0) -> dict[str, int]:
    """Each field's byte offset under C's rules (natural alignment), from ``start``."""
    out, at = {}, start
    for f in fields:
        size, align = ctypes.sizeof(f.ctype), ctypes.alignment(f.ctype)
        at = (at + align - 1) // align * align
        out[f.name] = at
        at += size * max(1, f.count)
    return out


def c_sizeof(fields: tuple[Field, ...]) -> int:
    last = fields[-1]
    end = c_offsets(fields)[last.name] + ctypes.sizeof(last.ctype) * max(1, last.count)
    align = max(ctypes.alignment(f.ctype) for f in fields)
    return (end + align - 1) // align * align


# ctypes mirrors of the structs (launcher.py passes KernelParams to the launch).
LayerWeightsStruct = _struct("LayerWeightsStruct", LAYER_WEIGHTS)
KernelParams = _struct("KernelParams", PARAMS)
KernelParamsTP = _struct("KernelParamsTP", PARAMS_TP, KernelParams)  # a -DMK_TP=N build's


def layer_pointers(layer: LayerPack) -> list[int]:
    """One layer's row of the LayerWeights table, in the struct's order, as 64-bit words: a
    matrix's view is two (its data and its scales, formats/format.cuh), every other field one
    pointer (0 for None) (weights/repack.py's layers)."""
    words: list[int] = []
    for f in LAYER_WEIGHTS:
        if f.ctype is MatrixView:
            view = matrix_view(layer.matrices[f.name])
            words += [view.rows, view.scales]
        else:
            t = getattr(layer, f.name)
            words.append(0 if t is None else t.data_ptr())
    return words


# ---- the timing buffer (Params::timing, int64 slots) ----------------------------------------

# Per layer, two clock64 marks a stage: after its own work, and after its hand-off wait.
LAYER_STAGES: tuple[tuple[str, str], ...] = (
    ("attn_norm_qkv", "A"),
    ("attention", "B"),
    ("o_proj", "C"),
    ("mlp_gate_up", "D"),
    ("mlp_down", "E"),
)
LAYER_MARKS: tuple[str, ...] = tuple(
    f"{stage}.{what}" for stage, _ in LAYER_STAGES for what in ("work", "wait")
)
# Once a step: clock64 marks around the layers, then two globaltimer readings (ns) that turn
# the clock64 marks into time.
STEP_MARKS_BEFORE: tuple[str, ...] = ("step.start",)
STEP_MARKS_AFTER: tuple[str, ...] = (
    "lm_head.work",
    "lm_head.wait",
    "sample.work",
    "step.end_ns",
    "step.start_ns",
)


def mark_slot(name: str, layer: int = 0, layers: int | None = None) -> int:
    """The slot of mark ``name``: a per-layer mark of ``layer``, or a step mark (those after
    the layers need ``layers``, the model's layer count)."""
    if name in STEP_MARKS_BEFORE:
        return STEP_MARKS_BEFORE.index(name)
    first = len(STEP_MARKS_BEFORE)
    if name in LAYER_MARKS:
        return first + len(LAYER_MARKS) * layer + LAYER_MARKS.index(name)
    if name in STEP_MARKS_AFTER:
        if layers is None:
            raise ValueError(f"mark {name!r} comes after the layers: give `layers`")
        return first + len(LAYER_MARKS) * layers + STEP_MARKS_AFTER.index(name)
    raise KeyError(f"no timing mark {name!r}")


# The stage-skew probe build (-DMK_SKEW=1, tools/stage_skew.py): every CTA records the global
# time (ns) at these points of the profiled step's middle layer, after the marks.
SKEW_NAMES: tuple[str, ...] = (
    "attn_norm_qkv.input",
    "attn_norm_qkv.done",
    "attention.done",
    "o_proj.input",
    "o_proj.done",
    "mlp_gate_up.input",
    "mlp_gate_up.done",
    "mlp_down.input",
    "mlp_down.done",
    "attention.qkv_in",  # head units: q, k, v and the K/V window in shared memory
    "attention.scores",  # head units
    "attention.softmax",  # head units
)
SKEW_POINTS = len(SKEW_NAMES)


def mark_words(layers: int) -> int:
    """Slots of the marks: where the stage-skew probe's area starts."""
    return len(STEP_MARKS_BEFORE) + len(LAYER_MARKS) * layers + len(STEP_MARKS_AFTER)


def timing_words(layers: int, grid: int, skew: bool = False) -> int:
    """int64 slots of the timing buffer: the marks, and with a -DMK_SKEW=1 build
    SKEW_POINTS global times a CTA after them (csrc/probes.cuh)."""
    return mark_words(layers) + (SKEW_POINTS * grid if skew else 0)


def skew_slot(layers: int, cta: int, point: str) -> int:
    """The slot of CTA ``cta``'s skew point ``point`` (a SKEW_NAMES entry)."""
    return mark_words(layers) + SKEW_POINTS * cta + SKEW_NAMES.index(point)


# ---- words of small buffers -----------------------------------------------------------------

FLAGS: tuple[tuple[str, str], ...] = (
    ("cancel", "the host's cancel word as seen at the step's barrier (barrier path)"),
    ("drafted", "a pass build's drafted tokens so far (the host CTA's count)"),
    ("accepted", "a pass build's accepted drafts so far (the host CTA's count)"),
    ("verified", "a pass build's passes that carried a draft (the host CTA's count)"),
)
FLAG_WORDS = 4  # int32 words of Params::flags


def barrier_words() -> int:
    """int32 words of Params::barrier: [0] the grid barrier's counter, then one LM-head
    ticket counter a warp slot at TICKET_STRIDE (1 + w), each on its own 128-byte line."""
    return TICKET_STRIDE * (1 + WARPS)


def token_words(grid: int, positions: int = 1) -> tuple[int, int]:
    """(float32 words of Params::part_score, int32 words of Params::part_id) on ``grid``
    CTAs: each CTA's best (score, id), or in part_score one tagged 64-bit word a CTA and
    position of a pass."""
    return 2 * grid * positions, grid


HOST_OUT_HEAD = 2  # host_out: [0] steps done, [1] done flag, then one word a token


def host_out_words(n_steps: int) -> int:
    return HOST_OUT_HEAD + n_steps


# Params::sample_part: 64-bit words a CTA's slot holds (a 256-bin histogram).
SAMPLE_PART = 256


def sample_part_words(grid: int) -> int:
    """64-bit words of Params::sample_part: two halves (by grid-barrier parity) of a slot a
    CTA."""
    return 2 * grid * SAMPLE_PART


MAX_LOGPROBS = 20  # alternatives an lp_out record holds (sampling.MAX_LOGPROBS)
# lp_out: a step's record, written before its token word: the token's log-probability, then
# (id as int bits, log-probability) for the n_logprobs most likely ids, largest first.
LOGPROB_WORDS = 1 + 2 * MAX_LOGPROBS


def tp_reduce_bytes(tp: int, hidden: int) -> int:
    """The reduction area at the start of a rank's receive buffer (csrc/tp.cuh): [2 parities]
    [tp ranks][FLOW_COPIES][hidden] tagged flow words, zeroed before each launch."""
    return 2 * tp * FLOW_COPIES * hidden * 4


def tp_recv_bytes(tp: int, hidden: int, vocab: int) -> int:
    """One rank's receive buffer (csrc/tp.cuh): the reduction area (tp_reduce_bytes), [2][tp]
    16-byte token units, the whole ``vocab``'s logits as [2][vocab] {value, tag} pairs
    (top-k / top-p), the rank's untagged copy of them [vocab] fp32 (padded to 8 bytes), and
    the raw logits for logprobs as [2][vocab] pairs."""
    return (
        tp_reduce_bytes(tp, hidden)
        + 2 * tp * 16
        + 2 * vocab * 8
        + (vocab + 1) // 2 * 8
        + 2 * vocab * 8
    )


# ---- the hand-off buffer --------------------------------------------------------------------


class Config(Protocol):
    """What the hand-off layout needs of a model config (models/config.py ModelConfig)."""

    hidden_size: int
    q_size: int
    kv_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class HandoffRegion:
    """One tagged vector (csrc/flow.cuh) in the hand-off buffer: ``floats`` in one copy,
    ``copies`` back to back (the kernel finds copy c at c * floats)."""

    name: str
    floats: int
    copies: int

    @property
    def total(self) -> int:
        return self.floats * self.copies


def attention_slots(cfg: Config, grid: int) -> int:
    """Partial-attention slots: head units split a query head over at most grid // heads
    ranges, group units a KV head's group over grid // kv_heads (attention_window.cuh)."""
    return cfg.num_heads * max(grid // cfg.num_heads, grid // cfg.num_kv_heads)


def handoff_regions(cfg: Config, grid: int, positions: int = 1) -> tuple[HandoffRegion, ...]:
    """The hand-off buffer's regions, in order, for ``cfg`` on ``grid`` CTAs: in a copy, one
    vector a position of a pass ([positions, n]). qkv has one copy: only the attention units
    read it."""
    slots = attention_slots(cfg, grid)
    c, n = FLOW_COPIES, positions
    return (
        HandoffRegion("x", n * cfg.hidden_size, c),
        HandoffRegion("qkv", n * (cfg.q_size + 2 * cfg.kv_size), 1),
        HandoffRegion("delta", n * cfg.hidden_size, c),
        HandoffRegion("attn_out", n * cfg.q_size, c),
        HandoffRegion("act", n * cfg.intermediate_size, c),
        HandoffRegion("attn", n * slots * cfg.head_dim, c),
        HandoffRegion("attn_ml", n * slots * 4, c),
    )


# ---- the generated header -------------------------------------------------------------------


def _constant(name: str, cxx: str) -> str:
    line = f"constexpr int {name} = {cxx};"
    return line if len(line) <= 100 else f"constexpr int {name} =\n    {cxx};"


def _camel(name: str) -> str:
    return "".join(p[:1].upper() + p[1:] for p in name.replace(".", "_").split("_"))


def _struct_cxx(name: str, fields: tuple[Field, ...], indent: str = "  ") -> list[str]:
    width = max(len(f"{f.cxx} {f.name}{f'[{f.count}]' if f.count else ''};") for f in fields)
    out = []
    for f in fields:
        decl = f"{f.cxx} {f.name}{f'[{f.count}]' if f.count else ''};"
        out.append(f"{indent}{decl:<{width + 2}}// {f.doc}")
    return out


def _asserts(struct: str, fields: tuple[Field, ...], offsets: dict[str, int]) -> list[str]:
    return [
        f'static_assert(offsetof({struct}, {f.name}) == {offsets[f.name]}, "layout.py");'
        for f in fields
    ]


def header() -> str:
    """The text of csrc/layout.cuh."""
    base = c_offsets(PARAMS)
    tail = c_offsets(PARAMS_TP, c_sizeof(PARAMS))
    lines = [
        "// GENERATED by `python -m monokernel.kernels.layout` from kernels/layout.py: do not",
        "// edit (kernels/test_layout.py checks it is current). What the host and the decode",
        "// kernel share: Params, the timing marks, the small buffers' words, shared memory.",
        "#pragma once",
        "#include <cstddef>",
        "",
        '#include "dims.cuh"',
        '#include "formats/format.cuh"',
        "",
        "// ---- tunables the layout depends on (tunables.cuh) ----",
        *(f'static_assert({k} == {v}, "layout.py: {k}");' for k, v in TUNABLES.items()),
        f'static_assert(MK_TP_MAX == {TP_MAX_RANKS}, "layout.py: TP_MAX_RANKS");',
        "// A weight matrix's view is its rows and its scales (layout.py MatrixView).",
        *(
            f'static_assert(sizeof({t}) == {ctypes.sizeof(MatrixView)}, "layout.py: MatrixView");'
            for t in ("WeightMatrix", "QkvMatrix", "DownMatrix", "HeadMatrix")
        ),
        "",
        "// ---- the kernel's argument; launcher.py's ctypes structs come from the same table ----",
        "struct LayerWeights {  // one a layer, in a device array",
        *_struct_cxx("LayerWeights", LAYER_WEIGHTS),
        "};",
        "",
        "struct Params {",
        *_struct_cxx("Params", PARAMS),
        "#if MK_TP > 1",
        *_struct_cxx("Params", PARAMS_TP),
        "#endif",
        "};",
        *_asserts("LayerWeights", LAYER_WEIGHTS, c_offsets(LAYER_WEIGHTS)),
        *_asserts("Params", PARAMS, base),
        "#if MK_TP > 1",
        *_asserts("Params", PARAMS_TP, tail),
        f'static_assert(sizeof(Params) == {c_sizeof(PARAMS + PARAMS_TP)}, "layout.py");',
        "#else",
        f'static_assert(sizeof(Params) == {c_sizeof(PARAMS)}, "layout.py");',
        "#endif",
        "",
        "// ---- Params::timing: int64 slots of the profiled step (probes.cuh) ----",
        "// Per layer, two clock64 marks a stage: after its own work and after its hand-off.",
        "enum LayerMark : int {",
        *(f"  kMark{_camel(m)} = {i}," for i, m in enumerate(LAYER_MARKS)),
        "};",
        f"constexpr int kMarksPerLayer = {len(LAYER_MARKS)};",
        f"constexpr int kMarkLayer0 = {len(STEP_MARKS_BEFORE)};",
        "__device__ __forceinline__ int mark_slot(LayerMark m, int layer) {",
        "  return kMarkLayer0 + kMarksPerLayer * layer + (int)m;",
        "}",
        "// Once a step, before and after the layers (the _ns ones are globaltimer readings).",
        *(f"constexpr int kMark{_camel(m)} = {i};" for i, m in enumerate(STEP_MARKS_BEFORE)),
        *(
            f"constexpr int kMark{_camel(m)} = kMarkLayer0 + kMarksPerLayer * MK_L + {i};"
            for i, m in enumerate(STEP_MARKS_AFTER)
        ),
        f"constexpr int kMarkWords = kMarkLayer0 + kMarksPerLayer * MK_L + "
        f"{len(STEP_MARKS_AFTER)};",
        "// The stage-skew probe build's area: kSkewPoints slots a CTA from kMarkWords, at the",
        "// middle layer of the profiled step.",
        "enum SkewPoint : int {",
        *(f"  kSkew{_camel(m)} = {i}," for i, m in enumerate(SKEW_NAMES)),
        "};",
        f"constexpr int kSkewPoints = {SKEW_POINTS};",
        "constexpr int kSkewBase = kMarkWords;",
        "",
        "// ---- small buffers' words ----",
        "enum Flag : int {  // Params::flags",
        *(f"  kFlag{_camel(n)} = {i},  // {doc}" for i, (n, doc) in enumerate(FLAGS)),
        "};",
        f"constexpr int kFlagWords = {FLAG_WORDS};",
        f"constexpr int kSamplePart = {SAMPLE_PART};  // sample_part: words a CTA's slot",
        f"constexpr int kMaxLogprobs = {MAX_LOGPROBS};  // lp_out: alternatives a record",
        f"constexpr int kLogprobWords = {LOGPROB_WORDS};  // lp_out: words a step",
        "// Params::barrier: [0] the grid counter, then LM-head ticket counter w at",
        "// kTicketStride * (1 + w).",
        "constexpr int kBarrierWords = kTicketStride * (1 + kWarps);",
        f"constexpr int kHostOutHead = {HOST_OUT_HEAD};  // host_out: count, done, then tokens",
        "",
        "// ---- shared memory, in floats from the start of the dynamic allocation ----",
        *(_constant(name, x.cxx) for name, x in NAMED),
    ]
    prev = "0"
    for r in SMEM:
        lines += [f"// {r.doc}", f"constexpr int kSmem{_camel(r.name)} = {prev};"]
        prev = f"kSmem{_camel(r.name)} + {r.floats.cxx}"
    lines += [
        "// sampling's scratch (sampling.cuh SampleScratch)",
        f"constexpr int kSmemSample = ({prev} + 3) / 4 * 4;",
        f"constexpr int kSmemFloats = kSmemSample + {SAMPLE_FLOATS};",
        "// Inside att while stage D uses it: split-K partials | D's input | the staged gain |",
        "// a tile GEMV's input sums.",
        "constexpr int kAttPart = 0;",
        "constexpr int kAttXd = kWarps * kPartFloats;",
        "constexpr int kAttGain = kAttXd + MK_P * MK_H;",
        "constexpr int kAttSums = kAttGain + MK_H;",
        "static_assert(kAttSums + MK_TILES * MK_SUM_SPLIT * kXsFloats / 32 == kDInputFloats,",
        '              "layout.py: D_INPUT");',
        "// build.py computed the same total from layout.py.",
        'static_assert(4 * kSmemFloats == MK_SMEM_BYTES, "layout.py: shared memory");',
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Rewrite csrc/layout.cuh (``--check``: exit 1 if it is not current)."""
    text = header()
    if "--check" in argv:
        return 0 if HEADER.read_text() == text else 1
    HEADER.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
