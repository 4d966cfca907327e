"""The monokernel backend: one persistent CUDA kernel per request runs every decode step.

Prefill (``runtime/prefill.py``: cuBLAS GEMMs and flash attention, in chunks) writes the
prompt's K/V straight into the kernel's bf16 cache [layers, kv_heads, max_len, head_dim],
sized at load time against the GPU's free memory (``runtime/kv_memory.py``). The prefill's
last logits give the first token (FIRST_TOKEN_SOURCES); the kernel then starts from it and
produces the rest by itself; each lands in pinned host-mapped memory where ``stream`` picks
it up and yields it while the kernel goes on. A
host-mapped cancel word (raised when the CancelToken is set or the iterator is closed) stops
it within a token.

Prefix reuse (``runtime/prefix_cache.py``): the cache keeps what the last request left in it
(its prompt and the generated tokens whose K/V the kernel wrote), and optionally snapshots
of earlier conversations; a prompt sharing a prefix with either prefills only the rest.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import time
from collections.abc import Iterator, Sequence

import torch

from monokernel.errors import BackendUnavailableError, InvalidRequestError
from monokernel.kernels import build as kbuild
from monokernel.kernels import launcher
from monokernel.models.config import ModelConfig
from monokernel.models.transformer import KVCache
from monokernel.runtime import kv_memory
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.backends.handoff_placement import (
    HandoffChoice,
    choose_handoff,
    handoff_places,
)
from monokernel.runtime.backends.token_reader import read_tokens
from monokernel.runtime.kv_filler import CacheFiller
from monokernel.runtime.prefill import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_PRECISION,
    Prefiller,
    workspace_bytes,
)
from monokernel.runtime.prefill_graphs import graphs_enabled
from monokernel.runtime.prefix_cache import PrefixCache, fed_tokens
from monokernel.runtime.sampling import SamplingParams, sample
from monokernel.weights.names import Weights
from monokernel.weights.repack import Repacked, repack

_MAX_STOP_IDS = 256
# Where a request's first token comes from. "prefill": the prompt's last logits, computed by
# the prefill that fills the cache anyway (one LM-head GEMV); the kernel then starts at the
# next position, so time to first token loses one whole decode step. "kernel": the kernel's
# first step computes the last prompt position and draws it (as the debug paths always do).
FIRST_TOKEN_SOURCES: tuple[str, ...] = ("prefill", "kernel")
_STALL_SECONDS = 120.0  # no token for this long while the kernel runs: report, don't hang


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


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def ids_in_vocab(ids: Sequence[int], vocab_size: int) -> bool:
    """Whether every id is in [0, vocab_size): min and max run in C, a Python loop over a
    16k-token prompt does not."""
    return not ids or (min(ids) >= 0 and max(ids) < vocab_size)


def checked_steps(
    prompt_ids: Sequence[int],
    stop_ids: Sequence[int],
    max_new_tokens: int,
    max_seq_len: int,
    vocab_size: int,
    known_valid: int = 0,
) -> int:
    """Refuse a request one launch cannot take (InvalidRequestError); else the decode steps
    it runs: the input of step s sits at position len(prompt)-1+s, inside the cache.
    ``known_valid``: leading token ids already checked (the live cache's tokens that the
    prompt repeats): an agent's 16k-token turn is then not a 16k-step Python loop (~1-2 ms,
    all of it inside the time to first token)."""
    n = len(prompt_ids)
    if n == 0:
        raise InvalidRequestError("the prompt must hold at least one token")
    if n > max_seq_len:
        raise InvalidRequestError(f"the prompt ({n} tokens) exceeds max_seq_len={max_seq_len}")
    if not ids_in_vocab(prompt_ids[known_valid:] if known_valid else prompt_ids, vocab_size):
        raise InvalidRequestError("a prompt token id is outside the vocabulary")
    if len(stop_ids) > _MAX_STOP_IDS:
        raise InvalidRequestError(f"at most {_MAX_STOP_IDS} stop token ids are supported")
    return min(max_new_tokens, max_seq_len - n + 1)


class MonokernelBackend:
    name = "monokernel"

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Weights,
        max_seq_len: int,
        device: torch.device,
        fold_norms: bool = False,
        prefix_reuse: bool | None = None,
        snapshot_bytes: int | None = None,
        prefill_chunk: int | None = None,
        prefill_precision: str | None = None,
        first_token: str | None = None,
        handoff_search: int | None = None,
    ) -> None:
        """Knobs (docs/long-context.md):

        ``prefix_reuse``: reuse the K/V of earlier requests' matching prefixes (default: on,
        unless MONOKERNEL_PREFIX_REUSE=0). ``snapshot_bytes``: budget for snapshots of
        earlier conversations (default: twice the cache, at most a quarter of the memory
        left after loading; 0 keeps only the live cache). ``prefill_chunk`` /
        ``prefill_precision``: see runtime/prefill.py (defaults: MONOKERNEL_PREFILL_CHUNK /
        MONOKERNEL_PREFILL_PRECISION, else 2048 / split-qkv). ``first_token``: where a
        request's first token comes from (FIRST_TOKEN_SOURCES; default:
        MONOKERNEL_FIRST_TOKEN, else "prefill"). ``handoff_search``: fresh places for the
        hand-off buffer timed against its own at load, the fastest kept (handoff_placement.py;
        default: MONOKERNEL_HANDOFF_SEARCH, else DEFAULT_CANDIDATES there; 0: off).
        """
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        ok, why = monokernel_supported(device)
        if not ok:
            raise BackendUnavailableError(f"engine 'monokernel' cannot run here: {why}")
        if max_seq_len < 1:
            raise InvalidRequestError(f"max_seq_len must be at least 1; got {max_seq_len}")
        self.cfg, self.device, self.max_seq_len = cfg, device, max_seq_len
        places = handoff_places(handoff_search)
        source = first_token or os.environ.get("MONOKERNEL_FIRST_TOKEN") or "prefill"
        if source not in FIRST_TOKEN_SOURCES:
            raise InvalidRequestError(
                f"first token source {source!r}; choose from {', '.join(FIRST_TOKEN_SOURCES)}"
            )
        self.first_from_prefill = source == "prefill"
        dims = kbuild.KernelDims.from_config(cfg)  # refuses unsupported shapes first
        chunk = prefill_chunk or _env_int("MONOKERNEL_PREFILL_CHUNK") or DEFAULT_CHUNK_TOKENS
        precision = (
            prefill_precision or os.environ.get("MONOKERNEL_PREFILL_PRECISION") or DEFAULT_PRECISION
        )
        # Refuse a context that cannot fit before allocating anything for it.
        convert = weights["embed"].dtype != torch.bfloat16
        free = kv_memory.free_device_bytes(device)
        extra = kv_memory.repack_bytes(cfg, fold_norms, convert)
        need = kv_memory.check_fits(
            cfg, max_seq_len, free, chunk, precision, str(device), extra, graphs_enabled(device)
        )
        if convert:
            weights = {k: v.to(torch.bfloat16) for k, v in weights.items()}
        # Prefill and decode both run on the repacked tensors, so nothing here keeps the
        # checkpoint's own (fused-away) matrices alive.
        self.packed: Repacked = repack(cfg, weights, max_seq_len, fold=fold_norms)
        del weights
        # [L, kvh, max_len, d] x2, bf16: the reference's layout, which the kernel reads too
        self.cache = KVCache.allocate(cfg, max_seq_len, torch.bfloat16, device)
        self.prefill = Prefiller(cfg, self.packed, self.cache.k, self.cache.v, chunk, precision)
        self._workspace = workspace_bytes(cfg, min(chunk, max_seq_len), max_seq_len, precision)
        per_token = kv_memory.kv_bytes_per_token(cfg)
        if snapshot_bytes is None:
            snapshot_bytes = min(2 * per_token * max_seq_len, max(0, free - need) // 4)
        if prefix_reuse is None:
            prefix_reuse = os.environ.get("MONOKERNEL_PREFIX_REUSE", "1") != "0"
        self.prefix = PrefixCache(per_token, snapshot_bytes, enabled=prefix_reuse)
        self.filler = CacheFiller(self.prefill, self.prefix, self._snapshot_fits)
        self._load_kernels(dims)
        self.grid = torch.cuda.get_device_properties(device).multi_processor_count
        self._alloc_buffers()
        self.stream_ = torch.cuda.Stream(device)
        # What the search timed (None: it did not run).
        self.handoff_choice: HandoffChoice | None = choose_handoff(self, cfg.vocab_size, places)

    def _load_kernels(self, dims: kbuild.KernelDims) -> None:
        """Build (or find cached) and load the two specialisations of the kernel: with group
        units (any context) and without (contexts head units cover: lighter on registers)."""
        self.dims = dims
        launcher.set_current_context(self.device.index)
        self.module, self.module_short = (
            launcher.KernelModule(
                kbuild.build(d), kbuild.KERNEL_NAME, d.smem_bytes(), kbuild.THREADS
            )
            for d in (dims, dataclasses.replace(dims, group_units=False))
        )

    def module_for(self, context: int) -> launcher.KernelModule:
        """The kernel for a launch whose positions stay below ``context``."""
        covered = self.dims.head_units_cover(context, self.attn_splits)
        return self.module_short if covered and context < self.attn_group_from else self.module

    def _layer_table(self) -> torch.Tensor:
        """Each layer's pointers as the kernel's LayerWeights has them (params.cuh), on the
        host: [L, 10] int64."""
        table = [
            [
                _ptr(lp.wqkv), _ptr(lp.bqkv), _ptr(lp.q_norm), _ptr(lp.k_norm), _ptr(lp.wo),
                _ptr(lp.bo), _ptr(lp.wgu), _ptr(lp.wdown), _ptr(lp.attn_gain), _ptr(lp.ffn_gain),
            ]
            for lp in self.packed.layers
        ]  # fmt: skip
        return torch.tensor(table, dtype=torch.int64)

    def _alloc_buffers(self) -> None:
        cfg, dev, f32 = self.cfg, self.device, torch.float32
        self.layer_table = self._layer_table().to(dev)  # [L, 10]
        qkv = cfg.q_size + 2 * cfg.kv_size
        # The vectors stages hand to each other carry tags (kernels/csrc/flow.cuh) and are
        # zeroed before every launch: one tensor, so that is one memset.
        # Flash-decoding (kernels/csrc/attention_window.cuh): head units split a query head's
        # positions over at most grid // heads CTAs, group units a KV head's over at most
        # grid // kv_heads.
        if cfg.num_kv_heads > self.grid:
            raise BackendUnavailableError(
                f"the monokernel needs at least one SM per KV head: {cfg.num_kv_heads} KV heads, "
                f"{self.grid} SMs"
            )
        self.attn_splits = self.grid // cfg.num_heads
        self.attn_group_splits = self.grid // cfg.num_kv_heads
        # Context length from which group units are used even where head units would fit
        # (tests and tuning); by default only the plan's own rule decides.
        self.attn_group_from = _env_int("MONOKERNEL_ATTN_GROUP_FROM") or 1 << 30
        slots = cfg.num_heads * max(self.attn_splits, self.attn_group_splits)
        # Every tagged vector (kernels/csrc/flow.cuh) in one buffer, zeroed per launch: the
        # stage hand-offs, and the ranges' partial attention outputs [slots, D] with their
        # statistics [slots, 4] (max, exp-sum; tagged when stage C merges them).
        # The vectors every CTA reads come in MK_FLOW_COPIES copies back to back (flow.cuh);
        # the views below are the first copy, the kernel finds the others from the sizes.
        sizes = (
            cfg.hidden_size,
            qkv,
            cfg.hidden_size,
            cfg.q_size,
            cfg.intermediate_size,
            slots * cfg.head_dim,
            slots * 4,
        )
        copies = kbuild.flow_copies()
        per = (copies, 1, copies, copies, copies, copies, copies)  # qkv: attention units only
        self._handoff_layout = ([n * c for n, c in zip(sizes, per, strict=True)], sizes)
        self.use_handoff(torch.empty(sum(self._handoff_layout[0]), dtype=f32, device=dev))
        self.attn_count = torch.zeros(
            cfg.num_heads + cfg.num_kv_heads, dtype=torch.int32, device=dev
        )  # [NH + NKV]
        self.logits = torch.empty(cfg.vocab_size, dtype=f32, device=dev)  # [V]
        # [2 * grid]: each CTA's best score (top-k / top-p, TP), or the CTAs' tagged 64-bit
        # token words (kernels/csrc/token_words.cuh), zeroed per launch.
        self.part_score = torch.zeros(2 * self.grid, dtype=f32, device=dev)
        self.part_id = torch.empty(self.grid, dtype=torch.int32, device=dev)  # [grid]
        self.flags = torch.zeros(4, dtype=torch.int32, device=dev)  # [4]
        # [0] the grid barrier's counter, then the LM head's ticket counters, one a warp slot
        # on a line of its own (csrc/drawn_rows.cuh); zeroed per launch.
        self.barrier = torch.zeros(
            kbuild.TICKET_STRIDE * (1 + kbuild.WARPS), dtype=torch.int32, device=dev
        )  # [32 * (1 + WARPS)]
        self.stop_ids = torch.zeros(_MAX_STOP_IDS, dtype=torch.int32, device=dev)
        self.host_out = launcher.HostMapped(2 + self.max_seq_len + 1)  # count, done, tokens
        self.host_cancel = launcher.HostMapped(1)

    def use_handoff(self, buf: torch.Tensor) -> None:
        """Put the tagged hand-off vectors in ``buf`` (float32, as many elements as
        ``self.handoff``). Where they lie moves decode speed by up to ~1% on an H100
        (docs/perf-notes.md step 48), so builds timed side by side share one buffer
        (scripts/kernel_variants.py); launches zero it, so sharing between backends that never
        run at once is safe."""
        counts, sizes = self._handoff_layout
        if buf.dtype != torch.float32 or buf.numel() != sum(counts) or buf.device != self.device:
            raise ValueError(
                f"hand-off buffer: {sum(counts)} float32 elements on {self.device} needed; "
                f"got {buf.numel()} {buf.dtype} on {buf.device}"
            )
        self.handoff = buf
        self.x, self.qkv, self.delta, self.attn_out, self.act, self.attn, self.attn_ml = (
            region[:n] for region, n in zip(torch.split(buf, counts), sizes, strict=True)
        )  # [H], [Q + 2KV], [H], [Q], [I], [slots, D], [slots, 4]

    def streamed_weights(self) -> list[torch.Tensor]:
        """The matrices the kernel streams every token: each layer's wqkv, wo, wgu and wdown,
        then the LM head (the order ``use_weights`` takes)."""
        pk = self.packed
        return [
            *(t for lp in pk.layers for t in (lp.wqkv, lp.wo, lp.wgu, lp.wdown)),
            pk.lm_head,
        ]

    def use_weights(self, tensors: Sequence[torch.Tensor]) -> None:
        """Stream ``tensors`` (the values of ``streamed_weights()``, in its order, wherever
        they lie) from now on; the prefill reads them too. For measuring whether where they
        lie moves decode speed (scripts/search_probe.py). Not once the prefill has captured
        CUDA graphs: those keep the old addresses."""
        graphs = getattr(getattr(self, "prefill", None), "graphs", None)
        if graphs is not None and graphs.captured():
            raise RuntimeError("the weights cannot move once the prefill's graphs hold them")
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
        self.layer_table.copy_(self._layer_table(), non_blocking=False)

    # ---- one launch ---------------------------------------------------------------------

    def clear_host_words(self, n_steps: int) -> None:
        """Before a launch of ``n_steps``: zero the host-mapped words the kernel reports
        through (count, done, one per token: token_reader.py) and lower the cancel word."""
        ctypes.memset(ctypes.addressof(self.host_out.words), 0, 4 * (3 + n_steps))
        self.host_cancel.words[0] = 0

    def _reset_launch_state(self) -> None:
        """Zero what the kernel counts on from zero (on the current stream): the barrier and
        per-head counters, the flags, and the tags of the hand-off vectors and token words
        (kernels/csrc/flow.cuh, token_words.cuh: a stale tag must never match one the launch
        waits for)."""
        for buf in (self.barrier, self.attn_count, self.flags, self.handoff, self.part_score):
            buf.zero_()

    def _params(
        self,
        first_token: int,
        start_pos: int,
        n_steps: int,
        sampling: SamplingParams,
        n_stop: int,
        forced: torch.Tensor | None,
        debug_logits: torch.Tensor | None,
        timing: torch.Tensor | None = None,
        timing_step: int = -1,
    ) -> launcher.KernelParams:
        pk = self.packed
        seed = 0 if sampling.greedy else sampling.seed
        if seed is None:
            raise InvalidRequestError("sampling needs a fixed seed (SamplingParams.with_seed)")
        top_k = sampling.top_k if sampling.top_k > 0 else 0
        return launcher.KernelParams(
            layers=_ptr(self.layer_table),
            embed=_ptr(pk.embed),
            lm_head=_ptr(pk.lm_head),
            norm_gain=_ptr(pk.norm_gain),
            rope_cos=_ptr(pk.rope_cos),
            rope_sin=_ptr(pk.rope_sin),
            k_cache=_ptr(self.cache.k),
            v_cache=_ptr(self.cache.v),
            x=_ptr(self.x),
            qkv=_ptr(self.qkv),
            attn=_ptr(self.attn),
            attn_ml=_ptr(self.attn_ml),
            delta=_ptr(self.delta),
            attn_out=_ptr(self.attn_out),
            attn_count=_ptr(self.attn_count),
            act=_ptr(self.act),
            logits=_ptr(self.logits),
            part_score=_ptr(self.part_score),
            part_id=_ptr(self.part_id),
            flags=_ptr(self.flags),
            barrier=_ptr(self.barrier),
            forced=_ptr(forced),
            debug_logits=_ptr(debug_logits),
            stop_ids=_ptr(self.stop_ids),
            host_out=self.host_out.device_ptr,
            host_cancel=self.host_cancel.device_ptr,
            timing=_ptr(timing),
            max_len=self.max_seq_len,
            first_token=first_token,
            start_pos=start_pos,
            n_steps=n_steps,
            n_stop=n_stop,
            top_k=top_k,
            temperature=float(sampling.temperature),
            top_p=float(sampling.top_p),
            seed_lo=seed & 0xFFFFFFFF,
            seed_hi=(seed >> 32) & 0xFFFFFFFF,
            eps=float(self.cfg.rms_norm_eps),
            timing_step=timing_step,
            attn_splits=self.attn_splits,
            attn_group_splits=self.attn_group_splits,
            attn_group_from=self.attn_group_from,
            pad_=0,
        )

    def _run(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        stop_ids: Sequence[int],
        cancel: CancelToken | None,
        forced: torch.Tensor | None = None,
        debug_logits: torch.Tensor | None = None,
        timing: torch.Tensor | None = None,
        timing_step: int = -1,
        forced_ids: Sequence[int] | None = None,
        first_from_prefill: bool = False,
    ) -> Iterator[int]:
        """``forced_ids``: the host copy of ``forced``, so the prefix bookkeeping knows which
        tokens the kernel's steps wrote into the cache. ``first_from_prefill``: the prefill
        covers the whole prompt and its last logits give the first token (sampled on the
        host side by the same rule, runtime/sampling.py); the kernel starts one position
        later from that token. Else the kernel's first step computes the last prompt position
        and draws the first token itself (the debug and profiling paths, whose step numbers
        and logits are the kernel's)."""
        n = len(prompt_ids)
        # What the cache already holds of the prompt (live cache or snapshot) is checked ids
        # and in-vocabulary outputs: only the rest needs checking. The fill follows this plan.
        plan = self.prefix.plan(prompt_ids)
        n_steps = checked_steps(
            prompt_ids, stop_ids, max_new_tokens, self.max_seq_len, self.cfg.vocab_size,
            plan.reuse,
        )  # fmt: skip
        if not sampling.greedy and sampling.seed is None:
            raise InvalidRequestError("sampling needs a fixed seed (SamplingParams.with_seed)")
        launcher.set_current_context(self.device.index)
        first: int | None = None
        with torch.cuda.device(self.device):
            if first_from_prefill:
                logits = self.filler.fill(prompt_ids, n, logits=True, plan=plan)
                assert logits is not None
            else:
                # Positions [0, n-1); the kernel's first step computes position n-1 itself.
                self.filler.fill(prompt_ids, n - 1, plan=plan)
            # The launch's setup is queued behind the prefill before the host waits for the
            # first token, so only the launch itself sits between that token and the kernel.
            if stop_ids:
                self.stop_ids[: len(stop_ids)].copy_(
                    torch.tensor(sorted(stop_ids), dtype=torch.int32)
                )
            self._reset_launch_state()
            self.stream_.wait_stream(torch.cuda.current_stream(self.device))
            if first_from_prefill:
                first = sample(logits, sampling, n)  # the token at position n: one host sync
        # Positions the cache holds before the kernel's first step, and that step's input.
        held, step_in = n - 1, prompt_ids[-1]
        if first is not None:
            held, step_in = n, first
            n_steps -= 1
            if first in stop_ids:
                n_steps = 0
        launched = n_steps > 0
        out, cancel_word = self.host_out.words, self.host_cancel.words
        if launched:
            params = self._params(
                step_in,
                held,
                n_steps,
                sampling,
                len(stop_ids),
                forced,
                debug_logits,
                timing,
                timing_step,
            )
            self.clear_host_words(n_steps)
            self.module_for(held + n_steps).launch(self.grid, params, self.stream_.cuda_stream)
        finished = failed = False

        def check(stalled_s: float) -> None:
            if launcher.stream_done(self.stream_.cuda_stream) and not out[1]:
                raise RuntimeError("the monokernel exited without finishing")
            if stalled_s > _STALL_SECONDS:
                raise RuntimeError(f"the monokernel made no progress for {_STALL_SECONDS} s")

        try:
            if first is not None and not (cancel is not None and cancel.is_set()):
                yield first  # the kernel is already running on the next one
            if launched:
                finished = yield from read_tokens(out, cancel, check)
        except GeneratorExit:  # the consumer closed the stream: a normal early end
            raise
        except BaseException:
            failed = True
            raise
        finally:
            if launched:
                if not finished:
                    cancel_word[0] = 1  # the kernel reads it once per token
                launcher.set_current_context(self.device.index)
                while not launcher.stream_done(self.stream_.cuda_stream):
                    time.sleep(1e-4)
            if failed:
                self.prefix.invalidate()
            else:
                # The kernel has stopped: out[0] counts its completed steps, each of which
                # wrote the K/V of the token it was fed (more than were yielded, if the
                # consumer stopped early).
                steps = int(out[0]) if launched else 0
                generated = [w - 1 for w in out[2 : 2 + max(0, steps - 1)]]  # id + 1
                ran = (*prompt_ids[:held], step_in)
                self.prefix.finish(ran, fed_tokens(ran, generated, steps, forced_ids))

    def timed_decode(self, forced: torch.Tensor, start_pos: int) -> float:
        """Seconds a decode step takes in one launch of len(forced) teacher-forced greedy
        steps from ``start_pos`` (CUDA events around the launch), on whatever the cache holds
        below it: for timing only (handoff_placement.py). The cache's contents are forgotten
        afterwards."""
        if forced.dtype != torch.int32 or forced.device != self.device or forced.dim() != 1:
            raise ValueError(f"forced tokens: a 1-D int32 tensor on {self.device} needed")
        n = int(forced.numel())  # forced: [n]
        if n < 1 or not 0 <= start_pos <= self.max_seq_len - n:
            raise InvalidRequestError(
                f"a timed decode of {n} steps from position {start_pos} must fit the cache "
                f"of {self.max_seq_len} positions"
            )
        self.prefix.invalidate()
        greedy = SamplingParams(temperature=0.0, max_tokens=n)
        launcher.set_current_context(self.device.index)
        with torch.cuda.device(self.device):
            self._reset_launch_state()
            self.stream_.wait_stream(torch.cuda.current_stream(self.device))
            params = self._params(0, start_pos, n, greedy, 0, forced, None)
            self.clear_host_words(n)
            begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            begin.record(self.stream_)
            self.module_for(start_pos + n).launch(self.grid, params, self.stream_.cuda_stream)
            end.record(self.stream_)
            t0 = time.monotonic()
            while not end.query():
                if time.monotonic() - t0 > _STALL_SECONDS:
                    raise RuntimeError(f"a timed decode did not finish in {_STALL_SECONDS} s")
                time.sleep(1e-4)
        ran = int(self.host_out.words[0])
        if ran != n:
            raise RuntimeError(f"the kernel ran {ran} of {n} timed steps")
        return begin.elapsed_time(end) * 1e-3 / n

    # ---- prefill and prefix reuse -------------------------------------------------------

    def _snapshot_fits(self, nbytes: int) -> bool:
        need = nbytes + self._workspace + kv_memory.RESERVE_BYTES
        return kv_memory.free_device_bytes(self.device) >= need

    def set_prefix_reuse(self, enabled: bool) -> None:
        """Turn prefix reuse on or off (off: every request prefills its whole prompt). Either
        way the snapshots are freed and the live cache's contents forgotten, so what a
        request reuses next was computed under the new setting."""
        self.prefix.enabled = enabled
        self.prefix.clear()

    def prefill_logits(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        """Prefill ``prompt_ids`` (reusing a cached prefix like a request would) and return
        the last token's logits [V] float32, from the prefill path alone (no kernel)."""
        n = len(prompt_ids)
        if not 0 < n <= self.max_seq_len:
            raise InvalidRequestError(f"prompt length {n} must be in [1, {self.max_seq_len}]")
        if any(not 0 <= t < self.cfg.vocab_size for t in prompt_ids):
            raise InvalidRequestError("a prompt token id is outside the vocabulary")
        with torch.cuda.device(self.device):
            logits = self.filler.fill(prompt_ids, n, logits=True)
            torch.cuda.synchronize(self.device)
        assert logits is not None
        return logits

    # ---- the Backend contract -------------------------------------------------------------

    def stream(self, request: DecodeRequest, cancel: CancelToken) -> Iterator[int]:
        yield from self._run(
            request.prompt_ids,
            request.max_new_tokens,
            request.sampling,
            sorted(request.stop_token_ids),
            cancel,
            first_from_prefill=self.first_from_prefill,
        )

    def teacher_forced_logits(
        self, prompt_ids: Sequence[int], next_ids: Sequence[int]
    ) -> torch.Tensor:
        """Debug mode: logits [len(next_ids), V] float32, where step s feeds the kernel the
        given token (the last prompt token, then next_ids[s-1]) instead of its own sample."""
        steps = len(next_ids)
        if not ids_in_vocab(next_ids, self.cfg.vocab_size):
            raise InvalidRequestError("a forced token id is outside the vocabulary")
        forced_list = [prompt_ids[-1], *next_ids[:-1]]
        forced = torch.tensor(forced_list, dtype=torch.int32, device=self.device)  # [steps]
        logits = torch.full(
            (steps, self.cfg.vocab_size), float("nan"), dtype=torch.float32, device=self.device
        )  # [steps, V]
        greedy = SamplingParams(temperature=0.0, max_tokens=max(steps, 1))
        run = self._run(prompt_ids, steps, greedy, (), None, forced, logits, forced_ids=forced_list)
        produced = sum(1 for _ in run)
        if produced != steps:
            raise RuntimeError(f"the kernel ran {produced} of {steps} forced steps")
        torch.cuda.synchronize(self.device)
        return logits

    def timed_run(
        self, prompt_ids: Sequence[int], n_steps: int, step: int, extra: int = 0
    ) -> list[int]:
        """A greedy run of ``n_steps`` whose step ``step`` fills the kernel's timing buffer
        (csrc/probes.cuh): 10L + 8 slots of CTA 0's marks, then ``extra`` more (a -DMK_SKEW
        build's per-CTA points, scripts/stage_skew.py). Returns the raw slots."""
        size = 10 * self.cfg.num_layers + 8 + extra
        timing = torch.zeros(size, dtype=torch.int64, device=self.device)
        greedy = SamplingParams(temperature=0.0, max_tokens=n_steps)
        for _ in self._run(prompt_ids, n_steps, greedy, (), None, timing=timing, timing_step=step):
            pass
        torch.cuda.synchronize(self.device)
        return timing.tolist()

    def profile_step(self, prompt_ids: Sequence[int], n_steps: int, step: int) -> dict[str, float]:
        """Time the stages of one decode step (greedy run of ``n_steps``), as CTA 0 sees them.

        Returns µs per stage kind summed over layers: ``<stage>.work`` (CTA 0's own work) and
        ``<stage>.wait`` (its wait at the grid barrier that ends the stage); stages A-E per
        layer, F the LM head, S sampling and the token hand-off.
        """
        L = self.cfg.num_layers
        t = self.timed_run(prompt_ids, n_steps, step)
        ns_per_cycle = (t[10 * L + 4] - t[10 * L + 5]) / max(t[10 * L + 3] - t[0], 1)
        out: dict[str, float] = {"clock_GHz": 1.0 / ns_per_cycle if ns_per_cycle else 0.0}

        def add(key: str, cycles: int) -> None:
            out[key] = out.get(key, 0.0) + cycles * ns_per_cycle / 1e3

        i = 0
        for _layer in range(L):
            for stage in "ABCDE":
                add(f"{stage}.work", t[i + 1] - t[i])
                add(f"{stage}.wait", t[i + 2] - t[i + 1])
                i += 2
        add("F.work", t[i + 1] - t[i])
        add("F.wait", t[i + 2] - t[i + 1])
        add("S.work", t[i + 3] - t[i + 2])
        out["total"] = (t[10 * L + 3] - t[0]) * ns_per_cycle / 1e3
        return out

    def close(self) -> None:
        self.module.unload()
        self.module_short.unload()
        self.host_out.free()
        self.host_cancel.free()
        # Subclasses built without prefill (the tensor-parallel ranks) lack some of these.
        prefix = getattr(self, "prefix", None)
        if prefix is not None:
            prefix.clear()  # frees the snapshots
        prefill = getattr(self, "prefill", None)
        if prefill is not None and prefill.graphs is not None:
            prefill.graphs.clear()  # frees the graphs' memory pool
        for name in ("filler", "prefill", "packed", "cache", "ref"):
            if hasattr(self, name):
                delattr(self, name)
