"""The engines the bench can time, behind one small interface.

``monokernel``, ``torch`` and ``reference`` are our decode backends (``monokernel@tp2``: over
two GPUs; ``monokernel+grammar``: every request constrained by ``--grammar``); ``hf`` is
transformers' ``model.generate`` on the same weights; ``endpoint`` is any OpenAI-compatible server;
``llama.cpp`` is llama-cpp-python on the same GGUF file (a CPU peer, when installed). Each is
opened per (prompt, gen) cell, sized for that cell's context, and closed after it, so an
engine whose cost depends on the allocated context (a static KV cache read whole) is timed at
the context the cell needs and not at the sweep's largest.

A checkpoint (``--model``) reaches each engine as ``monokernel run`` hands it over
(runtime/engine.py): the monokernel streams a GGUF's or an AWQ/GPTQ checkpoint's own groups,
an FP8 checkpoint's block scales, and never makes a GGUF's layer matrices dense; the other
engines get the dense matrices (``CheckpointWeights``). The monokernel's bytes per token are
the ones it streams (``LayerStream``), not a bf16 model's.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from monokernel.bench.measure import (
    BLOCK_SIZE,
    FP8_BLOCK,
    INT8_GROUP_LABELS,
    Q4_K_M,
    RunTiming,
    bytes_per_token,
    engine_grammar,
    engine_tp,
    layer_matrix_shapes,
    split_engine,
    time_request,
)
from monokernel.models.config import ModelConfig
from monokernel.runtime.backends import BACKEND_CLASSES, construct_backend
from monokernel.runtime.memory_plan import layer_packing
from monokernel.weights.checkpoint_quant import fp8_block_checkpoint
from monokernel.weights.formats import WeightFormat
from monokernel.weights.formats.fp8 import Fp8Rows
from monokernel.weights.formats.int4 import Int4Groups
from monokernel.weights.formats.int8 import Int8Rows
from monokernel.weights.gguf_8bit import q4_k_m_groups, quantize_groups8
from monokernel.weights.lazy_weights import LazyWeights, cast_mapping
from monokernel.weights.loader import Checkpoint, RunFormats, run_formats
from monokernel.weights.names import Weights
from monokernel.weights.quantize import (
    config_format,
    is_quantized,
)

if TYPE_CHECKING:
    from monokernel.runtime.constrained import TokenMatcher

CPU = torch.device("cpu")
# The bench's own formats: made from dense weights by the bench (BackendRunner), whatever a
# checkpoint stores.
BENCH_FORMATS: tuple[str, ...] = (FP8_BLOCK, *INT8_GROUP_LABELS, Q4_K_M)


class CheckpointWeights:
    """A checkpoint loaded once, opened by each engine as ``monokernel run`` opens it
    (``weights``): the monokernel with a GGUF's layer matrices unread (it streams their
    groups), the others with every matrix made, in the bench's dtype."""

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype) -> None:
        self.ckpt, self.dtype = ckpt, dtype
        # A GGUF's dense matrices, made on the host once the first engine that computes with
        # them opens: in dtype, so they are made once per run and never held in float32, and
        # on the host, so no engine's device holds them while another runs (the monokernel
        # of a 32B Q4_K_M fits an 80 GB GPU beside its cache, not beside a bf16 copy).
        self._dense: Weights | None = None

    def formats(self, quantize: str | None) -> RunFormats:
        return run_formats(self.ckpt, quantize)

    def weights(self, store: torch.device, dense: bool) -> tuple[Weights, bool]:
        """A mapping of its own for one backend, on ``store`` in dtype, and whether its
        tensors are its own too, which the monokernel may then repack in place (consume): not
        where the cast passed them through, already there in dtype (safetensors read to the
        device). ``dense``: every matrix made; else a GGUF's layer matrices only if read
        (weights/lazy_weights.py), for the monokernel, which streams their groups."""
        weights: Mapping[str, torch.Tensor] = self.ckpt.weights
        if dense and isinstance(weights, LazyWeights) and weights.unread():
            if self._dense is None:
                # Through a cast, so the checkpoint's own entries stay unread for the
                # monokernel's backends.
                self._dense = dict(cast_mapping(weights, self.dtype, CPU))
            weights = self._dense
        embed = weights["embed"]  # made at load whatever the format: reading it makes nothing
        owned = not (embed.device == store and embed.dtype == self.dtype)
        cast = cast_mapping(weights, self.dtype, store)
        return (dict(cast) if dense else cast), owned  # type: ignore[return-value]


# The weights every engine runs; a function that makes them afresh for each engine opened
# (random weights in a named shape): the monokernel then repacks them in place, so a model
# the GPU holds once but not twice (a 32B one on 80 GB) is benchmarked too; or a checkpoint
# each engine opens as `monokernel run` would.
WeightSource = Weights | Callable[[], Weights] | CheckpointWeights


def _width_format(width: tuple[str, int]) -> WeightFormat:
    """A GroupsPlan stage's (format, group) as the format instance whose bytes it streams."""
    method, group = width
    return Int4Groups(group) if method == "int4" else Int8Rows(group=group)


def _width_label(width: tuple[str, int]) -> str:
    return f"{width[0]}-g{width[1]}"


@dataclass(frozen=True, slots=True)
class LayerStream:
    """The formats the monokernel streams the layers' matrices in, QKV, O, gate/up and down
    (none: dense, in the weights' dtype), and a label for the record."""

    formats: tuple[WeightFormat, ...] = ()
    label: str = "bf16"

    def bytes_per_token(self, cfg: ModelConfig, context: float, weight_bytes: int) -> float:
        """measure.bytes_per_token with the layers' matrices at these formats' bytes, as an
        ``ENGINE:FORMAT`` label counts its format's."""
        dense = bytes_per_token(cfg, context, weight_bytes)
        if not self.formats:
            return dense
        shapes = layer_matrix_shapes(cfg)
        packed = sum(
            f.matrix_bytes(r, c) - r * c * weight_bytes
            for f, (r, c) in zip(self.formats, shapes, strict=True)
        )
        return dense + cfg.num_layers * packed


def monokernel_layers(cfg: ModelConfig, formats: RunFormats, tp: int = 1) -> LayerStream:
    """How the monokernel backend (at ``tp`` GPUs) streams the layers it is handed
    ``formats`` for (memory_plan.layer_packing, the rule the engine plans with): a
    checkpoint's groups where they stream, their dequantised values in bf16 where not."""
    packing = layer_packing(cfg, formats, tp)
    plan = packing.groups
    if plan is not None:
        qkv = plan.qkv if plan.qkv[0] else plan.layers
        down = plan.down if plan.down[0] else plan.layers
        parts = [_width_label(plan.layers)]
        for where, width in (("QKV", qkv), ("down", down)):
            if width != plan.layers:
                parts.append(f"{where} {_width_label(width)}")
        stages = tuple(_width_format(w) for w in (qkv, plan.layers, plan.layers, down))
        return LayerStream(stages, f"groups {', '.join(parts)}")
    if formats.groups is not None:
        return LayerStream(label="bf16 (groups dequantised: sizes not whole tiles)")
    if formats.quantize is None:
        return LayerStream()
    blocks = formats.fp8_blocks
    if blocks is not None and packing.fp8_block:
        fmt: WeightFormat = Fp8Rows(tiles=True, block=blocks.cols)
        return LayerStream((fmt,) * 4, f"fp8, {blocks.rows}x{blocks.cols} block scales")
    method = formats.quantize
    fmt = config_format(method, cfg)
    group = getattr(fmt, "group", 0)
    return LayerStream((fmt,) * 4, f"{method}-g{group}" if group else method)


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
        formats: RunFormats | None = None,
    ) -> None:
        """``name``: the label, an engine with the layers' format after a colon when it
        quantises them (``monokernel:fp8``); ``owned``: no one else holds ``weights``, so the
        monokernel may consume them; ``grammar``: a fresh matcher for each request (a
        ``+grammar`` engine's); ``formats``: what ``monokernel run`` would hand the backend
        besides the weights (a checkpoint's: run_formats); None: the label's format alone."""
        self.name = name
        self._grammar = grammar
        engine, label_fmt = split_engine(name)
        tp = engine_tp(name)
        formats = formats or RunFormats(label_fmt)
        quantize, groups, blocks = formats.quantize, formats.groups, formats.fp8_blocks
        if label_fmt == FP8_BLOCK:  # the weights as a block-scaled FP8 checkpoint holds them
            weights, blocks = fp8_block_checkpoint(weights, BLOCK_SIZE, BLOCK_SIZE, dtype=None)
            quantize, groups, owned = "fp8", None, True
        elif label_fmt in (*INT8_GROUP_LABELS, Q4_K_M):  # as a GGUF of such blocks loads
            if label_fmt == Q4_K_M:
                groups = q4_k_m_groups(weights)
            else:
                group = INT8_GROUP_LABELS[label_fmt]
                groups = {
                    k: quantize_groups8(w, group) for k, w in weights.items() if is_quantized(k)
                }
            weights = {k: g.dense(weights[k].dtype) for k, g in groups.items()} | {
                k: w for k, w in weights.items() if k not in groups
            }
            quantize, blocks, owned = "int8", None, True
        # What the bytes per token count: the monokernel's packed layers; None: the label's.
        self.layers: LayerStream | None = None
        if engine == "monokernel":
            self.layers = monokernel_layers(cfg, RunFormats(quantize, groups, blocks), tp)
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
        hand-off buffer (runtime/backends/monokernel/handoff_placement.py) and the format
        its layers stream in."""
        choice = getattr(self.backend, "handoff_choice", None)
        info = {"handoff_search": choice.as_dict()} if choice is not None else {}
        if self.layers is not None:
            info["layer_format"] = self.layers.label
        return info

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
    engine, label_fmt = split_engine(name)
    # --tp shards from the host, as the engine does: no GPU holds the whole model.
    host = engine_tp(name) > 1
    formats: RunFormats | None = None
    if isinstance(weights, CheckpointWeights):
        source = weights
        if engine in BACKENDS and label_fmt not in BENCH_FORMATS:
            # What run hands the backend: the monokernel streams a checkpoint's own groups,
            # the torch engine's CPU step decodes from 4-bit ones, and an FP8 checkpoint's
            # values are not quantised again (construct_backend).
            formats = source.formats(label_fmt)
        # Only the monokernel reads a checkpoint's groups instead of its matrices.
        dense = engine != "monokernel" or formats is None
        weights, owned = source.weights(CPU if host else device, dense)
    else:
        owned = callable(weights)
        if callable(weights):
            weights = weights(store="cpu") if host else weights()
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
        return BackendRunner(name, cfg, weights, max_len, device, owned, grammar, formats)
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
