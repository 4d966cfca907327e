"""Engine: tokenize -> prefill -> decode on a backend -> stream text events.

The one API everything else (CLI, server, benchmarks) wraps::

    engine = Engine(model=None, config=EngineConfig())  # None: the default model
    for event in engine.generate("def reverse(s):", SamplingParams(max_tokens=64)):
        print(event.text, end="")
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from monokernel import envs
from monokernel.errors import BackendUnavailableError, InvalidRequestError
from monokernel.models.config import ModelConfig
from monokernel.runtime import kv_memory
from monokernel.runtime.backends import create_backend, fallback_engine, resolve_engine
from monokernel.runtime.backends.base import (
    Backend,
    CancelToken,
    DecodeRequest,
    planned_reuse,
)
from monokernel.runtime.constrained import (
    Constraint,
    ConstraintError,
    GrammarCompiler,
    TokenMatcher,
    unsupported_reason,
)
from monokernel.runtime.logprobs import TokenLogprobs
from monokernel.runtime.memory_plan import (
    ContextPlan,
    ContextTooLargeError,
    LayerPacking,
    PlanSettings,
    announced_packing,
    dense_weight_bytes,
    gib,
    layer_packing,
    plan_context,
)
from monokernel.runtime.prefill_graphs import graphs_enabled
from monokernel.runtime.sampling import (
    SamplingParams,
    unsupported_sampling_reason,
)
from monokernel.runtime.speculative import SpeculativeConfig
from monokernel.tokenizer.detokenize import IncrementalDetokenizer
from monokernel.tokenizer.stop_strings import StopStringMatcher
from monokernel.tokenizer.tokenizer import Prompt, Tokenizer
from monokernel.weights.checkpoint_quant import Fp8Blocks
from monokernel.weights.group_quant import GroupQuant
from monokernel.weights.lazy_weights import cast_mapping
from monokernel.weights.loader import (
    Announced,
    Checkpoint,
    RunFormats,
    load_checkpoint,
    reads_gguf,
    resolve_model_path,
    run_formats,
)
from monokernel.weights.quantize import check_method
from monokernel.weights.safetensors_loader import cast_weights

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    engine: str = "auto"  # auto | reference | torch | monokernel
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16
    # None: on a GPU the longest that fits up to the model's maximum (torch and reference:
    # at most 8192), on the CPU min(model's maximum, 8192); see runtime/memory_plan.py.
    max_model_len: int | None = None
    progress: bool = True  # download and load progress on stderr, and notes on slow steps
    tp: int = 1  # tensor-parallel GPUs (monokernel only): cuda:0..tp-1, or from --device cuda:N
    # Draft from the request's own tokens and verify several a pass (runtime/speculative.py;
    # the monokernel's greedy and temperature-sampled requests in its pass build,
    # docs/speculative.md). None: one token a pass.
    speculative: SpeculativeConfig | None = None
    # Reuse the KV cache of earlier requests' common prefix (backends that can: monokernel).
    # None: the backend's default (on; MONOKERNEL_PREFIX_REUSE=0 turns it off).
    prefix_reuse: bool | None = None
    # Quantise the layers' matrices at load (weights/quantize.py: fp8, int8); the monokernel
    # streams them in that format, the torch and reference engines compute with their
    # dequantised values. None: the checkpoint's weights as they are.
    quantize: str | None = None


@dataclass(frozen=True, slots=True)
class Timings:
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float  # request start -> first generated token
    decode_s: float  # first generated token -> last
    # With speculative decoding (runtime/speculative.py): tokens drafted, and those of them
    # the model agreed with (each emitted without a pass of its own); None when off.
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    # Prompt tokens whose K/V an earlier request's prefix supplied (the monokernel's prefix
    # reuse); None for an engine without a prefix cache.
    cached_tokens: int | None = None

    @property
    def prompt_tok_s(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One per generated token, then one final event (token_id None) with finish_reason."""

    token_id: int | None
    text: str  # text delta that became safe to emit with this event
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" on the final event
    timings: Timings | None = None  # on the final event
    logprobs: TokenLogprobs | None = None  # the token's, when the request asked for them
    choice: int = 0  # which of a request's n choices (the server's n > 1) it belongs to


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    timings: Timings
    prompt_ids: list[int] = field(default_factory=list)


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("--device cuda was asked for but no CUDA GPU is visible")
    if device.type not in ("cpu", "cuda"):
        raise InvalidRequestError(f"device {name!r} is not supported; use auto, cpu or cuda")
    return device


def _pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise InvalidRequestError(f"dtype {name!r} is not supported; use auto, float32, bfloat16")
    return _DTYPES[name]


class Engine:
    """A loaded model on one device with one backend. Serves one request at a time."""

    def __init__(
        self,
        model: str | Path | Checkpoint | None = None,
        config: EngineConfig | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.device = _pick_device(self.config.device)
        self.dtype = _pick_dtype(self.config.dtype, self.device)
        # The engine that runs: resolve_engine's pick until a fallback replaces it.
        self.engine_name = resolve_engine(self.config.engine, self.device)
        # Set when `auto` could not run the monokernel: the one line saying why.
        self.engine_note: str | None = None
        if self.config.quantize is not None:
            check_method(self.config.quantize)
        self.speculative = self.config.speculative
        if self.speculative is not None and self.speculative.by_default and self.config.tp > 1:
            self.speculative = None  # the engine's default: no drafts under TP
        if self.speculative is not None and self.config.tp > 1:
            raise InvalidRequestError(
                "--speculative is not with --tp > 1 (the monokernel's TP build has no verify "
                "pass); use one GPU"
            )
        # A checkpoint loaded here is the engine's own: its tensors go straight to the device
        # in the engine's dtype, and the monokernel may repack them in place. One the caller
        # passes stays whole.
        owned = self._owned = not isinstance(model, Checkpoint)
        # --tp: the checkpoint stays in host memory and each GPU gets only its shard.
        load_device = torch.device("cpu") if self.config.tp > 1 else self.device
        # The layer packing the plan in effect counted; None until one is made.
        self._layers: LayerPacking | None = None
        if owned:
            path = resolve_model_path(model, progress=self.config.progress)
            # Safetensors are read straight to the device, so the plan comes first, from
            # --quantize alone. A GGUF's weights stay on the host, and whether its layers
            # stream as their own groups is known only once it is read: planned below, as
            # any checkpoint, before cast_weights copies them (not on a bf16 count that
            # would refuse a model whose packed layers fit).
            ckpt = load_checkpoint(
                path,
                progress=self.config.progress,
                device=load_device,
                dtype=self.dtype,
                before_weights=None if reads_gguf(path) else self._plan_before_weights,
            )
        else:
            ckpt = model
        # The quantisation in effect (--quantize, else the checkpoint's; None: as loaded), the
        # checkpoint's own groups and FP8 block scales where they stream (run_formats).
        formats = run_formats(ckpt, self.config.quantize)
        self.quantize: str | None = formats.quantize
        groups, fp8_blocks = formats.groups, formats.fp8_blocks
        # Before any weight of a GGUF (or a caller's checkpoint) reaches the device; after the
        # loader's hook, again only where the checkpoint changed how the monokernel holds its
        # layers (its own groups, an FP8 checkpoint's format) from what --quantize said.
        self._plan_memory(
            ckpt.config, self._layer_packing(ckpt.config, self.quantize, groups, fp8_blocks)
        )
        self.source = ckpt.source
        self.eos_token_ids = frozenset(ckpt.eos_token_ids)
        self.tokenizer = Tokenizer.load(
            ckpt.tokenizer_dir, ckpt.gguf_file, progress=self.config.progress
        )
        # cast_weights empties the mapping it is given: the checkpoint's own when owned, so no
        # second reference keeps a tensor alive once the monokernel has repacked it; else a
        # copy that leaves a GGUF's unread layer matrices unread (weights/lazy_weights.py).
        weights = cast_weights(
            ckpt.weights if owned else cast_mapping(ckpt.weights), self.dtype, load_device
        )
        # --quantize int4 of float weights: the inputs' statistics over the calibration text,
        # once, for whichever engine (or rank) packs them, so all make the same int4 model.
        act_stats = None
        if self.quantize == "int4" and groups is None:
            from monokernel.runtime.calibration import calibration_stats

            act_stats = calibration_stats(
                ckpt.config, weights, self.tokenizer, self.device, self.config.progress
            )
        auto = self.config.engine == "auto" and self.engine_name == "monokernel"
        self.backend: Backend = create_backend(
            self.config.engine if auto else self.engine_name,
            ckpt.config,
            weights,
            self.max_model_len,
            self.device,
            self.config.tp,
            on_fallback=self._fall_back if auto else None,
            owned=owned,
            quantize=self.quantize,
            groups=groups,
            fp8_blocks=fp8_blocks,
            act_stats=act_stats,
        )
        if self.speculative is not None:  # the engine's own n-gram bounds where not given
            self.speculative = self.speculative.for_engine(self.engine_name)
            by_default = getattr(self.backend, "drafts_by_default", None)
            if self.speculative.by_default and not (callable(by_default) and by_default()):
                self.speculative = None  # not asked for, and this backend's passes may not pay
        if self.speculative is not None:
            try:
                self.backend.set_speculative(self.speculative)  # type: ignore[attr-defined]
            except BackendUnavailableError as e:  # its pass build failed to compile
                if not self.speculative.by_default:
                    raise
                # The default must not cost a run that decodes without it: say why, go on.
                self.backend.set_speculative(None)  # type: ignore[attr-defined]
                self.speculative = None
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                self._note(f"speculative decoding off: {first} (--speculative off skips it)")
            if self.speculative is not None and not self.backend.drafts_verified():  # type: ignore[attr-defined]
                self._no_drafts()
        set_reuse = getattr(self.backend, "set_prefix_reuse", None)
        if self.config.prefix_reuse is not None and callable(set_reuse):
            set_reuse(self.config.prefix_reuse)
        self._busy = threading.Lock()
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request

    def _no_drafts(self) -> None:
        """The backend cannot verify drafts for this model: speculation nobody asked for (the
        default) is dropped quietly; asked for, it stays, makes none and the note says why."""
        assert self.speculative is not None
        if self.speculative.by_default:
            self.speculative = None
            self.backend.set_speculative(None)  # type: ignore[attr-defined]
            return
        why = getattr(self.backend, "drafts_note", None) or (
            f"the {self.engine_name} engine on {self.device} does not verify drafts "
            "token-identically to plain decoding"
        )
        self._note(f"{why}, so it makes none (docs/speculative.md)")

    def _note(self, text: str) -> None:
        """Add ``text`` to the startup line about the engine (startup_notes)."""
        self.engine_note = f"{self.engine_note}; {text}" if self.engine_note else text

    @property
    def failure(self) -> str | None:
        """Why this engine can serve no more requests (its GPU kernel faulted, or stalled
        and would not stop); None while it can."""
        return getattr(self.backend, "failure", None)

    @property
    def startup_notes(self) -> tuple[str, ...]:
        """What the CLI says on stderr once the model is loaded: the engine fallback, if
        any, then the context line."""
        return (*([self.engine_note] if self.engine_note else []), self.context_note)

    # -- planning ------------------------------------------------------------------------------

    def _plan_before_weights(self, cfg: ModelConfig, announced: Announced) -> None:
        """The loader's hook: the plan before any weight is read, counting the layers as
        the checkpoint's config announces them (an AWQ/GPTQ checkpoint's groups)."""
        layers = LayerPacking()
        if self.engine_name == "monokernel":
            on_device = self.device.type == "cuda"
            layers = announced_packing(
                cfg, self.config.quantize, announced, self.config.tp, on_device
            )
        self._plan_memory(cfg, layers)

    def _plan_memory(self, cfg: ModelConfig, layers: LayerPacking | None = None) -> None:
        """Once the config is known and before any weight reaches the device: a model or
        context that cannot fit is refused now, with numbers (runtime/memory_plan.py), and
        the context is chosen; ``context_note`` says which and why (the CLI prints it).

        ``layers``: how the monokernel will hold the layers' matrices (``_layer_packing``);
        None (the loader's hook, the checkpoint not read yet): as --quantize alone says. A
        later call with the checkpoint's own changes nothing where that is what was counted
        or the engine is not the monokernel (the others hold every matrix dense); else it
        plans again on the free bytes measured before the weights loaded."""
        if layers is None:
            layers = self._layer_packing(cfg, self.config.quantize, None)
        if self._layers is not None and (
            layers == self._layers or self.engine_name != "monokernel"
        ):
            return
        if self._layers is None:
            self._free = (
                kv_memory.free_device_bytes(self.device) if self.device.type == "cuda" else None
            )
        self.model_config: ModelConfig = cfg
        self._weight_bytes = dense_weight_bytes(cfg, self.dtype.itemsize)
        self._layers = layers
        plan = self._plan_with_fallback()
        self.max_model_len = plan.max_model_len
        self.context_note = plan.note

    def _plan(self, engine: str) -> ContextPlan:
        first = self.device.index or 0
        gpus = torch.cuda.device_count() - first if self.device.type == "cuda" else 0
        settings = PlanSettings(
            chunk_tokens=envs.MONOKERNEL_PREFILL_CHUNK,
            precision=envs.MONOKERNEL_PREFILL_PRECISION,
            graphs=graphs_enabled(self.device),
            dtype_bytes=self.dtype.itemsize,
            gpus=gpus,
            where=str(self.device),
            consume=self._owned,
            layers=self._layers or LayerPacking(),
        )
        return plan_context(
            self.model_config,
            self._free,
            self._weight_bytes,
            engine,
            self.config.max_model_len,
            self.config.tp,
            settings,
        )

    def _layer_packing(
        self,
        cfg: ModelConfig,
        quantize: str | None,
        groups: Mapping[str, GroupQuant] | None,
        fp8_blocks: Fp8Blocks | None = None,
    ) -> LayerPacking:
        """How the monokernel will hold the layers' matrices given what the engine hands its
        backend (memory_plan.layer_packing); the other engines compute with dense matrices."""
        if self.engine_name != "monokernel":
            return LayerPacking()
        return layer_packing(cfg, RunFormats(quantize, groups, fp8_blocks), self.config.tp)

    def _plan_with_fallback(self) -> ContextPlan:
        """The plan for the resolved engine; for `auto` on one GPU, the fallback engine's
        when the monokernel's repacking leaves no room (its error if neither fits)."""
        try:
            return self._plan(self.engine_name)
        except ContextTooLargeError as e:
            if not self._may_fall_back():
                raise
            error = e
        other = fallback_engine()
        try:
            plan = self._plan(other)
        except ContextTooLargeError:
            raise error from None  # the monokernel's numbers and its --max-model-len advice
        self._note_fallback(
            other,
            f"its load needs {gib(error.need_bytes)} for a {error.tokens}-token context, "
            f"weight repacking included, and {gib(error.free_bytes)} is free",
        )
        return plan

    def _may_fall_back(self) -> bool:
        return (
            self.config.engine == "auto"
            and self.engine_name == "monokernel"
            and self.config.tp == 1
        )

    def _note_fallback(self, other: str, reason: str) -> None:
        self.engine_note = f"monokernel: cannot run this model ({reason}); using the {other} engine"
        self.engine_name = other

    def _fall_back(self, other: str, reason: str) -> int:
        """create_backend's hook when the monokernel failed to build: plan the other
        engine's context (its default differs) and record why."""
        self._note_fallback(other, reason)
        plan = self._plan(other)
        self.max_model_len, self.context_note = plan.max_model_len, plan.note
        return plan.max_model_len

    # -- requests ------------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str) and not prompt:
            raise InvalidRequestError("the prompt is empty")
        ids = self.tokenizer.encode_prompt(prompt)
        if not ids:
            raise InvalidRequestError("the prompt encodes to no tokens")
        return ids

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) is "
                f"{prompt_len + max_tokens} tokens, over the context limit of "
                f"{self.max_model_len}; shorten the prompt or lower max_tokens"
            )

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        cancel: CancelToken | None = None,
        prompt_ids: list[int] | None = None,
    ) -> Iterator[TokenEvent]:
        """Stream a completion. ``prompt_ids`` skips tokenisation when the caller already
        has them. Setting ``cancel`` (from any thread) ends the stream within a token."""
        params = (params or SamplingParams()).with_seed()
        # What this engine cannot apply is refused, not ignored.
        why = unsupported_sampling_reason(params, self.engine_name)
        if why is not None:
            raise InvalidRequestError(why)
        ids = prompt_ids if prompt_ids is not None else self.encode(prompt)
        self.check_fits(len(ids), params.max_tokens)
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_token_ids
        )
        matcher = None
        if params.constraint is not None:
            matcher = self.constraint_matcher(params.constraint)
            # The grammar's end is written as EOS, so EOS ends the output even with
            # ignore_eos (past it the grammar allows nothing else).
            stop_ids |= self.eos_token_ids
        logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        request = DecodeRequest(tuple(ids), params, params.max_tokens, stop_ids, matcher, logprobs)
        return self._run(request, cancel or CancelToken())

    def constraint_matcher(self, constraint: Constraint) -> TokenMatcher:
        """A fresh matcher for ``constraint``; ConstraintError (an InvalidRequestError) when
        this engine cannot run constrained requests, llguidance is missing, or the grammar is
        refused. Thread-safe, so a server can check a request before queueing it."""
        reason = unsupported_reason(self.engine_name)
        if reason is not None:
            raise ConstraintError(reason)
        if self._grammars is None:
            self._grammars = GrammarCompiler(
                self.tokenizer.hf, self.model_config.vocab_size, self.eos_token_ids
            )
        return self._grammars.matcher(constraint)

    def _run(self, request: DecodeRequest, cancel: CancelToken) -> Iterator[TokenEvent]:
        with self._busy:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_ids)
            stops = StopStringMatcher(request.sampling.stop)
            start = time.perf_counter()
            first = last = start
            count = 0
            finish = "cancelled"
            cached = planned_reuse(self.backend, request.prompt_ids)
            tokens = self.backend.stream(request, cancel)
            try:
                for token in tokens:
                    last = time.perf_counter()
                    if count == 0:
                        first = last
                    count += 1
                    text = stops.feed(detok.add(token))
                    # The backend appended this token's before yielding it.
                    lps = request.logprobs
                    lp = lps[count - 1] if lps is not None and len(lps) >= count else None
                    if stops.stopped:
                        cancel.set()
                        finish = "stop"
                        yield TokenEvent(token, text, logprobs=lp)
                        break
                    yield TokenEvent(token, text, logprobs=lp)
                    if token in request.stop_token_ids:
                        finish = "stop"
                        break
                    if count == request.max_new_tokens:
                        finish = "length"
                        break
            finally:
                tokens.close()  # lets the backend stop its device loop and tidy up
            tail = ""
            if not stops.stopped:
                tail = stops.feed(detok.flush())
                if stops.stopped:  # the held-back tail completed a stop string
                    finish = "stop"
                else:
                    tail += stops.flush()
            spec = getattr(self.backend, "speculation", None) if self.speculative else None
            timings = Timings(
                len(request.prompt_ids),
                count,
                first - start,
                last - first,
                spec.drafted if spec is not None else None,
                spec.accepted if spec is not None else None,
                cached,
            )
            yield TokenEvent(None, tail, finish, timings)

    def complete(self, prompt: Prompt, params: SamplingParams | None = None) -> Completion:
        """Run a whole request; the non-streaming form of ``generate``."""
        ids = self.encode(prompt)
        parts: list[str] = []
        token_ids: list[int] = []
        final: TokenEvent | None = None
        for event in self.generate(prompt, params, prompt_ids=ids):
            parts.append(event.text)
            if event.token_id is None:
                final = event
            else:
                token_ids.append(event.token_id)
        assert final is not None and final.finish_reason and final.timings
        return Completion("".join(parts), token_ids, final.finish_reason, final.timings, ids)

    def close(self) -> None:
        self.backend.close()
