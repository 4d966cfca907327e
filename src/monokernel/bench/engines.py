"""The engines the bench can time, behind one small interface.

``monokernel``, ``torch`` and ``reference`` are our decode backends (``monokernel@tp2``: over
two GPUs; ``monokernel+grammar``: every request constrained by ``--grammar``); ``hf`` is
transformers' ``model.generate`` on the same weights; ``endpoint`` is any OpenAI-compatible server;
``llama.cpp`` is llama-cpp-python on the same GGUF file (a CPU peer, when installed). Each is
opened per (prompt, gen) cell, sized for that cell's context, and closed after it, so an
engine whose cost depends on the allocated context (a static KV cache read whole) is timed at
the context the cell needs and not at the sweep's largest.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from monokernel.bench.measure import (
    BLOCK_SIZE,
    FP8_BLOCK,
    INT8_GROUP_LABELS,
    Q4_K_M,
    RunTiming,
    engine_grammar,
    engine_tp,
    split_engine,
    time_request,
)
from monokernel.models.config import ModelConfig
from monokernel.runtime.backends import BACKEND_CLASSES, construct_backend
from monokernel.weights.checkpoint_quant import fp8_block_checkpoint
from monokernel.weights.gguf_8bit import q4_k_m_groups, quantize_groups8
from monokernel.weights.names import Weights
from monokernel.weights.quantize import is_quantized

if TYPE_CHECKING:
    from monokernel.runtime.constrained import TokenMatcher

# The weights every engine runs, or a function that makes them afresh for each engine opened
# (random weights in a named shape): the monokernel then repacks them in place, so a model
# the GPU holds once but not twice (a 32B one on 80 GB) is benchmarked too.
WeightSource = Weights | Callable[[], Weights]

BACKENDS = BACKEND_CLASSES  # our engines, by name (runtime/backends)
ENGINES: tuple[str, ...] = (*BACKENDS, "hf", "endpoint", "llama.cpp")
GPU_ONLY: frozenset[str] = frozenset({"monokernel"})


class Runner(Protocol):
    name: str

    def run(self, prompt: list[int], gen_tokens: int) -> RunTiming:
        """One timed greedy request of exactly ``gen_tokens`` tokens (EOS ignored)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """Settings of the engines that are not our backends."""

    hf_cache: str = "static"  # "static" (HF compiles the decode step on CUDA) | "dynamic"
    endpoint_url: str | None = None
    endpoint_model: str | None = None
    endpoint_api_key: str | None = None
    endpoint_prompt: str = "ids"  # "ids" | "text"
    endpoint_transport: str = "auto"  # "auto" (httpx if installed) | "httpx" | "urllib"
    gguf_path: str | None = None  # the model's GGUF file, for llama.cpp
    threads: int | None = None  # llama.cpp's threads; None: torch's
    # A fresh grammar matcher for each request of a ``+grammar`` engine (bench --grammar).
    grammar: Callable[[], TokenMatcher] | None = None


class BackendRunner:
    """One of our backends; timings come from ``measure.time_request``."""

    def __init__(
        self,
        name: str,
        cfg: ModelConfig,
        weights: Weights,
        max_len: int,
        device: torch.device,
        owned: bool = False,
        grammar: Callable[[], TokenMatcher] | None = None,
    ) -> None:
        """``name``: the label, an engine with the layers' format after a colon when it
        quantises them (``monokernel:fp8``); ``owned``: no one else holds ``weights``, so the
        monokernel may consume them; ``grammar``: a fresh matcher for each request (a
        ``+grammar`` engine's)."""
        self.name = name
        self._grammar = grammar
        engine, quantize = split_engine(name)
        tp = engine_tp(name)
        blocks = None
        groups = None
        if quantize == FP8_BLOCK:  # the weights as a block-scaled FP8 checkpoint holds them
            weights, blocks = fp8_block_checkpoint(weights, BLOCK_SIZE, BLOCK_SIZE, dtype=None)
            quantize, owned = "fp8", True
        elif quantize in (*INT8_GROUP_LABELS, Q4_K_M):  # as a GGUF of such blocks loads
            if quantize == Q4_K_M:
                groups = q4_k_m_groups(weights)
            else:
                group = INT8_GROUP_LABELS[quantize]
                groups = {
                    k: quantize_groups8(w, group) for k, w in weights.items() if is_quantized(k)
                }
            weights = {k: g.dense(weights[k].dtype) for k, g in groups.items()} | {
                k: w for k, w in weights.items() if k not in groups
            }
            quantize, owned = "int8", True
        if tp > 1:
            from monokernel.runtime.backends.monokernel.tp import MonokernelTPBackend

            self.backend: Any = MonokernelTPBackend(
                cfg, weights, max_len, device, tp, quantize, groups, fp8_blocks=blocks
            )
        else:
            self.backend = construct_backend(
                engine, cfg, weights, max_len, device, owned, quantize, groups, blocks
            )

    @property
    def info(self) -> dict[str, Any]:
        """Extra fields for the record: where the monokernel's load-time search put its
        hand-off buffer (runtime/backends/monokernel/handoff_placement.py)."""
        choice = getattr(self.backend, "handoff_choice", None)
        return {"handoff_search": choice.as_dict()} if choice is not None else {}

    def run(self, prompt: list[int], gen_tokens: int) -> RunTiming:
        matcher = self._grammar() if self._grammar is not None else None
        return time_request(self.backend, prompt, gen_tokens, matcher)

    def profile(self, prompt: list[int], gen_tokens: int) -> dict[str, float] | None:
        """The monokernel's per-stage times of one step halfway through; None elsewhere."""
        if not hasattr(self.backend, "profile_step"):
            return None
        return dict(self.backend.profile_step(prompt, gen_tokens, gen_tokens // 2))

    def close(self) -> None:
        self.backend.close()
        del self.backend


def open_runner(
    name: str,
    cfg: ModelConfig,
    weights: WeightSource | None,
    max_len: int,
    device: torch.device,
    options: EngineOptions,
) -> Runner:
    if name == "endpoint":
        from monokernel.bench.endpoint import EndpointRunner

        if not options.endpoint_url:
            raise ValueError("engine 'endpoint' needs --endpoint URL")
        return EndpointRunner(
            options.endpoint_url,
            model=options.endpoint_model,
            api_key=options.endpoint_api_key,
            prompt_mode=options.endpoint_prompt,
            transport=options.endpoint_transport,
        )
    if name == "llama.cpp":
        from monokernel.bench.llama_cpp import LlamaCppRunner

        if not options.gguf_path:
            raise ValueError("engine 'llama.cpp' needs --model FILE.gguf")
        threads = options.threads or torch.get_num_threads()
        return LlamaCppRunner(options.gguf_path, max_len, threads)
    if weights is None:
        raise ValueError(f"engine {name!r} needs the model's weights")
    owned = callable(weights)
    if callable(weights):
        # --tp shards from the host, as the engine does: no GPU holds the whole model.
        weights = weights(store="cpu") if engine_tp(name) > 1 else weights()
    engine = split_engine(name)[0]
    if engine in ("torch", "hf") and device.type == "cuda":
        fresh_compile_state()
    if name == "hf":
        from monokernel.bench.hf import HFRunner

        return HFRunner(cfg, weights, max_len, device, cache=options.hf_cache)
    if engine in BACKENDS:
        grammar = None
        if engine_grammar(name):
            if options.grammar is None:
                raise ValueError(f"engine {name!r} needs --grammar REGEX")
            grammar = options.grammar
        return BackendRunner(name, cfg, weights, max_len, device, owned, grammar)
    raise ValueError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")


def check_engine_label(label: str) -> str | None:
    """Why ``label`` names no engine the bench can open (None when it does): an engine of
    ENGINES, one of our backends optionally with ``:FORMAT`` (``monokernel:fp8``)."""
    engine, quantize = split_engine(label)
    if engine not in ENGINES:
        return f"unknown engine {label!r}; choose from {', '.join(ENGINES)}"
    try:
        tp = engine_tp(label)
    except ValueError as e:
        return str(e)
    if tp > 1 and engine != "monokernel":
        return f"engine {label!r}: only the monokernel runs over several GPUs (@tpN)"
    if engine_grammar(label) and (engine not in BACKENDS or tp > 1):
        return f"engine {label!r}: +grammar goes on {', '.join(BACKENDS)} at one GPU"
    if quantize is not None:
        from monokernel.weights.quantize import QUANTIZE_METHODS

        labels = (*QUANTIZE_METHODS, FP8_BLOCK, *INT8_GROUP_LABELS, Q4_K_M)
        if engine not in BACKENDS or quantize not in labels:
            return (
                f"engine {label!r}: a format suffix goes on {', '.join(BACKENDS)} and is one of "
                f"{', '.join(labels)} (e.g. monokernel:fp8)"
            )
    return None


def fresh_compile_state() -> None:
    """Forget every torch.compile result before a compiled engine opens for a new cell.

    Each cell sizes its static KV cache anew, so the engine recompiles anyway; from a clean
    slate it compiles with static shapes like a single-run engine (not a dynamic-shape graph
    that dynamo would switch to on a recompile), and never reaches dynamo's recompile limit,
    past which it would silently run eagerly and report eager numbers as torch.compile's."""
    import torch._dynamo

    torch._dynamo.reset()


def release(runner: Runner | None, device: torch.device) -> None:
    """Close ``runner`` and hand its memory back before the next engine allocates."""
    if runner is not None:
        runner.close()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
