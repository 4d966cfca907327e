"""The monokernel backend: one persistent CUDA kernel per request runs every decode step.

It composes the parts, one job each: the kernel's builds, buffers and launch (kernel.py), the
KV cache with its prefill and prefix reuse (kv.py), the request driver (request.py), the
hand-off buffer's placement search (handoff_placement.py) and the debug probes (probes.py).
The cache is sized at load time against the GPU's free memory (``runtime/kv_memory.py``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping, Sequence

import torch

from monokernel import envs
from monokernel.errors import BackendUnavailableError, InvalidRequestError, UnsupportedModelError
from monokernel.kernels import build as kbuild
from monokernel.models.config import ModelConfig
from monokernel.runtime import kv_memory
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.backends.monokernel.drafted import drafted_tokens
from monokernel.runtime.backends.monokernel.handoff_placement import (
    HandoffChoice,
    choose_handoff,
    handoff_places,
)
from monokernel.runtime.backends.monokernel.kernel import (
    DecodeKernel,
    KernelBuild,
    kernel_dims,
    monokernel_supported,
)
from monokernel.runtime.backends.monokernel.kv import KVStore
from monokernel.runtime.backends.monokernel.probes import Probes
from monokernel.runtime.backends.monokernel.request import (
    WARMUP_SAMPLING,
    RequestDriver,
    prefill_gives_first,
)
from monokernel.runtime.backends.monokernel.verify_pass import Drafting, PassKernel, drawn_in_passes
from monokernel.runtime.prefill_graphs import graphs_enabled
from monokernel.runtime.prefix_cache import PrefixCache
from monokernel.runtime.speculative import SpeculationStats, SpeculativeConfig, passes_serve
from monokernel.weights.checkpoint_quant import Fp8Blocks
from monokernel.weights.formats import DEFAULT_FORMAT
from monokernel.weights.group_quant import GroupQuant
from monokernel.weights.lazy_weights import cast_mapping
from monokernel.weights.names import Weights
from monokernel.weights.quantize import (
    GroupsPlan,
    blocks_stream,
    check_method,
    groups_method,
    groups_plan,
    groups_stream,
    int4_group_of,
)
from monokernel.weights.repack import repack


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
        consume_weights: bool = False,
        quantize: str | None = None,
        groups: Mapping[str, GroupQuant] | None = None,
        fp8_blocks: Fp8Blocks | None = None,
        act_stats: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Knobs (docs/long-context.md; each ``None`` takes its setting in monokernel/envs.py):

        ``prefix_reuse``: reuse the K/V of earlier requests' matching prefixes
        (MONOKERNEL_PREFIX_REUSE). ``snapshot_bytes``: budget for snapshots of earlier
        conversations (default: twice the cache, at most a quarter of the memory left after
        loading; 0 keeps only the live cache). ``prefill_chunk`` / ``prefill_precision``: see
        runtime/prefill.py (MONOKERNEL_PREFILL_CHUNK / MONOKERNEL_PREFILL_PRECISION).
        ``first_token``: where a request's first token comes from (FIRST_TOKEN_SOURCES;
        MONOKERNEL_FIRST_TOKEN). ``handoff_search``: fresh places for the hand-off buffer
        timed against its own at load, the fastest kept (handoff_placement.py;
        MONOKERNEL_HANDOFF_SEARCH; 0: off). ``consume_weights``: each layer's tensors are
        popped from ``weights`` as they are repacked (weights.repack), for callers that hold
        no other reference and a model the GPU holds once but not twice. ``quantize``: the
        weight format the layers' matrices are packed in (weights/quantize.py: fp8, int8,
        int4), quantised from the checkpoint at load; the LM head and the embedding stay as
        they are (None: bf16 throughout). ``groups``: a 4-bit checkpoint's own groups
        (Checkpoint.groups), or 8-bit ones (a GGUF file's 5- to 8-bit blocks), packed in
        int4 or int8 groups with their bits unchanged (a stage may stream its own width:
        quantize.py GroupsPlan); needs ``quantize`` "int4" or "int8" (quantize.py
        groups_method), and ``weights`` are then only read for what is not a layer's matrix.
        ``fp8_blocks``: an FP8 checkpoint's block scales (Checkpoint.fp8_blocks), needs
        ``quantize`` "fp8": where the layers stream as tiles (weights/quantize.py
        blocks_stream), the checkpoint's own E4M3 values are packed with them; elsewhere each
        row is re-quantised with one scale, as without them. ``act_stats``: with ``quantize``
        "int4", each layer matrix's input statistics (runtime/calibration.py) that the int4
        search is weighted by, the other engines' own (fake_quantize).
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
        self.first_from_prefill = prefill_gives_first(first_token)
        fmt = DEFAULT_FORMAT if quantize is None else check_method(quantize)
        if fold_norms and fmt != DEFAULT_FORMAT:
            # Folding would quantise W * g, not the checkpoint's W that the other engines use.
            raise InvalidRequestError("fold_norms: not with a quantised weight format")
        if groups is not None and not groups_stream(cfg, groups):
            groups, fmt = None, DEFAULT_FORMAT  # their values, dequantised, in bf16
        if groups is not None and fmt != groups_method(groups):
            raise InvalidRequestError(
                f"a checkpoint's own groups stream as {groups_method(groups)}, not {fmt}"
            )
        if fp8_blocks is not None and fmt != "fp8":
            raise InvalidRequestError(f"a checkpoint's FP8 block scales stream as fp8, not {fmt}")
        if fp8_blocks is not None and not blocks_stream(cfg, fp8_blocks):
            fp8_blocks = None
        group = fp8_blocks.cols if fp8_blocks is not None else 0
        plan = GroupsPlan((fmt, group))
        if groups is not None:
            plan, groups = groups_plan(cfg, groups)
        elif fmt == "int4":
            plan = GroupsPlan((fmt, int4_group_of(cfg)))
        # Refuses bad shapes first.
        dims = kernel_dims(cfg, 1, *plan.layers, qkv=plan.qkv, down=plan.down)
        # Compiled (or found cached) before the weights are touched: a failed build leaves
        # them whole, for the engine `auto` falls back to, even when repacking consumes them.
        for d in (dims, dataclasses.replace(dims, group_units=False)):
            kbuild.build(d)
        chunk = prefill_chunk or envs.MONOKERNEL_PREFILL_CHUNK
        precision = prefill_precision or envs.MONOKERNEL_PREFILL_PRECISION
        # Refuse a context that cannot fit before allocating anything for it, or taking the
        # weights apart. Measured now, with the layers' sources on the device: the check
        # counts repacking them (the sources it frees included) and then the cache beside the
        # packed layers, in the order they are allocated below (kv_memory.load_phases).
        convert = weights["embed"].dtype != torch.bfloat16
        # An AWQ/GPTQ checkpoint's groups were read to the GPU, a GGUF's stay on the host;
        # either way their layer matrices are never made dense (weights/lazy_weights.py).
        on_device = groups is not None and next(iter(groups.values())).q.device.type != "cpu"
        packing = kv_memory.Packing(
            fmt,
            plan if groups is not None else None,
            fp8_blocks.cols if fp8_blocks is not None else 0,
            consume=consume_weights,
            dense_layers=groups is None,
            groups_on_device=on_device,
            fold=fold_norms,
            convert=convert,
        )
        free = kv_memory.free_device_bytes(device)
        phases = kv_memory.check_load_fits(
            cfg, max_seq_len, free, chunk, precision, str(device), packing, graphs_enabled(device)
        )
        if convert:  # a GGUF's unread layer matrices stay unread (weights/lazy_weights.py)
            weights = cast_mapping(weights, torch.bfloat16)  # type: ignore[assignment]
        # Prefill and decode both run on the repacked tensors, so nothing here keeps the
        # checkpoint's own (fused-away) matrices alive; repack copies the groups to the
        # device a layer at a time.
        if fp8_blocks is not None:
            fp8_blocks = fp8_blocks.to(device)
        packed = repack(
            cfg,
            weights,
            max_seq_len,
            fold=fold_norms,
            fmt=fmt,
            consume=consume_weights,
            groups=groups,
            fp8_blocks=fp8_blocks,
            act_stats=act_stats if fmt == "int4" and groups is None else None,
        )
        del weights
        if snapshot_bytes is None:
            # What is left once the cache and the prefill have their room beside the packed
            # weights (repacking's transients are gone by then).
            snapshot_bytes = KVStore.default_snapshot_bytes(cfg, max_seq_len, free - phases.serving)
        if prefix_reuse is None:
            prefix_reuse = envs.MONOKERNEL_PREFIX_REUSE
        self.kv = KVStore(
            cfg, packed, max_seq_len, device, chunk, precision, prefix_reuse, snapshot_bytes
        )
        self.kernel = DecodeKernel(cfg, dims, packed, self.kv.cache, max_seq_len, device)
        self.driver = RequestDriver(self.kernel, self.kv)
        # Speculative decoding (set_speculative): the config, the pass build, why a shape has
        # none, and the last request's counts.
        self.speculative: SpeculativeConfig | None = None
        self.passes: PassKernel | None = None
        self.drafts_note: str | None = None
        self.speculation = SpeculationStats()
        self.probes = Probes(self.driver)
        self.closed = False
        # What the search timed (None: it did not run).
        self.handoff_choice: HandoffChoice | None = choose_handoff(self, cfg.vocab_size, places)
        # After the search (a captured graph pins the weights' addresses): every fresh
        # prompt's prefill graph now, so no request's first token waits for one.
        self.warmup_s = 0.0
        graphs = self.kv.prefill.graphs
        if envs.MONOKERNEL_PREFILL_WARMUP:
            t0 = time.perf_counter()
            with torch.cuda.device(device):
                if graphs is not None:
                    graphs.warm()
                # Then two short requests, greedy and sampled, so the first real one pays
                # none of the request path's first uses (the host-side draw's kernels, the
                # token reader); what they leave in the cache is dropped.
                for sampling in WARMUP_SAMPLING:
                    req = DecodeRequest((0, 1), sampling, 2, frozenset())
                    for _ in self.stream(req, CancelToken()):
                        pass
                self.kv.prefix.invalidate()
                torch.cuda.synchronize(device)
            self.warmup_s = time.perf_counter() - t0

    # ---- the Backend contract -------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        """Why this backend can run no more requests (a kernel that faulted, or stalled and
        would not stop); None while it can."""
        return self.driver.failure

    def stream(self, request: DecodeRequest, cancel: CancelToken) -> Iterator[int]:
        drafting = self._drafting(request)
        self.speculation = drafting.stats if drafting is not None else SpeculationStats()
        if drafting is not None:  # steps and passes taking turns
            yield from drafted_tokens(
                self.driver, request.prompt_ids, request.max_new_tokens, request.sampling,
                sorted(request.stop_token_ids), cancel, self.first_from_prefill, drafting,
            )  # fmt: skip
            return
        yield from self.driver.run(
            request.prompt_ids,
            request.max_new_tokens,
            request.sampling,
            sorted(request.stop_token_ids),
            cancel,
            first_from_prefill=self.first_from_prefill,
            matcher=request.matcher,
            logprobs=request.logprobs,
        )

    # ---- speculative decoding (docs/speculative.md) ---------------------------------------

    def set_speculative(self, config: SpeculativeConfig | None) -> None:
        """Draft from each request's own tokens and verify K + 1 positions a pass
        inside the kernel (a pass build of K + 1 positions beside the step build, over the
        same weights and cache; built, or found cached, now). A shape whose passes do not
        fit a CTA makes no drafts (``drafts_verified``; ``drafts_note`` says why)."""
        positions = None if config is None else config.num_tokens + 1
        if self.passes is not None and self.passes.positions != positions:
            self.passes.close()
            self.passes = None
        self.speculative, self.drafts_note = config, None
        if config is None or positions is None or self.passes is not None:
            return
        if positions > kbuild.MAX_PASS_POSITIONS:
            raise InvalidRequestError(
                f"--num-speculative-tokens {config.num_tokens}: the monokernel verifies at most "
                f"{kbuild.MAX_PASS_POSITIONS - 1} drafted tokens a pass"
            )
        try:
            self.passes = PassKernel(self.kernel, positions)
        except UnsupportedModelError as e:
            self.drafts_note = str(e)

    def drafts_verified(self) -> bool:
        """Whether requests get drafts (the pass build exists for this shape)."""
        return self.passes is not None

    def drafts_by_default(self) -> bool:
        """Whether requests draft without --speculative: wherever the pass build fits (the
        default model's spec-chat 1.09x, spec-edit 1.31x at K = 3; H200, session 51)."""
        return True

    def _drafting(self, request: DecodeRequest) -> Drafting | None:
        """How ``request`` runs on the pass build, or None where it decodes by steps: one
        drawn by top-k, top-p or min_p (verify_pass.drawn_in_passes), one that passes cannot
        serve (speculative.passes_serve), or one whose positions reach the long-context
        attention that passes do not have."""
        config, passes = self.speculative, self.passes
        if config is None or passes is None:
            return None
        if not drawn_in_passes(request.sampling, self.kernel.cfg.vocab_size):
            return None
        if not passes_serve(request):
            return None
        context = len(request.prompt_ids) + request.max_new_tokens + passes.positions
        if not passes.covers(min(context, self.max_seq_len)):
            return None
        longest, shortest = config.bounds("monokernel")
        return Drafting(passes, (shortest, longest), SpeculationStats())

    def teacher_forced_logits(
        self, prompt_ids: Sequence[int], next_ids: Sequence[int]
    ) -> torch.Tensor:
        """Debug mode: logits [len(next_ids), V] float32, where step s feeds the kernel the
        given token (the last prompt token, then next_ids[s-1]) instead of its own sample."""
        return self.probes.teacher_forced_logits(prompt_ids, next_ids)

    def close(self) -> None:
        """Free the device memory; the backend is unusable afterwards (a second call does
        nothing)."""
        if self.closed:
            return
        self.closed = True
        self.set_speculative(None)
        self.kernel.close()
        self.kv.close()
        # Nothing of the closed backend keeps the weights, the cache or the buffers alive.
        del self.probes, self.driver, self.kernel, self.kv

    # ---- prefill and prefix reuse ---------------------------------------------------------

    @property
    def prefix(self) -> PrefixCache:
        """What the KV cache holds for reuse (runtime/prefix_cache.py); its ``plan`` tells
        what a prompt would reuse (bench/measure.py asks it)."""
        return self.kv.prefix

    def set_prefix_reuse(self, enabled: bool) -> None:
        """Turn prefix reuse on or off (off: every request prefills its whole prompt). Either
        way the snapshots are freed and the live cache's contents forgotten, so what a
        request reuses next was computed under the new setting."""
        self.kv.set_prefix_reuse(enabled)

    def prefill_logits(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        """Prefill ``prompt_ids`` (reusing a cached prefix like a request would) and return
        the last token's logits [V] float32, from the prefill path alone (no kernel)."""
        return self.kv.prefill_logits(prompt_ids)

    # ---- probes ---------------------------------------------------------------------------

    def timed_run(
        self, prompt_ids: Sequence[int], n_steps: int, step: int, skew: bool = False
    ) -> list[int]:
        """The raw timing slots of step ``step`` of a greedy run (kernels/layout.py names
        them; ``skew``: room for a -DMK_SKEW=1 build's per-CTA points; probes.py)."""
        return self.probes.timed_run(prompt_ids, n_steps, step, skew)

    def profile_step(self, prompt_ids: Sequence[int], n_steps: int, step: int) -> dict[str, float]:
        """Time the stages of one decode step (greedy run of ``n_steps``), as CTA 0 sees them.

        Returns µs per stage kind summed over layers: ``<stage>.work`` (CTA 0's own work) and
        ``<stage>.wait`` (its wait at the grid barrier that ends the stage); stages A-E per
        layer, F the LM head, S sampling and the token hand-off.
        """
        return self.probes.profile_step(prompt_ids, n_steps, step)

    def timed_decode(self, forced: torch.Tensor, start_pos: int) -> float:
        """Seconds a decode step takes in one launch of len(forced) teacher-forced greedy
        steps from ``start_pos``, on whatever the cache holds below it: for timing only
        (handoff_placement.py). The cache's contents are forgotten afterwards."""
        self.kv.prefix.invalidate()
        return self.kernel.timed_decode(forced, start_pos)

    # ---- where the kernel's data lies, and which build runs (tools/) ------------------------

    @property
    def grid(self) -> int:
        """CTAs a launch runs: one per SM."""
        return self.kernel.grid

    @property
    def handoff(self) -> torch.Tensor:
        """The buffer the tagged hand-off vectors lie in (float32)."""
        return self.kernel.handoff

    def use_handoff(self, buf: torch.Tensor) -> None:
        """Put the tagged hand-off vectors in ``buf`` (float32, as many elements as
        ``self.handoff``). Where they lie moves decode speed by up to ~1% on an H100, so
        builds timed side by side share one buffer (tools/kernel_variants.py); launches zero
        it, so sharing between backends that never run at once is safe."""
        self.kernel.use_handoff(buf)

    def streamed_weights(self) -> list[torch.Tensor]:
        """The matrices the kernel streams every token: each layer's wqkv, wo, wgu and wdown,
        then the LM head (the order ``use_weights`` takes)."""
        return self.kernel.streamed_weights()

    def use_weights(self, tensors: Sequence[torch.Tensor]) -> None:
        """Stream ``tensors`` (the values of ``streamed_weights()``, in its order, wherever
        they lie) from now on; the prefill reads them too. For measuring whether where they
        lie moves decode speed. Not once the prefill has captured CUDA graphs: those keep the
        old addresses."""
        if not self.kv.weights_movable():
            raise RuntimeError("the weights cannot move once the prefill's graphs hold them")
        self.kernel.use_weights(tensors)

    @property
    def kernels(self) -> KernelBuild:
        """The build this backend launches."""
        return self.kernel.build

    def load_kernels(self) -> KernelBuild:
        """Build (or find cached) and load this backend's kernels under the build flags in
        force now, without switching to them: variants of a build then run on the same
        weights, cache and buffers (tools/kernel_variants.py). The caller unloads a build
        it no longer uses; ``close`` unloads the one in use."""
        return self.kernel.load_build()

    def use_kernels(self, build: KernelBuild) -> None:
        """Launch ``build`` (from ``load_kernels``) from now on."""
        self.kernel.use_build(build)

    def unload_kernels(self, build: KernelBuild) -> None:
        """Unload ``build`` (from ``load_kernels``) unless it is the one launched (``close``
        unloads that)."""
        if build is not self.kernel.build:
            build.unload()
