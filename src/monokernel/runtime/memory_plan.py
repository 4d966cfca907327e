"""Choosing the context length before the weights go to the GPU.

The weights and the whole KV cache are allocated at load, so whether a model fits is known
from numbers alone: the checkpoint's tensor sizes, the config, and the GPU's free memory.
Checking here, before the weights are copied, turns a late CUDA out-of-memory (or the
backend's own refusal after a long copy) into one line that says what would fit. With no
``--max-model-len`` the monokernel gets the longest context that fits, up to the model's
maximum: its decode reads only the positions in use, so a large cache costs memory, not speed.

Everything is counted with ``kv_memory``'s functions, the ones the monokernel backend's
``check_load_fits`` uses, so a plan that fits here passes that check after the weights load.
``plan_context`` is pure (free bytes and weight bytes are inputs) so it is tested on CPU.

The engines that compute with dense matrices hold the weights dense in the device dtype
beside the cache. The monokernel's load has two phases whose peaks do not add
(``kv_memory.load_phases``): it checks with what was loaded on the device (``_loaded_bytes``)
and repacks the layers one at a time, freeing each one's sources once packed where it owns
them; only then come the cache and the prefill's memory, beside the packed weights
(``device_weight_bytes``: a checkpoint's own groups, or --quantize's format, pack to a
quarter to half of bf16's bytes). How the layers are packed is ``LayerPacking``, which the
engine passes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from monokernel.errors import InvalidRequestError
from monokernel.models.config import ModelConfig
from monokernel.models.transformer import PREFILL_CHUNK
from monokernel.runtime import kv_memory
from monokernel.runtime.prefill_exchange import exchange_bytes
from monokernel.runtime.prefill_tp_graphs import graph_bytes as tp_graph_bytes
from monokernel.weights.formats import DEFAULT_FORMAT
from monokernel.weights.loader import CHECKPOINT_INT4, Announced, RunFormats
from monokernel.weights.names import expected_shapes
from monokernel.weights.quantize import (
    STAGE_MATRICES,
    GroupsPlan,
    blocks_stream,
    groups_plan,
    groups_stream,
    int4_group_of,
    widths_plan,
)
from monokernel.weights.shard import rank_config, shard_config, valid_tp_sizes

# Without --max-model-len where memory is not planned (CPU), and for the engines whose decode
# step reads the whole cache every token (torch's static cache, the reference): a longer
# cache would slow every token there, so they keep this unless asked for more.
DEFAULT_MAX_MODEL_LEN = 8192
GIB = 1 << 30
# Allocations between the plan and the backend's check that the plan cannot see (the
# allocator's rounding of each weight tensor, small buffers); a chosen default context leaves
# this much spare so the check never refuses what the plan picked.
_SLACK_BYTES = 64 * 1024 * 1024
# A chosen context is rounded down to a multiple of this (below the model's maximum).
_ROUND_TOKENS = 256
# torch's caching allocator hands out blocks in multiples of this: what a tensor really takes.
_ALLOC_ROUND = 512


@dataclass(frozen=True, slots=True)
class LayerPacking:
    """How the monokernel holds the layers' seven matrices, as the engine knows it before
    they reach the device (from --quantize and the checkpoint it read: layer_packing).
    The engines that compute with dense matrices hold them in the device dtype whatever this
    says.

    ``fmt``: their weight format (weights/formats: bf16, --quantize's, or a checkpoint's
    groups' method). ``groups``: they are packed from a checkpoint's own groups in this plan
    (weights/quantize.py GroupsPlan), so their dense values are never made (made only when
    read: weights/lazy_weights.py). ``groups_on_device``: those groups are on the one GPU
    already, whole (an AWQ/GPTQ checkpoint, read to the GPU), not copied there a layer at a
    time from the host (a GGUF's).
    ``fp8_block``: fp8 packed with an FP8 checkpoint's block scales of that many columns
    (the backend's fp8_blocks, where they stream; 0: a scale a row)."""

    fmt: str = DEFAULT_FORMAT
    groups: GroupsPlan | None = None
    groups_on_device: bool = False
    fp8_block: int = 0


def layer_packing(cfg: ModelConfig, formats: RunFormats, tp: int = 1) -> LayerPacking:
    """How the monokernel backend (at ``tp`` GPUs) holds the layers it is handed ``formats``
    for, by its own rules (weights/quantize.py groups_stream, groups_plan, blocks_stream) on
    the sizes it packs, the model's or at ``tp`` > 1 a rank's: a checkpoint's own groups
    where they stream (their dequantised values in bf16 where not), an FP8 checkpoint's block
    scales where they stream, else the ``--quantize`` format a scale a row."""
    if formats.quantize is None:
        return LayerPacking()
    sizes = cfg if tp == 1 else rank_config(shard_config(cfg, 0, tp))
    groups, blocks = formats.groups, formats.fp8_blocks
    if groups is None:
        # Block scales that stream take more bytes than a scale a row.
        streams = blocks is not None and blocks_stream(sizes, blocks)
        return LayerPacking(formats.quantize, fp8_block=blocks.cols if streams else 0)
    if not groups_stream(sizes, groups):
        return LayerPacking()
    plan, _ = groups_plan(sizes, groups)
    # An AWQ/GPTQ checkpoint's were read to the GPU (its layers left unread); a GGUF's
    # stay on the host.
    on_device = next(iter(groups.values())).q.device.type != "cpu"
    return LayerPacking(formats.quantize, plan, on_device)


def announced_packing(
    cfg: ModelConfig, quantize: str | None, announced: Announced, tp: int, on_device: bool
) -> LayerPacking:
    """``layer_packing`` before the checkpoint's weights are read, from what its config
    announces: an AWQ/GPTQ checkpoint's groups stream as int4 groups of its width (4 bits
    always do), read to the device where ``on_device`` (at one GPU; a TP rank's are sharded
    on the host first), unless --quantize names another method. Counting its layers in bf16
    here refused a 32B AWQ on a GPU that holds its ~34 GiB."""
    method = quantize if quantize is not None else announced.quantization
    if method == CHECKPOINT_INT4 == announced.quantization and announced.group > 0:
        sizes = cfg if tp == 1 else rank_config(shard_config(cfg, 0, tp))
        plan, _ = widths_plan(sizes, dict.fromkeys(STAGE_MATRICES, (4, announced.group)))
        return LayerPacking(CHECKPOINT_INT4, plan, on_device and tp == 1)
    return layer_packing(cfg, RunFormats(method, None, None), tp)


@dataclass(frozen=True, slots=True)
class PlanSettings:
    """What the byte counts depend on besides the model: the monokernel's prefill knobs
    (``envs.MONOKERNEL_PREFILL_*``), the weights' element size on the device, and how many
    GPUs there are from the first one on (for the ``--tp`` advice)."""

    chunk_tokens: int = 8192
    precision: str = "split-qkv"
    graphs: bool = True
    dtype_bytes: int = 2  # 2: bf16; 4: float32 (the monokernel then keeps a bf16 copy)
    gpus: int = 1
    where: str = "the GPU"
    # The monokernel repacks the weights in place (the engine owns them; weights.repack's
    # `consume`): one layer is held twice at a time, not the model.
    consume: bool = False
    layers: LayerPacking = LayerPacking()


@dataclass(frozen=True, slots=True)
class ContextPlan:
    max_model_len: int
    note: str  # the startup line: the context and why it is that long
    need_bytes: int | None = None  # weights + cache + workspace + reserve; None on CPU
    free_bytes: int | None = None


def gib(n: int) -> str:
    """``n`` bytes for a message: GiB, one decimal."""
    return f"{n / GIB:.1f} GiB"


def dense_weight_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """What every tensor of ``cfg`` takes on a GPU in a dtype of ``dtype_bytes`` (each rounded
    up as torch's allocator rounds it), known before any of them is read: the ``weight_bytes``
    that the functions here take."""
    total = 0
    for shape in expected_shapes(cfg).values():
        n = math.prod(shape) * dtype_bytes
        total += -(-n // _ALLOC_ROUND) * _ALLOC_ROUND
    return total


def _tp_groups(cfg: ModelConfig, layers: LayerPacking) -> GroupsPlan | None:
    """The groups a tensor-parallel rank packs its layers from: a checkpoint's own, or under
    --quantize int4 the ones the TP backend rounds on each rank first (tp.py rank_tensors:
    TP=1's groups, whole in every rank's columns)."""
    if layers.groups is not None:
        return layers.groups
    return GroupsPlan(("int4", int4_group_of(cfg))) if layers.fmt == "int4" else None


def _packing(cfg: ModelConfig, tp: int, s: PlanSettings) -> kv_memory.Packing:
    """What the monokernel's repack starts from on the (first) device and makes there, as
    its backend says it (backend.py, tp.py Rank): on one GPU as the engine hands it the
    weights (``s.consume``, ``s.dtype_bytes``) and ``s.layers``; on a TP rank, its shard in
    bf16, its layers from its own blocks of the groups where there are groups, both
    consumed."""
    layers = s.layers
    if tp > 1:
        groups = _tp_groups(cfg, layers)
        return kv_memory.Packing(
            layers.fmt,
            groups,
            layers.fp8_block,
            consume=True,
            dense_layers=groups is None,
            groups_on_device=groups is not None,
            owns_groups=True,
        )
    return kv_memory.Packing(
        layers.fmt,
        layers.groups,
        layers.fp8_block,
        consume=s.consume,
        dense_layers=layers.groups is None,
        groups_on_device=layers.groups_on_device,
        convert=s.dtype_bytes != 2,
    )


def _loaded_bytes(cfg: ModelConfig, weight_bytes: int, tp: int, s: PlanSettings) -> int:
    """What is on the (first) device when the monokernel backend checks its memory, before
    it repacks: every tensor dense in the device dtype but the layer matrices of a
    checkpoint with its own groups (made dense only when read: weights/lazy_weights.py), whose
    groups stay on the host (GGUF) or were read to the device (AWQ/GPTQ). At
    ``tp`` > 1, rank 0's shard in bf16: its 1/tp of the layers (as its blocks of the groups
    where there are groups), the whole embedding, its own LM-head rows."""
    layers = s.layers
    if tp == 1:
        if layers.groups is None:
            return weight_bytes
        dense = weight_bytes - s.dtype_bytes * kv_memory.layer_matrix_params(cfg)
        if layers.groups_on_device:
            return dense + kv_memory.group_bytes(cfg, layers.groups)
        return dense
    rank = rank_config(shard_config(cfg, 0, tp))
    dense = weight_bytes * 2 // s.dtype_bytes
    embed = 2 * cfg.vocab_size * cfg.hidden_size
    head = 0 if cfg.tie_word_embeddings else embed
    own_head = 2 * rank.vocab_size * cfg.hidden_size
    groups = _tp_groups(cfg, layers)
    if groups is None:
        return (dense - embed - head) // tp + embed + own_head
    rest = dense - embed - head - 2 * kv_memory.layer_matrix_params(cfg)
    return rest // tp + embed + own_head + kv_memory.group_bytes(rank, groups)


def _load_phases(cfg: ModelConfig, n: int, tp: int, s: PlanSettings) -> kv_memory.LoadPhases:
    """The monokernel backend's load beyond ``_loaded_bytes`` for an ``n``-token context:
    on one GPU what its check counts (MonokernelBackend: fold as its default); on rank 0 of
    the TP backend (tp.py) the same for its shard, whose prefill also holds the partial sums
    the sharded prefill exchanges (runtime/prefill_tp.py) and its graphs
    (runtime/prefill_tp_graphs.py) instead of whole-prompt ones."""
    packing = _packing(cfg, tp, s)
    if tp == 1:
        return kv_memory.load_phases(cfg, n, s.chunk_tokens, s.precision, packing, s.graphs)
    rank = rank_config(shard_config(cfg, 0, tp))
    chunk = min(s.chunk_tokens, n)
    extra = exchange_bytes(chunk, cfg.hidden_size)
    if s.graphs:
        extra += tp_graph_bytes(rank, s.chunk_tokens, n, s.precision, packing.fmt)
    return kv_memory.load_phases(rank, n, chunk, s.precision, packing, extra=extra)


def device_weight_bytes(
    cfg: ModelConfig, weight_bytes: int, engine: str, tp: int, s: PlanSettings
) -> int:
    """The bytes the weights take on the (first) device for ``engine`` as it serves, from
    ``weight_bytes`` (``dense_weight_bytes`` in the device dtype) and ``s.layers``.

    The torch and reference engines hold every tensor dense. The monokernel holds what was
    loaded (``_loaded_bytes``) as its repack leaves it: every layer's packed matrices in
    place of the sources it freed (``kv_memory.repack_phase``): --quantize's format in place
    of the bf16 layers, a checkpoint's own groups packed beside the other tensors, at
    ``tp`` > 1 rank 0's share, its groups freed once packed."""
    if engine != "monokernel":
        return weight_bytes
    rank = cfg if tp == 1 else rank_config(shard_config(cfg, 0, tp))
    repacked = kv_memory.repack_phase(rank, _packing(cfg, tp, s)).weights
    return _loaded_bytes(cfg, weight_bytes, tp, s) + repacked


def need_bytes(
    cfg: ModelConfig, n: int, weight_bytes: int, engine: str, tp: int, s: PlanSettings
) -> int:
    """Device bytes (on the first GPU) at the peak of loading the weights and an ``n``-token
    context. ``weight_bytes``: ``dense_weight_bytes`` in the device dtype, whatever the
    engine. The monokernel's peak is its load's costlier phase (``kv_memory.load_phases``)
    on top of what was loaded; the backend's check adds the same to what it finds there."""
    if engine == "monokernel":
        return _loaded_bytes(cfg, weight_bytes, tp, s) + _load_phases(cfg, n, tp, s).peak
    # torch / reference: no repacking, a cache in the model's dtype, a prefill in chunks of
    # PREFILL_CHUNK whose activations are the model's dtype (the "bf16" count: no fp32
    # copies) and whose attention may materialise its scores and mask (SDPA's math path).
    chunk = min(PREFILL_CHUNK, n)
    scores = chunk * n * (cfg.num_heads * 4 + 1)
    return weight_bytes + kv_memory.needed_bytes(
        cfg, n, chunk, "bf16", extra=scores, kv_dtype_bytes=s.dtype_bytes
    )


def longest_context(
    cfg: ModelConfig, free: int, weight_bytes: int, engine: str, tp: int, s: PlanSettings
) -> int:
    """The longest context (up to the model's maximum) that fits in ``free`` bytes; 0 if
    none, not even one token beside the weights."""
    return kv_memory.longest_fitting(
        lambda n: need_bytes(cfg, n, weight_bytes, engine, tp, s) <= free,
        cfg.max_position_embeddings,
    )


class ContextTooLargeError(InvalidRequestError):
    """The weights and the context do not fit; the message says what would. The numbers
    are kept for a caller that words its own line (``auto``'s fallback)."""

    def __init__(self, message: str, tokens: int, need: int, free: int) -> None:
        super().__init__(message)
        self.tokens, self.need_bytes, self.free_bytes = tokens, need, free


def _advice(
    cfg: ModelConfig, n: int, free: int, weight_bytes: int, engine: str, tp: int, s: PlanSettings
) -> str:
    """What would fit instead of ``n`` tokens on ``engine``, most useful first."""
    fits = longest_context(cfg, free, weight_bytes, engine, tp, s)
    # The monokernel holds the checkpoint's layers and their packed copies at once while it
    # repacks them; the torch engine needs neither the copies nor their room.
    other = (
        longest_context(cfg, free, weight_bytes, "torch", 1, s)
        if engine == "monokernel" and tp == 1
        else 0
    )
    if fits:
        tip = f"--max-model-len {fits} is the longest that fits"
        return tip + (f" (--engine torch: {other})" if other > fits else "")
    if other:
        return (
            f"the monokernel's load (the weights and their repacked copies) does not fit at "
            f"any context; --engine torch fits up to {other} tokens"
        )
    if s.dtype_bytes != 2:
        half = dataclasses.replace(s, dtype_bytes=2)
        if longest_context(cfg, free, weight_bytes * 2 // s.dtype_bytes, engine, tp, half):
            return "--dtype bfloat16 fits (half the weight bytes)"
    too_large = (
        "too large for this GPU even with its layers packed from the checkpoint's own groups"
        if engine == "monokernel" and s.layers.groups is not None
        else "too large in bf16 for this GPU (weights are loaded in bf16 whatever the "
        "checkpoint stores)"
    )
    advice = [f"the model is {too_large}: use a smaller model or a GPU with more free memory"]
    if tp == 1 and s.gpus >= 2 and engine == "monokernel":
        # Offer --tp only where its own plan fits (each GPU also holds the whole embedding).
        sizes = [t for t in valid_tp_sizes(cfg) if 1 < t <= s.gpus]
        t = next((t for t in sizes if longest_context(cfg, free, weight_bytes, engine, t, s)), 0)
        if t:
            return f"--tp {t} fits (the weights split over {t} GPUs)"
    return "; ".join(advice)


def _too_big(
    cfg: ModelConfig,
    n: int,
    free: int,
    weight_bytes: int,
    engine: str,
    tp: int,
    s: PlanSettings,
    asked: str,
) -> ContextTooLargeError:
    need = need_bytes(cfg, n, weight_bytes, engine, tp, s)
    weights = device_weight_bytes(cfg, weight_bytes, engine, tp, s)
    mono = engine == "monokernel"
    if mono and _load_phases(cfg, n, tp, s).binding == "repacking":
        loaded = _loaded_bytes(cfg, weight_bytes, tp, s)
        needs = (
            f"needs {gib(need)} on {s.where} while the layers are repacked, before the KV "
            f"cache is allocated ({gib(loaded)} loaded + {gib(need - loaded)} for packing "
            "them a layer at a time: the packed layers so far, one layer's copies and "
            "working memory, RoPE tables, reserve)"
        )
    else:
        needs = (
            f"needs {gib(need)} on {s.where}"
            + (" once the layers are repacked" if mono else "")
            + f" ({gib(weights)} of weights + {gib(need - weights)} for a {n}-token "
            "context: KV cache, prefill workspace"
            + (", RoPE tables" if mono else "")
            + ", reserve)"
        )
    message = f"{asked} {needs} but {gib(free)} is free; " + _advice(
        cfg, n, free, weight_bytes, engine, tp, s
    )
    return ContextTooLargeError(message, n, need, free)


def plan_context(
    cfg: ModelConfig,
    free: int | None,
    weight_bytes: int,
    engine: str,
    requested: int | None,
    tp: int = 1,
    settings: PlanSettings | None = None,
) -> ContextPlan:
    """The context to allocate for ``engine`` (reference | torch | monokernel) and why.

    ``free``: the first GPU's free bytes before the weights load, None on CPU (nothing to
    plan: the asked length or DEFAULT_MAX_MODEL_LEN, at most the model's maximum).
    ``weight_bytes``: the weights dense in the device dtype (``dense_weight_bytes``), which
    ``device_weight_bytes`` turns into what ``engine`` holds of them as ``settings.layers``
    says. ``requested``: ``--max-model-len`` or None to choose. Raises InvalidRequestError,
    one line naming the bytes and what would fit, when nothing or not the asked length fits."""
    s = settings or PlanSettings()
    model_max = cfg.max_position_embeddings
    capped = requested is not None and requested > model_max
    asked = f"--max-model-len {requested}" if requested is not None else ""
    if free is None:
        n = min(requested or DEFAULT_MAX_MODEL_LEN, model_max)
        why = f"{asked} capped at the model's maximum" if capped else asked or "the CPU default"
        return ContextPlan(n, f"context: {n} tokens ({why}; model max {model_max})")
    weights = device_weight_bytes(cfg, weight_bytes, engine, tp, s)
    after = f"{gib(max(free - weights, 0))} free after {gib(weights)} of weights"
    if requested is not None:
        n = min(requested, model_max)
        need = need_bytes(cfg, n, weight_bytes, engine, tp, s)
        if need > free:
            raise _too_big(cfg, n, free, weight_bytes, engine, tp, s, f"a context of {n} tokens")
        why = f"{asked} capped at the model's maximum" if capped else asked
        note = f"context: {n} tokens ({why}; {after}; model max {model_max})"
        return ContextPlan(n, note, need, free)
    fits = longest_context(cfg, max(free - _SLACK_BYTES, 0), weight_bytes, engine, tp, s)
    if fits == 0:
        raise _too_big(cfg, 1, free, weight_bytes, engine, tp, s, "the model")
    if fits < model_max and fits >= _ROUND_TOKENS:
        fits -= fits % _ROUND_TOKENS
    if engine != "monokernel" and fits > DEFAULT_MAX_MODEL_LEN:
        n = DEFAULT_MAX_MODEL_LEN
        why = f"the {engine} engine's default" + (
            ", as its decode step reads the whole cache every token" if engine == "torch" else ""
        )
        why += f"; --max-model-len up to {fits} fits in {after}"
    elif fits == model_max:
        n, why = fits, f"the model's maximum; fits in {after}"
    else:
        n, why = fits, f"the largest that fits in {after}"
    note = f"context: {n} tokens ({why}; model max {model_max})"
    return ContextPlan(n, note, need_bytes(cfg, n, weight_bytes, engine, tp, s), free)
