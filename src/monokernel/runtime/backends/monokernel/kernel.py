"""The decode kernel on one GPU: its builds, the device buffers it works in, its Params, and
the one launch path.

Every size and order the host shares with the kernel comes from kernels/layout.py (the
Params struct, the layer table, the hand-off regions, the barrier, flag, token and host
words); this file is where the backend uses it, with the build (kernels/build.py) and the
driver calls (kernels/launcher.py).

A launch is ``prepare`` (zero what the kernel counts from zero, queued behind the caller's
work) then ``start`` (fill the Params, clear the host words, cooperative launch): requests
and timed decodes go through both; tensor-parallel ranks through ``prepare``, ``params`` and
``launch``, so that all N kernels start back to back.
"""

from __future__ import annotations

import ctypes
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from monokernel import envs
from monokernel.errors import BackendUnavailableError, InvalidRequestError, MonokernelError
from monokernel.kernels import build as kbuild
from monokernel.kernels import launcher, layout
from monokernel.kernels.plan import head_units_fit
from monokernel.models.config import ModelConfig
from monokernel.models.transformer import KVCache
from monokernel.runtime.backends.monokernel.grammar_mask import GrammarMask
from monokernel.runtime.backends.monokernel.logit_rules import NEUTRAL, LogitRules
from monokernel.runtime.sampling import SamplingParams
from monokernel.weights.repack import Repacked

MAX_STOP_IDS = 256  # the stop-id buffer the kernel scans each step
# Seconds to wait for a cancelled kernel to stop before the engine is given up as failed.
STOP_GRACE_SECONDS = 5.0


class KernelStuckError(MonokernelError, RuntimeError):
    """A monokernel that stopped producing tokens, or faulted: its request failed."""


def stall_seconds() -> float:
    """No token for this long while the kernel runs: its request fails
    (MONOKERNEL_STALL_SECONDS)."""
    return float(envs.MONOKERNEL_STALL_SECONDS)


def wait_until(done: Callable[[], bool], what: str) -> None:
    """Poll ``done`` until it holds; KernelStuckError naming ``what`` after stall_seconds()."""
    t0 = time.monotonic()
    while not done():
        if time.monotonic() - t0 > stall_seconds():
            raise KernelStuckError(f"{what} did not finish in {stall_seconds()} s")
        time.sleep(1e-4)


def debug_stall() -> tuple[int, int]:
    """(step, hard) of the injected stall MONOKERNEL_DEBUG_STALL asks for: (-1, 0) when off."""
    text = envs.MONOKERNEL_DEBUG_STALL.strip()
    if not text:
        return -1, 0
    step, sep, mode = text.partition(":")
    if not step.isdigit() or (sep and mode != "hard"):
        raise ValueError(f"MONOKERNEL_DEBUG_STALL={text!r}: expected STEP or STEP:hard")
    return int(step), int(mode == "hard")


def monokernel_supported(device: torch.device) -> tuple[bool, str]:
    """Whether the monokernel can run on ``device``; the reason when it cannot."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, "the monokernel needs an NVIDIA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        name = torch.cuda.get_device_name(device)
        return False, (
            f"the monokernel is built for Hopper (sm_90: H100/H200); {name} is sm_{major}{minor}"
        )
    try:
        kbuild.find_nvcc()
    except BackendUnavailableError as e:
        return False, str(e)
    return True, "ok"


def kernel_dims(
    cfg: ModelConfig,
    tp: int = 1,
    weight_format: str = "bf16",
    weight_group: int = 0,
    vocab_all: int = 0,
    qkv: tuple[str, int] = ("", 0),
    down: tuple[str, int] = ("", 0),
) -> kbuild.KernelDims:
    """The build's dimensions for ``cfg`` (one rank's config under tensor parallelism, of a
    model of ``vocab_all`` ids), the layers' matrices in ``weight_format`` (int4: in groups
    of ``weight_group`` columns), the fused QKV and the down projection in their own
    (format, group) where ``qkv`` / ``down`` name one (weights/quantize.py GroupsPlan);
    refuses a shape the kernel cannot run, before anything is allocated for it."""
    dims = dataclasses.replace(
        kbuild.KernelDims.from_config(cfg),
        tp=tp,
        weight_format=weight_format,
        weight_group=weight_group,
        vocab_all=vocab_all if tp > 1 else 0,
        qkv_format=qkv[0],
        qkv_group=qkv[1],
        down_format=down[0],
        down_group=down[1],
    )
    dims.check_formats()
    return dims


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def layer_table(packed: Repacked) -> torch.Tensor:
    """Each layer's LayerWeights row (layout.layer_pointers), on the host: [L, 14] int64."""
    return torch.tensor([layout.layer_pointers(lp) for lp in packed.layers], dtype=torch.int64)


# ---- what one launch is given -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Launch:
    """One launch's request: ``n_steps`` decode steps, the first fed ``first_token`` at
    ``start_pos`` (the positions below it are in the cache), drawing by ``sampling``, stopping
    at one of the first ``n_stop`` stop ids."""

    first_token: int
    start_pos: int
    n_steps: int
    sampling: SamplingParams
    n_stop: int = 0
    mask_tag: int = 0  # a constrained launch's first mask tag (grammar_mask.py); 0: none
    # The penalties' and logprobs' Params fields (logit_rules.py LogitRules.fields).
    rules: Mapping[str, object] = field(default_factory=lambda: NEUTRAL)
    # Positions each step computes: a pass build's (KernelDims.positions) teacher-forced
    # passes (verify_pass.py); 1 in a step build.
    pass_len: int = 1
    # A pass build drafting from the request's tokens (verify_pass.py): the device address of
    # its int32 history [max_len] (0: none), and the n-gram bounds (shortest, longest).
    history: int = 0
    ngram: tuple[int, int] = (0, 0)
    # Drafting ends where passes stop paying: before a pass with no draft (not the first) and
    # after one that kept none of its draft (drafted.py goes on by steps).
    draft_exit: bool = False


@dataclass(frozen=True, slots=True)
class Probe:
    """What a debug or profiling launch adds: ``forced`` [n_steps] int32, the token each step
    is fed instead of its own sample; ``debug_logits`` [n_steps, V] float32, where each
    step's logits go; ``timing`` int64 (layout.timing_words), filled by step
    ``timing_step``."""

    forced: torch.Tensor | None = None
    debug_logits: torch.Tensor | None = None
    timing: torch.Tensor | None = None
    timing_step: int = -1


NO_PROBE = Probe()


@dataclass(frozen=True, slots=True)
class TPLink:
    """A tensor-parallel rank's place among its peers: every rank's receive buffer (device
    addresses, valid on every peer under unified addressing), its own, its rank, its first
    vocabulary row, and the launch's first tag."""

    recv: Sequence[int]
    mine: int
    rank: int
    vocab_start: int
    tag: int


@dataclass(slots=True)
class KernelBuild:
    """The two loaded specialisations of one build: with group units (any context) and
    without (contexts head units cover: lighter on registers)."""

    full: launcher.KernelModule
    short: launcher.KernelModule
    attn_chunk: int  # the K/V window the build has (its flags may set it)
    # The context from which `full` runs even where head units would cover it
    # (MONOKERNEL_ATTN_GROUP_FROM when the build was loaded; tests and tuning), so variants
    # with and without it can share one backend (tools/kernel_variants.py).
    group_from: int

    def short_covers(self, context: int, splits: int) -> bool:
        """Whether ``short`` runs every position below ``context``: head units cover it
        (``splits`` = grid // heads) and it stays below ``group_from``."""
        return head_units_fit(context, self.attn_chunk, splits) and context < self.group_from

    def unload(self) -> None:
        self.full.unload()
        self.short.unload()


class DecodeKernel:
    """The kernel's builds and buffers on one GPU, over ``packed`` weights and ``cache``."""

    def __init__(
        self,
        cfg: ModelConfig,
        dims: kbuild.KernelDims,
        packed: Repacked,
        cache: KVCache,
        max_seq_len: int,
        device: torch.device,
    ) -> None:
        self.cfg, self.dims, self.packed, self.cache = cfg, dims, packed, cache
        self.max_seq_len, self.device = max_seq_len, device
        if packed.layers:
            tiled = packed.layers[0].matrices["wqkv"].data.dim() == 4  # tiles: rank 4
            if tiled != bool(dims.weight_tiles):
                raise BackendUnavailableError(
                    f"{dims.weight_format} weights packed as {'tiles' if tiled else 'rows'} for "
                    f"a kernel built for {'tiles' if dims.weight_tiles else 'rows'} "
                    "(MONOKERNEL_WEIGHT_LAYOUT changed between the build and the repacking)"
                )
        self.grid = torch.cuda.get_device_properties(device).multi_processor_count
        if cfg.num_kv_heads > self.grid:
            raise BackendUnavailableError(
                f"the monokernel needs at least one SM per KV head: {cfg.num_kv_heads} KV heads, "
                f"{self.grid} SMs"
            )
        self.attn_splits = self.grid // cfg.num_heads
        self.attn_group_splits = self.grid // cfg.num_kv_heads
        with torch.cuda.device(device):
            self.build = self.load_build()
            self._alloc_buffers()
            self.stream = torch.cuda.Stream(device)

    def load_build(self) -> KernelBuild:
        """Build (or find cached) and load this kernel's two specialisations under the build
        flags in force now (MONOKERNEL_NVCC_FLAGS), with the context from which group units
        run anyway in force now (MONOKERNEL_ATTN_GROUP_FROM; unset: only the kernel plan's
        own rule decides)."""
        launcher.set_current_context(self.device.index)
        full, short = (
            launcher.KernelModule(
                kbuild.build(d), kbuild.KERNEL_NAME, d.smem_bytes(), kbuild.THREADS
            )
            for d in (self.dims, dataclasses.replace(self.dims, group_units=False))
        )
        group_from = envs.MONOKERNEL_ATTN_GROUP_FROM or 1 << 30
        return KernelBuild(full, short, self.dims.built_attn_chunk(), group_from)

    def use_build(self, build: KernelBuild) -> None:
        """Launch ``build``'s kernels from now on."""
        self.build, self._static = build, None  # its group_from is a Params field

    def module_for(self, context: int) -> launcher.KernelModule:
        """The kernel for a launch whose positions stay below ``context``."""
        build = self.build
        return build.short if build.short_covers(context, self.attn_splits) else build.full

    def _alloc_buffers(self) -> None:
        cfg, dev, f32, i32 = self.cfg, self.device, torch.float32, torch.int32
        self.layer_table = layer_table(self.packed).to(dev)  # [L, 14]
        # Every tagged vector in one buffer, zeroed per launch (one memset).
        positions = self.dims.positions  # a pass build's: one vector a position
        self.handoff_regions = layout.handoff_regions(cfg, self.grid, positions)
        total = sum(r.total for r in self.handoff_regions)
        self._static: dict[str, object] | None = None  # Params fields no launch changes
        self.use_handoff(torch.empty(total, dtype=f32, device=dev))
        self.logits = torch.empty(cfg.vocab_size, dtype=f32, device=dev)  # [V]
        # What the kernel counts on from zero besides the hand-off vectors, zeroed per launch
        # in one memset: part_score (each CTA's best (score, id) for top-k / top-p and TP, or
        # the CTAs' tagged 64-bit token words, kernels/csrc/token_words.cuh), the per-head
        # attention counters, the flags and the barrier words, each from a 512-byte boundary
        # as separate allocations would lie.
        scores, ids = layout.token_words(self.grid, positions)
        sizes = {
            "part_score": scores,
            "attn_count": positions * (cfg.num_heads + cfg.num_kv_heads),
            "flags": layout.FLAG_WORDS,
            "barrier": layout.barrier_words(),
        }
        spans = [(n + 127) // 128 * 128 for n in sizes.values()]
        self.zeroed = torch.zeros(sum(spans), dtype=i32, device=dev)
        parts = dict(zip(sizes, torch.split(self.zeroed, spans), strict=True))
        self.part_score = parts["part_score"][:scores].view(f32)
        self.attn_count = parts["attn_count"][: sizes["attn_count"]]
        self.flags = parts["flags"][: layout.FLAG_WORDS]
        self.barrier = parts["barrier"][: layout.barrier_words()]
        self.part_id = torch.empty(ids, dtype=i32, device=dev)
        # The CTAs' partials of a whole-vocabulary draw (top-k / top-p / min_p, logprobs).
        self.sample_part = torch.zeros(
            layout.sample_part_words(self.grid), dtype=torch.int64, device=dev
        )
        self.stop_ids = torch.zeros(MAX_STOP_IDS, dtype=i32, device=dev)
        # Count, done, one word a token, and one more that stays 0 (token_reader.py).
        self.host_out = launcher.HostMapped(layout.host_out_words(self.max_seq_len + 1))
        self.host_cancel = launcher.HostMapped(1)
        self._grammar: GrammarMask | None = None  # made by the first constrained request
        # Penalties and logprobs (logit_rules.py); ids are the whole vocabulary's under TP.
        vocab = self.dims.vocab_all or cfg.vocab_size
        self.rules = LogitRules(vocab, self.max_seq_len + 1, dev)

    @property
    def grammar(self) -> GrammarMask:
        """The buffers a constrained launch's masks go through (grammar_mask.py)."""
        if self._grammar is None:  # the whole vocabulary's ids under TP, as the rules'
            self._grammar = GrammarMask(self.dims.vocab_all or self.cfg.vocab_size, self.device)
        return self._grammar

    # ---- where the buffers lie ------------------------------------------------------------

    def use_handoff(self, buf: torch.Tensor) -> None:
        """Put the tagged hand-off vectors in ``buf`` (float32, as many elements as
        ``self.handoff``): ``self.regions`` maps each region's name (a Params field) to its
        first copy; the kernel finds the others from the sizes."""
        total = sum(r.total for r in self.handoff_regions)
        if buf.dtype != torch.float32 or buf.numel() != total or buf.device != self.device:
            raise ValueError(
                f"hand-off buffer: {total} float32 elements on {self.device} needed; "
                f"got {buf.numel()} {buf.dtype} on {buf.device}"
            )
        self.handoff, self._static = buf, None
        parts = torch.split(buf, [r.total for r in self.handoff_regions])
        self.regions = {
            r.name: part[: r.floats] for r, part in zip(self.handoff_regions, parts, strict=True)
        }

    def streamed_weights(self) -> list[torch.Tensor]:
        """The matrices the kernel streams every token: each layer's wqkv, wo, wgu and wdown,
        then the LM head."""
        pk = self.packed
        return [
            *(t for lp in pk.layers for t in (lp.wqkv, lp.wo, lp.wgu, lp.wdown)),
            pk.lm_head,
        ]

    def use_weights(self, tensors: Sequence[torch.Tensor]) -> None:
        """Stream ``tensors`` (the values of ``streamed_weights()``, in its order) from now
        on: the repacked weights (which the prefill shares) and the layer table point there."""
        old = self.streamed_weights()
        if len(tensors) != len(old) or any(
            t.shape != o.shape or t.dtype != o.dtype or t.device != o.device
            for t, o in zip(tensors, old, strict=True)
        ):
            raise ValueError("weights: the shapes, dtypes and device of streamed_weights() needed")
        pk = self.packed
        for i, lp in enumerate(pk.layers):
            lp.wqkv, lp.wo, lp.wgu, lp.wdown = tensors[4 * i : 4 * i + 4]
        pk.lm_head = tensors[-1]
        self.layer_table.copy_(layer_table(pk), non_blocking=False)

    # ---- one launch -----------------------------------------------------------------------

    def make_current(self) -> None:
        """Make this GPU's primary context current for the driver calls that follow."""
        launcher.set_current_context(self.device.index)

    def prepare(self, stop_ids: Sequence[int]) -> None:
        """Before a launch, on the current stream (behind whatever the caller queued there):
        copy the stop ids and zero what the kernel counts on from zero: the barrier and
        per-head counters, the flags, and the tags of the hand-off vectors and token words
        (kernels/csrc/flow.cuh, token_words.cuh: a stale tag must never match one the launch
        waits for). The kernel's stream then waits for all of it."""
        with torch.cuda.device(self.device):
            if stop_ids:
                self.stop_ids[: len(stop_ids)].copy_(
                    torch.tensor(sorted(stop_ids), dtype=torch.int32)
                )
            self.zeroed.zero_()
            self.handoff.zero_()
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def params(
        self, launch: Launch, probe: Probe = NO_PROBE, tp: TPLink | None = None
    ) -> launcher.KernelParams:
        """The kernel's Params for ``launch`` (kernels/layout.py; with ``tp``, a TP build's)."""
        pk, sampling = self.packed, launch.sampling
        seed = 0 if sampling.greedy else sampling.seed
        if seed is None:
            raise InvalidRequestError("sampling needs a fixed seed (SamplingParams.with_seed)")
        fields: dict[str, object] = dict(
            # The weights' addresses per launch: use_weights (on this kernel or on the step
            # build whose weights a pass build shares) may move them.
            layers=_ptr(self.layer_table),
            embed=_ptr(pk.embed),
            lm_head=layout.matrix_view(pk.matrices["lm_head"]),
            norm_gain=_ptr(pk.norm_gain),
            rope_cos=_ptr(pk.rope_cos),
            rope_sin=_ptr(pk.rope_sin),
            **self._own_fields(),
            forced=_ptr(probe.forced),
            debug_logits=_ptr(probe.debug_logits),
            timing=_ptr(probe.timing),
            mask=_ptr(self.grammar.buffer) if launch.mask_tag else 0,
            first_token=launch.first_token,
            start_pos=launch.start_pos,
            n_steps=launch.n_steps,
            n_stop=launch.n_stop,
            top_k=sampling.top_k if sampling.top_k > 0 else 0,
            temperature=float(sampling.temperature),
            top_p=float(sampling.top_p),
            seed_lo=seed & 0xFFFFFFFF,
            seed_hi=(seed >> 32) & 0xFFFFFFFF,
            timing_step=probe.timing_step,
            **dict(zip(("debug_stall_step", "debug_stall_hard"), debug_stall(), strict=True)),
            mask_tag=launch.mask_tag,
            pass_len=launch.pass_len,
            history=launch.history,
            draft_min=launch.ngram[0],
            draft_max=launch.ngram[1],
            draft_exit=int(launch.draft_exit),
            **launch.rules,
        )
        if tp is None:
            return launcher.KernelParams(**fields)
        recv = (ctypes.c_uint64 * launcher.TP_MAX_RANKS)(*tp.recv)
        return launcher.KernelParamsTP(
            **fields,
            tp_recv=recv,
            tp_mine=tp.mine,
            tp_rank=tp.rank,
            vocab_start=tp.vocab_start,
            tp_tag=tp.tag,
            tp_pad_=0,
        )

    def _own_fields(self) -> dict[str, object]:
        """The Params fields of this kernel's own buffers, cache and plan, which no launch
        changes: built once (again after use_handoff), not a dict of addresses a launch."""
        if self._static is None:
            self._static = dict(
                k_cache=_ptr(self.cache.k),
                v_cache=_ptr(self.cache.v),
                **{name: _ptr(region) for name, region in self.regions.items()},
                attn_count=_ptr(self.attn_count),
                logits=_ptr(self.logits),
                part_score=_ptr(self.part_score),
                part_id=_ptr(self.part_id),
                flags=_ptr(self.flags),
                sample_part=_ptr(self.sample_part),
                barrier=_ptr(self.barrier),
                stop_ids=_ptr(self.stop_ids),
                host_out=self.host_out.device_ptr,
                host_cancel=self.host_cancel.device_ptr,
                max_len=self.max_seq_len,
                eps=float(self.cfg.rms_norm_eps),
                attn_splits=self.attn_splits,
                attn_group_splits=self.attn_group_splits,
                attn_group_from=self.build.group_from,
            )
        return self._static

    def clear_host_words(self, n_steps: int) -> None:
        """Before a launch of ``n_steps``: zero the host-mapped words the kernel reports
        through (count, done, one per token: token_reader.py) and lower the cancel word."""
        ctypes.memset(ctypes.addressof(self.host_out.words), 0, 4 * (3 + n_steps))
        self.host_cancel.words[0] = 0

    def launch(self, params: launcher.KernelParams, context: int) -> None:
        """Cooperative launch on this kernel's stream, with the build for positions below
        ``context``."""
        self.module_for(context).launch(self.grid, params, self.stream.cuda_stream)

    def start(
        self,
        launch: Launch,
        probe: Probe = NO_PROBE,
        timed: tuple[torch.cuda.Event, torch.cuda.Event] | None = None,
    ) -> None:
        """After ``prepare``: fill the Params, clear the host words, launch. ``timed``: events
        recorded right before and after the launch."""
        params = self.params(launch, probe)
        # Teacher-forced passes report every position they compute; a pass build that drafts
        # reports the tokens it keeps (n_steps at most) and computes up to pass_len - 1
        # positions past the last of them.
        drafting = launch.history != 0
        tokens = launch.n_steps if drafting else launch.n_steps * launch.pass_len
        self.clear_host_words(tokens)
        if timed is not None:
            timed[0].record(self.stream)
        past = launch.pass_len - 1 if drafting else 0
        self.launch(params, min(self.max_seq_len, launch.start_pos + tokens + past))
        if timed is not None:
            timed[1].record(self.stream)

    @property
    def token_words(self) -> ctypes.Array[ctypes.c_int32]:
        """The host-mapped words the running kernel writes (token_reader.py)."""
        return self.host_out.words

    def finished(self) -> bool:
        """Whether the kernel's stream is idle (raises on a kernel fault); the context must
        be current."""
        return launcher.stream_done(self.stream.cuda_stream)

    def cancel(self) -> None:
        """Raise the cancel word: the kernel reads it once per token."""
        self.host_cancel.words[0] = 1

    def wait(self, timeout_s: float | None = None) -> None:
        """Until the kernel's stream is idle; KernelStuckError after ``timeout_s``."""
        self.make_current()
        t0 = time.monotonic()
        while not launcher.stream_done(self.stream.cuda_stream):
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise KernelStuckError(
                    f"the monokernel did not stop within {timeout_s:.0f} s of being cancelled"
                )
            time.sleep(1e-4)

    def timed_decode(self, forced: torch.Tensor, start_pos: int) -> float:
        """Seconds a decode step takes in one launch of len(forced) teacher-forced greedy
        steps from ``start_pos`` (CUDA events around the launch), on whatever the cache holds
        below it: for timing only."""
        if forced.dtype != torch.int32 or forced.device != self.device or forced.dim() != 1:
            raise ValueError(f"forced tokens: a 1-D int32 tensor on {self.device} needed")
        n = int(forced.numel())  # forced: [n]
        if n < 1 or not 0 <= start_pos <= self.max_seq_len - n:
            raise InvalidRequestError(
                f"a timed decode of {n} steps from position {start_pos} must fit the cache "
                f"of {self.max_seq_len} positions"
            )
        greedy = SamplingParams(temperature=0.0, max_tokens=n)
        self.make_current()
        with torch.cuda.device(self.device):
            self.prepare(())
            begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self.start(Launch(0, start_pos, n, greedy), Probe(forced=forced), (begin, end))
            wait_until(end.query, "a timed decode")
        ran = int(self.token_words[0])
        if ran != n:
            raise RuntimeError(f"the kernel ran {ran} of {n} timed steps")
        return begin.elapsed_time(end) * 1e-3 / n

    def close(self) -> None:
        """Unload the build in use and free the host words (idempotent)."""
        self.build.unload()
        self.host_out.free()
        self.host_cancel.free()
        self.rules.close()
