"""JIT build of the monokernel: nvcc -> cubin, specialised on the model's dimensions, cached.

The cubin's cache key hashes the sources, the -D dimensions, the flags and the target arch,
so any change rebuilds and nothing stale is ever loaded. Two processes building the same key
at once are safe: a file lock serialises them, and the cubin is written to a temporary name
then renamed into place (readers never see a half-written file).

Environment: ``MONOKERNEL_CACHE`` (cache root, default ``~/.cache/monokernel``; cubins go in
its ``kernels/``),
``MONOKERNEL_VERBOSE_BUILD=1`` (print the nvcc command and the ptxas -v report),
``MONOKERNEL_DEBUG_BUILD=1`` (-lineinfo -G and device asserts), ``MONOKERNEL_NVCC``
(compiler path), ``MONOKERNEL_NVCC_FLAGS`` (extra flags, e.g. tuning -D defines).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from monokernel.errors import BackendUnavailableError, UnsupportedModelError
from monokernel.kernels.plan import head_units_fit
from monokernel.models.config import ModelConfig

CSRC = Path(__file__).parent / "csrc"
ENTRY = "decode.cu"
KERNEL_NAME = "mk_decode"
ARCH_FLAGS = ("-gencode=arch=compute_90a,code=sm_90a",)
THREADS = 512  # MK_THREADS in common.cuh
WARPS = THREADS // 32
TICKET_STRIDE = 32  # MK_TICKET_STRIDE in drawn_rows.cuh: words between ticket counters
BATCH = 6  # MK_BATCH in gemv.cuh
# Loads a lane keeps in flight per pipelined down-projection row (down_split): two rows of
# 4 are 64 KB a SM at 16 warps.
MAX_DOWN_LOADS = 4
# SMs of the GPUs the kernel is tuned on (H100 SXM, H200); only down_split's rows-per-unit
# rule uses it: the grid itself is the device's SM count, read at launch.
HOPPER_SMS = 132
SPLIT_SLOTS = 32  # MK_SPLIT_SLOTS in gemv.cuh: split-K partials per warp
MAX_HEAD_DIM = 256
MAX_SMEM_BYTES = 227 * 1024  # dynamic shared memory one CTA may have on sm_90
ATTN_STAGES = 2  # MK_ATTN_STAGES in attention_window.cuh: ring stages of the K/V window
ATTN_PMAX = 256  # MK_ATTN_PMAX: positions per ring stage at most


@dataclass(frozen=True, slots=True)
class KernelDims:
    """The compile-time shape of one kernel build (the -D defines)."""

    hidden: int
    q_size: int
    kv_size: int
    intermediate: int
    vocab: int
    layers: int
    head_dim: int
    heads: int
    kv_heads: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    # Tensor-parallel ranks (MK_TP); the other dims are then one rank's. 1 adds no define,
    # so the single-GPU build (and its cache key) is exactly what it was.
    tp: int = 1
    # False: the build without group units (MK_ATTN_GROUP=0), for contexts head units cover.
    group_units: bool = True

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> KernelDims:
        check_supported(cfg)
        dims = cls(
            hidden=cfg.hidden_size,
            q_size=cfg.q_size,
            kv_size=cfg.kv_size,
            intermediate=cfg.intermediate_size,
            vocab=cfg.vocab_size,
            layers=cfg.num_layers,
            head_dim=cfg.head_dim,
            heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            qkv_bias=cfg.qkv_bias,
            o_bias=cfg.o_bias,
            qk_norm=cfg.qk_norm,
        )
        if dims.attn_chunk() < 32:
            raise UnsupportedModelError(
                f"the monokernel's shared memory ({MAX_SMEM_BYTES} bytes a CTA) cannot hold "
                f"this shape's vectors and an attention window of 32 positions "
                f"(hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, "
                f"head_dim {cfg.head_dim})"
            )
        return dims

    def defines(self) -> list[str]:
        vals = {
            "MK_H": self.hidden,
            "MK_Q": self.q_size,
            "MK_KV": self.kv_size,
            "MK_I": self.intermediate,
            "MK_V": self.vocab,
            "MK_L": self.layers,
            "MK_D": self.head_dim,
            "MK_NH": self.heads,
            "MK_NKV": self.kv_heads,
            "MK_QKV_BIAS": int(self.qkv_bias),
            "MK_O_BIAS": int(self.o_bias),
            "MK_QK_NORM": int(self.qk_norm),
            "MK_SPLIT_E": self.down_split(),
            "MK_BATCH2": self.gate_up_batch(),
            "MK_D_PRE": self.gate_up_rows_before_input(),
            "MK_F_DRAWN": self.lm_head_drawn_rows(),
            "MK_ATTN_CHUNK": self.attn_chunk(),
            "MK_ATTN_RANGE": self.attn_range(),
        }
        if self.tp > 1:
            vals["MK_TP"] = self.tp
        if not self.group_units:
            vals["MK_ATTN_GROUP"] = 0
        return [f"-D{k}={v}" for k, v in vals.items()]

    def down_split(self) -> int:
        """Warps per row of the down projection: the fewest that make each warp's slice one
        batch of loads (<= BATCH per lane), so rows pipeline without a third buffer; but half
        that where two such batches in flight (the pipelined rows) would hold more than
        MAX_DOWN_LOADS loads a lane (beyond ~30 KB a SM, bytes in flight only queue:
        docs/perf-notes.md step 39) and the wider slices still leave every unit two rows or
        more on 132 SMs (fewer rows than units leave warps idle). Measured on an H100 (step
        50): Qwen2.5-Coder-1.5B (intermediate 8,960; 5 loads a lane at 8 warps a row, 2.9 rows
        a unit at 4) 1,259.1 / 1,260.1 / 1,264.9 µs/token with 4 against 1,277.5 / 1,279.1
        with 8; Qwen3-0.6B (3,072; 6 loads at 2, 0.5 rows a unit at 1) 930.3 with 2 against
        996.8 with 1, so it keeps 2; Llama-3.2-1B (8,192; 4 loads at 8) keeps 8 (935.8 / 935.9
        with 4 against 932.9)."""
        chunks = self.intermediate // 8
        for split in (1, 2, 4, 8, 16):
            loads = -(-chunks // split // 32)  # a lane's loads in one row slice
            if chunks % split or loads > BATCH:
                continue
            half = split // 2
            if loads > MAX_DOWN_LOADS and half and self.hidden >= 2 * HOPPER_SMS * (WARPS // half):
                return half
            return split
        return 16 if chunks % 16 == 0 else 1

    def gate_up_batch(self) -> int:
        """Loads per lane in flight per gate/up row (MK_BATCH2): 5 for hidden >= 2048 in the
        build without group units, 3 for hidden 1536-2047 there, else 4. Measured on an H100
        (docs/perf-notes.md, step 22): Llama-3.2-1B 1,016 vs 1,032 and 1,021 vs 1,033 µs/token
        with 5; Qwen2.5-Coder-1.5B (hidden 1536) 1,480 vs 1,456, its build spilling 52 bytes
        with 5. Step 50, once D's whole first pair goes out before its hand-off: Qwen 1,259.0 /
        1,258.8 and 1,258.6 / 1,258.6 with 3 against 1,262.2 / 1,261.6 and 1,261.8 / 1,260.9
        with 4 (two processes); the smaller shapes are unmeasured and keep 4. The build with
        group units carries more registers already (Llama's spills 52 -> 68 bytes with 5):
        kept at 4."""
        if self.group_units:
            return 4
        if self.hidden >= 2048:
            return 5
        return 3 if self.hidden >= 1536 else 4

    def gate_up_rows_before_input(self) -> int:
        """MK_D_PRE: rows of stage D's first gate/up pair issued before the hand-off C -> D
        (csrc/decode.cu): 2 for hidden >= 1536, else 1 (the smaller shapes are unmeasured
        and keep the old value). Measured on an H100 since D's input settles through
        registers (docs/perf-notes.md step 47): Llama-3.2-1B -4, -8 and -8.5 µs/token with 2
        against 1 (three machines); Qwen2.5-Coder-1.5B (hidden 1536) -1 to +7 then, and -4.8
        in two processes once its down projection went to 4 warps a row (step 50); with 1
        against 2 before step 46 (step 39) Qwen -13 to -16."""
        return 2 if self.hidden >= 1536 else 1

    def lm_head_drawn_rows(self) -> int:
        """MK_F_DRAWN: LM-head rows a warp takes, on average, from the tail dealt by tickets
        at run time (csrc/drawn_rows.cuh; 0: every row dealt statically): 8 below hidden
        2048 on one GPU, else 0 (the smaller shapes are unmeasured; the odd test shape, whose
        whole vocabulary is a tail, keeps that path tested; the TP build, not run on two GPUs
        since, keeps the static deal). Measured on an H100, one backend
        (docs/perf-notes.md step 59): Qwen2.5-Coder-1.5B 1,244.1 / 1,242.2 µs/token with 8
        against 1,246.5 / 1,244.7 without (16: 1,244.0 / 1,241.8; 4 1,242.6); Llama-3.2-1B
        927.2 against 926.0 (16: 927.4)."""
        return 8 if self.hidden < 2048 and self.tp == 1 else 0

    def _attn_scratch_floats(self) -> int:
        """MK_ATTN_SMEM: the larger scratch of stage B's two unit kinds (stage D's input
        vector and the staged norm gain borrow it too)."""
        d, group = self.head_dim, self.heads // self.kv_heads
        gv = THREADS // (d // 8)
        head_units = 3 * d + THREADS + gv * d + (THREADS // 32 + gv + 3) // 4 * 4
        lsum = (THREADS // (d // 8) + 3) // 4 * 4
        pmax = built_knob("MK_ATTN_PMAX", ATTN_PMAX)
        group_units = 4 * group + 2 * d + lsum + max(group * (5 * d // 2 + pmax), 8 * THREADS)
        # Stage D's normalised input sits after the split-K partials (decode.cu: xd), the
        # next norm's staged gain after it (gn).
        d_input = THREADS // 32 * SPLIT_SLOTS + 2 * self.hidden
        return max(head_units, group_units, d_input)

    def _fixed_smem_floats(self) -> int:
        xs = max(self.hidden, self.q_size, self.intermediate)
        return xs + self.hidden + self._attn_scratch_floats() + 64

    def attn_chunk(self) -> int:
        """Positions of one attention range held in shared memory (K and V, bf16): as many as
        the CTA's shared memory leaves room for, a multiple of 32, at most 512."""
        tail = 256 * 8 + 256 * 4 + 16 * 4 + 16  # sampling scratch, alignment
        free = (MAX_SMEM_BYTES - tail) // 4 - self._fixed_smem_floats() - self.window_tail_floats()
        return max(0, min(512, free // self.head_dim // 32 * 32))

    def window_tail_floats(self) -> int:
        """After the window's K and V rows: the RoPE row, one mbarrier (2 floats) and two
        counters per ring stage."""
        return self.head_dim + 4 * built_knob("MK_ATTN_STAGES", ATTN_STAGES)

    def built_attn_chunk(self) -> int:
        """The window the build really has: attn_chunk(), unless MONOKERNEL_NVCC_FLAGS
        overrides MK_ATTN_CHUNK (tests do, to force small windows)."""
        return built_knob("MK_ATTN_CHUNK", self.attn_chunk())

    def attn_range(self) -> int:
        """MK_ATTN_RANGE: positions per head-unit range at short context (attention_window.cuh):
        4 x THREADS / CHP positions (CHP = the 16-byte chunks of a key row rounded up to a
        power of two): one score pass of the unit's 4 chains (MK_ATTN_U), 256 at head_dim 64,
        128 at 128. Measured on an H100 (docs/perf-notes.md, step 23): Qwen2.5-Coder-1.5B 1,418 /
        1,449 µs/token with 128 against 1,469 / 1,473 with one range per window; Llama-3.2-1B
        1,010 with 256 against 1,014 (neutral)."""
        chp = 2
        while chp < self.head_dim // 8:
            chp *= 2
        return 2 * (2 * THREADS // chp)

    def built_attn_range(self) -> int:
        """The range the build really has (MONOKERNEL_NVCC_FLAGS may override it)."""
        return built_knob("MK_ATTN_RANGE", self.attn_range())

    def merge_ranges(self) -> int:
        """MK_MERGE_NS: head-unit ranges stage C's input load merges at most (partials
        [ns, Q] in the input vector's shared memory, statistics [ns, heads, 4] in stage B's
        scratch)."""
        xs = max(self.hidden, self.q_size, self.intermediate)
        return min(xs // self.q_size, self._attn_scratch_floats() // (4 * self.heads))

    def head_units_cover(self, context: int, heads_splits: int) -> bool:
        """Whether stage B's plan (attention_window.cuh) uses head units only, up to
        ``context`` positions, given ``heads_splits`` = grid // heads."""
        return head_units_fit(context, self.built_attn_chunk(), heads_splits)

    def smem_bytes(self) -> int:
        """Dynamic shared memory of one CTA; mirrors the layout comment in decode.cu."""
        window = self.attn_chunk() * self.head_dim + self.window_tail_floats()
        floats_a = (self._fixed_smem_floats() + window + 3) & ~3
        return floats_a * 4 + 256 * 8 + 256 * 4 + 16 * 4


def built_knob(name: str, default: int) -> int:
    """A -D define's value as the build will see it: ``default`` unless MONOKERNEL_NVCC_FLAGS
    overrides it (tests force small windows and ranges so; the knobs that change the
    shared-memory layout, the window's ring stages MK_ATTN_STAGES and their size bound
    MK_ATTN_PMAX, are sized from this)."""
    m = re.search(rf"-D{name}=(\d+)", os.environ.get("MONOKERNEL_NVCC_FLAGS", ""))
    return int(m.group(1)) if m else default


FLOW_COPIES = 2  # MK_FLOW_COPIES in csrc/flow.cuh


def flow_copies() -> int:
    """Copies of each hand-off vector that every CTA reads (csrc/flow.cuh: x, delta, act,
    attn_out, the reader merge's partials), which the host allocates back to back."""
    return built_knob("MK_FLOW_COPIES", FLOW_COPIES)


def check_supported(cfg: ModelConfig) -> None:
    """Refuse, with the reason, any shape the kernel cannot run exactly."""
    d = cfg.head_dim
    biggest = max(cfg.hidden_size, cfg.q_size, cfg.intermediate_size)
    if biggest > 24576:
        raise UnsupportedModelError(
            "the monokernel keeps one layer's input vector in shared memory, so hidden, "
            f"q and intermediate sizes must be at most 24576; got {biggest}"
        )
    if d % 8 or d > MAX_HEAD_DIM:
        raise UnsupportedModelError(
            f"the monokernel needs head_dim to be a multiple of 8 and at most {MAX_HEAD_DIM}; "
            f"got {d}"
        )
    group = cfg.num_heads // cfg.num_kv_heads
    if d // 8 * group > THREADS:
        raise UnsupportedModelError(
            "the monokernel's long-context attention gives one thread to each 16-byte chunk of "
            f"a query group's outputs, so head_dim / 8 x (heads / kv_heads) must be at most "
            f"{THREADS}; got {d // 8} x {group}"
        )
    for name, size in (
        ("hidden_size", cfg.hidden_size),
        ("intermediate_size", cfg.intermediate_size),
    ):
        if size % 8:
            raise UnsupportedModelError(
                f"the monokernel needs {name} to be a multiple of 8 (16-byte loads); got {size}"
            )


def cache_dir() -> Path:
    from monokernel.weights.default_model import cache_root  # one root for models and kernels

    return cache_root() / "kernels"


def find_nvcc() -> str:
    cand = os.environ.get("MONOKERNEL_NVCC") or shutil.which("nvcc")
    if not cand:
        cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
        path = Path(cuda_home) / "bin" / "nvcc"
        cand = str(path) if path.is_file() else None
    if not cand:
        raise BackendUnavailableError(
            "the monokernel is built at first use with nvcc, which was not found "
            "(set MONOKERNEL_NVCC or CUDA_HOME, or put nvcc on PATH)"
        )
    return cand


def _flags(debug: bool) -> list[str]:
    flags = ["-O3", "-std=c++17", *ARCH_FLAGS, "-cubin"]
    # Tuning knobs for experiments, e.g. "-DMK_PF_PAIRS=1" or a smaller "-DMK_ATTN_CHUNK=64"
    # (part of the cache key; they come after the dimensions, so they win).
    flags += os.environ.get("MONOKERNEL_NVCC_FLAGS", "").split()
    if debug:
        flags += ["-lineinfo", "-G", "-DMK_DEBUG=1"]
    return flags


def _source_digest() -> str:
    h = hashlib.sha256()
    for f in sorted(CSRC.glob("*.cu*")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def nvcc_command(dims: KernelDims, out: Path, debug: bool = False) -> list[str]:
    flags = _flags(debug)
    base = [f for f in flags if not f.startswith("-D")]
    knobs = [f for f in flags if f.startswith("-D")]
    return [
        find_nvcc(),
        *base,
        "-Xptxas",
        "-v",
        *_defines(dims, knobs),
        "-o",
        str(out),
        str(CSRC / ENTRY),
    ]


def _defines(dims: KernelDims, knobs: Sequence[str]) -> list[str]:
    """The shape's -D defines, then the knobs' -D defines; a knob replaces the shape's value
    of the same define (tests force small windows, variant runs flip tuning choices)."""
    names = {k.split("=")[0] for k in knobs}
    return [*(d for d in dims.defines() if d.split("=")[0] not in names), *knobs]


def compile_check(
    dims: KernelDims, out: Path, extra: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    """Compile the decode kernel for ``dims`` to an object file (no cache, no -Xptxas report):
    what the CI tests run to keep every shape's build green without a GPU. ``extra``: more
    nvcc flags, e.g. a tuning knob's non-default -D define."""
    cmd = [
        find_nvcc(),
        *ARCH_FLAGS,
        "-c",
        *_defines(dims, [f for f in extra if f.startswith("-D")]),
        *(f for f in extra if not f.startswith("-D")),
        "-o",
        str(out),
        str(CSRC / ENTRY),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def cubin_path(dims: KernelDims, debug: bool | None = None) -> Path:
    if debug is None:
        debug = os.environ.get("MONOKERNEL_DEBUG_BUILD") == "1"
    key = hashlib.sha256(
        "\n".join([_source_digest(), *dims.defines(), *_flags(debug)]).encode()
    ).hexdigest()[:24]
    return cache_dir() / f"mk_decode-{key}.cubin"


def build(dims: KernelDims, debug: bool | None = None) -> Path:
    """The cubin for ``dims``, compiled now unless the cache already holds it."""
    if debug is None:
        debug = os.environ.get("MONOKERNEL_DEBUG_BUILD") == "1"
    return compile_cached(
        cubin_path(dims, debug), lambda out: nvcc_command(dims, out, debug), "the monokernel"
    )


def compile_cached(target: Path, command: Callable[[Path], list[str]], what: str) -> Path:
    """``target``, compiled by ``command(tmp_path)`` unless it exists already. A file lock
    serialises concurrent builders; the result is renamed into place whole."""
    if target.is_file():
        return target
    verbose = os.environ.get("MONOKERNEL_VERBOSE_BUILD") == "1"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():  # another process finished it while we waited
            return target
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        cmd = command(tmp)
        if verbose:
            print(f"building {what}:", " ".join(cmd), file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if verbose:
            print(proc.stdout + proc.stderr, file=sys.stderr)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise BackendUnavailableError(
                f"nvcc failed building {what} ({' '.join(cmd)}):\n{proc.stderr[-4000:]}"
            )
        os.replace(tmp, target)
    return target
