"""Tensor-parallel monokernel: one request split over N GPUs of one node, one process.

Each rank runs its own persistent kernel (a ``-DMK_TP=N`` build with the rank's dims: heads/N,
kv_heads/N, intermediate/N, its vocabulary rows) on its own GPU. The two residual reductions
per layer and the token choice happen inside the kernels, by storing tagged partials straight
into the peers' receive buffers over NVLink (``kernels/csrc/tp.cuh``): no NCCL, no host step
per token. docs/tensor-parallel.md has the design.

Composition, not a copy: each rank is the single-GPU backend's DecodeKernel (kernel.py) over
the rank's repacked shard and KV cache, plus its receive buffer (peer.py) and its prefill;
this class adds the sharding and the N-way launch. The prefill is sharded too
(runtime/prefill_tp.py): each rank runs the prompt through its own shard and writes its own
KV heads, so no GPU ever holds more than its share of the layers (the checkpoint's tensors
stay where they were loaded, the host memory for --tp).

Sampling: greedy, temperature, top-k and top-p, by the single-GPU rule (top-k / top-p from
the whole vocabulary's logits, which every rank gathers: kernels/csrc/tp.cuh). NVLink
multicast is never used.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from dataclasses import replace

import torch

from monokernel import envs
from monokernel.errors import BackendUnavailableError, EngineFailedError, InvalidRequestError
from monokernel.kernels import layout
from monokernel.models.config import ModelConfig
from monokernel.models.transformer import KVCache
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.backends.monokernel.kernel import (
    NO_PROBE,
    STOP_GRACE_SECONDS,
    DecodeKernel,
    KernelBuild,
    KernelStuckError,
    Launch,
    Probe,
    TPLink,
    kernel_dims,
    monokernel_supported,
    stall_seconds,
)
from monokernel.runtime.backends.monokernel.peer import (
    DeviceBuffer,
    enable_peer_access,
    keeps_device,
    multicast_off,
)
from monokernel.runtime.backends.monokernel.probes import stage_profile
from monokernel.runtime.backends.monokernel.request import (
    WARMUP_SAMPLING,
    begin_masks,
    check_seeded,
    checked_steps,
    kernel_tokens,
    prefill_first_token,
    prefill_gives_first,
)
from monokernel.runtime.backends.monokernel.token_reader import read_tokens
from monokernel.runtime.calibration import shard_stats
from monokernel.runtime.constrained import TokenMatcher
from monokernel.runtime.logprobs import TokenLogprobs
from monokernel.runtime.prefill import Prefiller
from monokernel.runtime.prefill_tp import ShardedPrefill
from monokernel.runtime.sampling import SamplingParams, check_bias_ids
from monokernel.weights.checkpoint_quant import Fp8Blocks
from monokernel.weights.formats import DEFAULT_FORMAT
from monokernel.weights.group_quant import GroupQuant, quantize_rtn
from monokernel.weights.names import Weights
from monokernel.weights.quantize import (
    GroupsPlan,
    check_method,
    groups_method,
    groups_plan,
    groups_stream,
    int4_group_of,
    is_quantized,
    whole_row_scales,
)
from monokernel.weights.repack import repack
from monokernel.weights.shard import (
    ShardConfig,
    check_tp,
    check_tp_groups,
    rank_config,
    shard_config,
    shard_fp8_blocks,
    shard_groups,
    shard_weights,
    tp_blocks_stream,
)

_TAG_LIMIT = 2**32 - 1  # tags are u32 and never 0 (the zeroed buffers' value)


def rank_tensors(
    cfg: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    rank: int,
    tp: int,
    device: torch.device,
    fmt: str = DEFAULT_FORMAT,
    groups: Mapping[str, GroupQuant] | None = None,
    group: int = 0,
    act_stats: Mapping[str, torch.Tensor] | None = None,
) -> tuple[Weights, dict[str, GroupQuant] | None]:
    """Rank ``rank``'s tensors on ``device``, as its Rank takes them: the shard's dense ones
    in bf16, and its layers' matrices as groups where they stream from groups (else None):
    ``groups``, a checkpoint's own, split by shard_groups; or with ``fmt`` int4, its blocks
    of ``weights`` rounded as TP=1 rounds them (``group`` columns a group, searched with the
    slices of ``act_stats`` that match the rank's columns). A matrix packed from
    ``groups`` is never read from ``weights``: a GGUF's are made dense only when read
    (weights/lazy_weights.py), and the host would hold the whole model in them."""
    packed = () if groups is None else groups.keys()
    dense = shard_weights(cfg, weights, rank, tp, packed)
    mine: dict[str, GroupQuant] | None = None
    if groups is not None:
        mine = {k: g.to(device) for k, g in shard_groups(cfg, groups, rank, tp).items()}
    elif fmt == "int4":  # --quantize int4
        act = None if act_stats is None else shard_stats(cfg, act_stats, rank, tp)
        mine = {
            k: quantize_rtn(
                dense[k].to(device=device, dtype=torch.bfloat16),
                group,
                None if act is None else act[k],
            )
            for k in dense
            if is_quantized(k)
        }
    if mine is not None:  # the layers' matrices stream from their groups alone
        dense = {k: v for k, v in dense.items() if not is_quantized(k)}
    return {k: v.to(device=device, dtype=torch.bfloat16) for k, v in dense.items()}, mine


class Rank:
    """One rank: its shard's kernel, KV cache, prefill and receive buffer, on ``device``."""

    def __init__(
        self,
        sc: ShardConfig,
        weights: Weights,
        max_seq_len: int,
        device: torch.device,
        fmt: str = DEFAULT_FORMAT,
        row_scales: Mapping[str, torch.Tensor] | None = None,
        groups: Mapping[str, GroupQuant] | None = None,
        precision: str | None = None,
        fp8_blocks: Fp8Blocks | None = None,
    ) -> None:
        """``weights``: the rank's shard on ``device``, consumed (repacked layer by layer);
        ``fmt``: the layers' weight format; ``row_scales``: the column-split matrices' whole
        rows' scales (a quantised format's, weights/quantize.py whole_row_scales);
        ``groups``: the rank's blocks of the layers' 4- or 8-bit matrices on ``device``,
        consumed like ``weights`` (emptied; each layer's freed once packed: nothing after the
        repack reads them, the prefill multiplies by the packed matrices); ``precision``:
        the prefill's (runtime/prefill.py; default MONOKERNEL_PREFILL_PRECISION);
        ``fp8_blocks``: in fp8, the rank's block scales (shard_fp8_blocks)."""
        cfg = rank_config(sc)
        self.sc, self.cfg, self.device = sc, cfg, device
        plan = GroupsPlan((fmt, fp8_blocks.cols if fp8_blocks is not None else 0))
        own: dict[str, GroupQuant] | None = None
        if groups is not None:
            plan, own = groups_plan(cfg, groups)
        dims = kernel_dims(
            cfg, sc.tp, *plan.layers, sc.base.vocab_size, qkv=plan.qkv, down=plan.down
        )
        if isinstance(groups, MutableMapping):
            # The plan's copy of the mapping is then the only one, so repack's consume frees
            # each layer's groups: the rank never holds them whole beside its packed layers
            # and cache (at --tp 2 a Q4_K_M rank's would outweigh its bf16 layers).
            groups.clear()
        with torch.cuda.device(device):
            packed = repack(
                cfg,
                weights,
                max_seq_len,
                fold=False,
                fmt=fmt,
                row_scales=row_scales,
                consume=True,
                groups=own,
                fp8_blocks=fp8_blocks,
            )
            # After the repack: the cache takes the room the freed sources leave (the plan
            # counts the phases apart: runtime/memory_plan.py).
            self.cache = KVCache.allocate(cfg, max_seq_len, torch.bfloat16, device)
            self.kernel = DecodeKernel(cfg, dims, packed, self.cache, max_seq_len, device)
            # No graphs of its own: the sharded prefill captures each rank's whole prefill
            # with its exchanges (prefill_tp_graphs.py).
            self.prefill = Prefiller(
                cfg,
                packed,
                self.cache.k,
                self.cache.v,
                envs.MONOKERNEL_PREFILL_CHUNK,
                precision or envs.MONOKERNEL_PREFILL_PRECISION,
                graphs=False,
            )
        self.recv = DeviceBuffer(
            device.index, layout.tp_recv_bytes(sc.tp, cfg.hidden_size, sc.base.vocab_size)
        )
        self.reduce_bytes = layout.tp_reduce_bytes(sc.tp, cfg.hidden_size)

    def close(self) -> None:
        self.recv.free()
        self.kernel.make_current()
        self.kernel.close()


class MonokernelTPBackend:
    name = "monokernel"

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Weights,
        max_seq_len: int,
        device: torch.device,
        tp: int,
        quantize: str | None = None,
        groups: Mapping[str, GroupQuant] | None = None,
        prefill_precision: str | None = None,
        fp8_blocks: Fp8Blocks | None = None,
        act_stats: Mapping[str, torch.Tensor] | None = None,
        first_token: str | None = None,
    ) -> None:
        """``quantize``: the layers' matrices in that format (--quantize), packed per rank
        with TP=1's scales (int4: TP=1's groups, whole on each rank, searched with the
        slices of ``act_stats``, the input statistics of runtime/calibration.py, that match
        the rank's columns), so every rank count computes the same quantised model.
        ``groups``: a 4- or 8-bit checkpoint's own groups (with ``quantize`` "int4" or
        "int8"), each rank streaming its blocks of them.
        ``fp8_blocks``: an FP8 checkpoint's block scales (with ``quantize`` "fp8"), each rank
        streaming its blocks of the checkpoint's values with them where its layers stream as
        tiles and its column blocks are whole blocks; else re-quantised a row, as without
        them.
        ``prefill_precision``: as the single-GPU backend's (runtime/prefill.py).
        ``first_token``: where a request's first token comes from, as on one GPU
        (FIRST_TOKEN_SOURCES; default MONOKERNEL_FIRST_TOKEN): "prefill" gathers the ranks'
        vocabulary ranges of the prompt's last logits (ShardedPrefill.run), so the time to
        first token holds no decode step."""
        self.first_from_prefill = prefill_gives_first(first_token)
        multicast_off()  # nothing here uses NVLS; keep any library we load off it too
        check_tp(cfg, tp)  # TensorParallelError naming the numbers and the valid sizes
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise BackendUnavailableError(f"--tp {tp} needs {tp} NVIDIA GPUs")
        first = device.index if device.index is not None else torch.cuda.current_device()
        count = torch.cuda.device_count()
        if first + tp > count:
            raise BackendUnavailableError(
                f"--tp {tp} needs {tp} GPUs from cuda:{first} on; {count} visible"
            )
        self.devices = [torch.device("cuda", first + r) for r in range(tp)]
        self.device = self.devices[0]
        for d in self.devices:
            ok, why = monokernel_supported(d)
            if not ok:
                raise BackendUnavailableError(f"engine 'monokernel' cannot run on {d}: {why}")
        enable_peer_access([d.index for d in self.devices])
        self.cfg, self.tp, self.max_seq_len = cfg, tp, max_seq_len
        fmt = DEFAULT_FORMAT if quantize is None else check_method(quantize)
        if groups is not None and not groups_stream(rank_config(shard_config(cfg, 0, tp)), groups):
            groups, fmt, quantize = None, DEFAULT_FORMAT, None  # dequantised values, in bf16
        if groups is not None and fmt != groups_method(groups):
            raise InvalidRequestError(
                f"a checkpoint's own groups stream as {groups_method(groups)}, not {fmt}"
            )
        if fp8_blocks is not None and fmt != "fp8":
            raise InvalidRequestError(f"a checkpoint's FP8 block scales stream as fp8, not {fmt}")
        if fp8_blocks is not None and not tp_blocks_stream(cfg, tp, fp8_blocks):
            fp8_blocks = None
        group = 0
        if groups is not None or fmt == "int4":  # TP=1's groups, whole in every rank's columns
            group = int4_group_of(cfg)
            if groups is not None:
                group = max(g.group for g in groups.values())
            check_tp_groups(cfg, tp, group)
        # The weights stay where they are (the engine loads them to the host for --tp): each
        # rank's shard goes to its GPU, in bf16, one at a time. With a checkpoint's own groups
        # the layer matrices are never read (rank_tensors).
        scales = None
        if quantize is not None and fmt != "int4" and groups is None and fp8_blocks is None:
            scales = whole_row_scales(weights, fmt, cfg.num_layers)
        self.ranks: list[Rank] = []
        with keeps_device():  # DeviceBuffer and the kernels make their GPU current
            for r, dev in enumerate(self.devices):
                shard, mine = rank_tensors(cfg, weights, r, tp, dev, fmt, groups, group, act_stats)
                rows = None if scales is None else {k: v.to(dev) for k, v in scales.items()}
                sc = shard_config(cfg, r, tp)
                blocks = None
                if fp8_blocks is not None:
                    blocks = shard_fp8_blocks(cfg, fp8_blocks, r, tp).to(dev)
                rank = Rank(sc, shard, max_seq_len, dev, fmt, rows, mine, prefill_precision, blocks)
                self.ranks.append(rank)
                del shard, mine
        self.prefill = ShardedPrefill([rk.prefill for rk in self.ranks])
        self._tag = 1  # next generation; carried across requests so buffers are never reset
        self.failure: str | None = None  # why no more requests can run (RequestDriver's)
        self.warmup_s = 0.0
        if envs.MONOKERNEL_PREFILL_WARMUP:
            t0 = time.perf_counter()
            # Every prefill bucket's graphs (prefill_tp_graphs.py), then two-token
            # requests, greedy and sampled (the single-GPU backend's), so the first real one
            # pays none of the first-use costs (the ranks' first launches, the prefill's first
            # kernels, the whole-vocabulary draw); each request prefills its whole prompt, so
            # what they leave in the caches is never read.
            if self.prefill.graphs is not None:
                self.prefill.graphs.warm()
            for sampling in WARMUP_SAMPLING:
                for _ in self._run((0, 0), 2, sampling, [], None):
                    pass
            self.warmup_s = time.perf_counter() - t0

    # ---- one request --------------------------------------------------------------------

    def _reset_tags(self) -> None:
        """Zero every receive buffer and restart the tags (before u32 tags would wrap)."""
        with keeps_device():
            for rk in self.ranks:
                rk.recv.zero()
        self._tag = 1

    def _prefill(self, prompt_ids: Sequence[int], logits: bool) -> torch.Tensor | None:
        """The prompt into the ranks' caches: every token and the last one's logits [V] on
        rank 0's GPU with ``logits``; else every token but the last (the kernels' first
        step computes it)."""
        ids = prompt_ids if logits else prompt_ids[:-1]
        out = self.prefill.run(ids, 0, logits) if ids else None
        for rk in self.ranks:  # the kernels run on their own streams
            torch.cuda.synchronize(rk.device)
        return out

    def _run(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        stop_ids: Sequence[int],
        cancel: CancelToken | None,
        probes: Sequence[Probe] | None = None,
        logprobs: list[TokenLogprobs] | None = None,
        matcher: TokenMatcher | None = None,
    ) -> Iterator[int]:
        """``probes``: each rank's debug inputs (forced tokens, its logits shard).
        ``logprobs``: with ``sampling.logprobs`` set, each token's record (rank 0 writes
        them) is appended before the token is yielded. ``matcher``: a constrained request's
        grammar; each step's mask goes to every rank (its LM head masks its own ids), a step
        ahead as on one GPU (request.py masks_ahead)."""
        if self.failure is not None:
            raise EngineFailedError(self.failure)
        n = len(prompt_ids)
        n_steps = checked_steps(
            prompt_ids, stop_ids, max_new_tokens, self.max_seq_len, self.cfg.vocab_size
        )
        check_bias_ids(sampling, self.cfg.vocab_size)
        check_seeded(sampling)
        # The debug and profiling runs (probes) number their steps from the kernel's first.
        from_prefill = self.first_from_prefill and probes is None
        span = 2 * self.cfg.num_layers * max(n_steps, 1)  # tags this launch may use
        if self._tag + span >= _TAG_LIMIT:
            self._reset_tags()
        tag = self._tag
        self._tag += span  # advanced up front: an aborted launch never has its tags reused
        # The all-reduces' generations restart at 1 each launch (8-bit tags in the words,
        # csrc/tp.cuh): every rank's reduction area is zeroed, and waited for, before any
        # rank launches (the previous launch has finished on every rank: _run waits for it).
        with keeps_device():
            for rk in self.ranks:
                rk.recv.zero(rk.reduce_bytes)
        logits = self._prefill(prompt_ids, from_prefill)
        # Positions the caches hold before the kernels' first step, and that step's input.
        held, step_in, first, first_logprobs = n - 1, prompt_ids[-1], None, None
        if logits is not None:
            want = logprobs is not None and sampling.logprobs is not None
            with torch.cuda.device(self.device):
                first, first_logprobs = prefill_first_token(
                    logits, sampling, prompt_ids, matcher, want
                )
            held, step_in = n, first
            n_steps = 0 if first in stop_ids else n_steps - 1

        def the_first() -> Iterator[int]:  # the prefill's token, unless cancelled already
            if first is not None and not (cancel is not None and cancel.is_set()):
                if first_logprobs is not None and logprobs is not None:
                    logprobs.append(first_logprobs)
                yield first

        if n_steps == 0:  # the first token was all (a stop id or max_tokens 1)
            yield from the_first()
            return
        grammars = [rk.kernel.grammar for rk in self.ranks] if matcher is not None else []
        mask_tag = 0 if matcher is None else begin_masks(grammars, matcher, n_steps)
        launch = Launch(step_in, held, n_steps, sampling, len(stop_ids), mask_tag)
        fed = () if first is None else (first,)
        peers = [rk.recv.ptr for rk in self.ranks]
        params = []
        lead = self.ranks[0].kernel  # rank 0 writes the tokens and reads the cancel word
        out = lead.token_words
        with keeps_device():
            for r, rk in enumerate(self.ranks):
                rk.kernel.make_current()
                with torch.cuda.device(rk.device):  # the fill goes before prepare's wait
                    rules = rk.kernel.rules.fields(sampling, prompt_ids, fed)
                rk.kernel.prepare(stop_ids)
                link = TPLink(peers, rk.recv.ptr, rk.sc.rank, rk.sc.vocab_start, tag)
                probe = NO_PROBE if probes is None else probes[r]
                params.append(rk.kernel.params(replace(launch, rules=rules), probe, link))
            lead.make_current()
            lead.clear_host_words(n_steps)
            # All N kernels spin on each other, so all must be resident together: launch each
            # on its own stream and device, back to back, never waiting in between.
            for rk, p in zip(self.ranks, params, strict=True):
                rk.kernel.make_current()
                rk.kernel.launch(p, held + n_steps)
        finished = False

        def check(stalled_s: float) -> None:
            with keeps_device():
                for rk in self.ranks[1:]:  # raises on a fault of any rank
                    rk.kernel.make_current()
                    rk.kernel.finished()
                lead.make_current()
                done = lead.finished()
            if done and not out[1]:
                raise KernelStuckError("the monokernel (rank 0) exited without finishing")
            if stalled_s > stall_seconds():
                raise KernelStuckError(
                    f"the TP monokernels produced no token for {stall_seconds():.0f} s "
                    "(MONOKERNEL_STALL_SECONDS)"
                )

        failed = False
        tokens = kernel_tokens(
            read_tokens(out, cancel, check),
            n_steps,
            matcher,
            grammars,
            lead.rules,
            sampling,
            logprobs,
        )
        try:
            yield from the_first()  # the kernels are already running on the next one
            finished = yield from tokens
        except GeneratorExit:
            raise
        except BaseException:
            failed = True
            raise
        finally:
            if not finished:
                lead.cancel()  # rank 0 reads it once per token and tells the others
            try:
                with keeps_device():
                    for rk in self.ranks:
                        rk.kernel.wait(STOP_GRACE_SECONDS if failed else None)
            except RuntimeError as e:  # still running when cancelled, or faulted
                self.failure = f"the TP monokernels cannot run more requests ({e}); restart"
                raise EngineFailedError(self.failure) from e

    # ---- the Backend contract -------------------------------------------------------------

    def stream(self, request: DecodeRequest, cancel: CancelToken) -> Iterator[int]:
        yield from self._run(
            request.prompt_ids,
            request.max_new_tokens,
            request.sampling,
            sorted(request.stop_token_ids),
            cancel,
            logprobs=request.logprobs,
            matcher=request.matcher,
        )

    def teacher_forced_logits(
        self, prompt_ids: Sequence[int], next_ids: Sequence[int]
    ) -> torch.Tensor:
        """Debug mode: logits [len(next_ids), V] float32 on rank 0's GPU, the ranks' vocabulary
        shards side by side; step s feeds the given token instead of the kernel's sample."""
        steps = len(next_ids)
        forced_list = [prompt_ids[-1], *next_ids[:-1]]
        forced = [
            torch.tensor(forced_list, dtype=torch.int32, device=rk.device) for rk in self.ranks
        ]  # [steps] per rank
        shards = [
            torch.full(
                (steps, rk.cfg.vocab_size), float("nan"), dtype=torch.float32, device=rk.device
            )
            for rk in self.ranks
        ]  # [steps, V_rank] per rank
        probes = [Probe(forced=f, debug_logits=s) for f, s in zip(forced, shards, strict=True)]
        greedy = SamplingParams(temperature=0.0, max_tokens=max(steps, 1))
        produced = sum(1 for _ in self._run(prompt_ids, steps, greedy, (), None, probes))
        if produced != steps:
            raise RuntimeError(f"the kernels ran {produced} of {steps} forced steps")
        for rk in self.ranks:
            torch.cuda.synchronize(rk.device)
        return torch.cat([s.to(self.device) for s in shards], dim=1)

    def timed_run(
        self, prompt_ids: Sequence[int], n_steps: int, step: int, skew: bool = False
    ) -> list[list[int]]:
        """Each rank's raw timing slots of step ``step`` of a greedy run (kernels/layout.py
        names them; ``skew``: room for a -DMK_SKEW=1 build's per-CTA points), by rank: the
        single-GPU backend's probe (probes.py) on every GPU of the request."""
        timing = [
            torch.zeros(
                layout.timing_words(rk.cfg.num_layers, rk.kernel.grid, skew),
                dtype=torch.int64,
                device=rk.device,
            )
            for rk in self.ranks
        ]
        probes = [Probe(timing=t, timing_step=step) for t in timing]
        greedy = SamplingParams(temperature=0.0, max_tokens=n_steps)
        for _ in self._run(prompt_ids, n_steps, greedy, (), None, probes):
            pass
        return [t.tolist() for t in timing]  # .tolist() waits for each GPU

    def profile_step(self, prompt_ids: Sequence[int], n_steps: int, step: int) -> dict[str, float]:
        """The stages of one decode step as CTA 0 of each rank sees them (probes.py
        stage_profile): rank 0's keys as one GPU's, the others' prefixed ``r<rank>.``. The
        waits for the peers' partial sums fall in the work of the stage that reads them (D
        after the O projection; A and the LM head after the down projection): the stage skew
        (tools/stage_skew.py --tp) shows them apart."""
        out: dict[str, float] = {}
        for r, t in enumerate(self.timed_run(prompt_ids, n_steps, step)):
            prefix = "" if r == 0 else f"r{r}."
            for k, v in stage_profile(t, self.cfg.num_layers).items():
                out[prefix + k] = v
        return out

    # ---- build variants side by side (tools/kernel_variants.py --tp) ---------------------

    @property
    def kernels(self) -> list[KernelBuild]:
        """The build each rank launches, in rank order."""
        return [rk.kernel.build for rk in self.ranks]

    def load_kernels(self) -> list[KernelBuild]:
        """Each rank's build under the build flags in force now, loaded without switching to
        it (the single-GPU backend's ``load_kernels``): variants then run on the same shards,
        caches and receive buffers."""
        with keeps_device():
            return [rk.kernel.load_build() for rk in self.ranks]

    def use_kernels(self, builds: Sequence[KernelBuild]) -> None:
        """Launch ``builds`` (from ``load_kernels``, one a rank) from now on."""
        for rk, build in zip(self.ranks, builds, strict=True):
            rk.kernel.use_build(build)

    def unload_kernels(self, builds: Sequence[KernelBuild]) -> None:
        """Unload builds from ``load_kernels`` that no rank launches any more (each from its
        own GPU's context)."""
        with keeps_device():
            for rk, build in zip(self.ranks, builds, strict=True):
                if build is not rk.kernel.build:
                    rk.kernel.make_current()
                    build.unload()

    def close(self) -> None:
        """Free the device memory; the backend is unusable afterwards (a second call does
        nothing)."""
        if not self.ranks:
            return
        with keeps_device():
            for rk in self.ranks:
                rk.close()
        self.ranks = []
        # Nothing of the closed backend keeps the weights, caches or buffers alive (the
        # single-GPU backend's rule): the sharded prefill holds every rank's prefiller and its
        # graphs' memory pools, and a caller that opens the next backend before this
        # object is collected would capture beside them (test_tp's fourth int4 backend ran
        # out of memory mid-capture). The graphs refer back to the prefill, a cycle that only
        # the garbage collector would break: close() drops them first, then frees the
        # exchange's buffers (cuMemAlloc, which no collector frees).
        self.prefill.close()
        del self.prefill
