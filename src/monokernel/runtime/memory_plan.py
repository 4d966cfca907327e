"""Choosing the context length before the weights go to the GPU.

The weights and the whole KV cache are allocated at load, so whether a model fits is known
from numbers alone: the checkpoint's tensor sizes, the config, and the GPU's free memory.
Checking here, before the weights are copied, turns a late CUDA out-of-memory (or the
backend's own refusal after a long copy) into one line that says what would fit. With no
``--max-model-len`` the monokernel gets the longest context that fits, up to the model's
maximum: its decode reads only the positions in use, so a large cache costs memory, not speed.

Everything is counted with ``kv_memory``'s functions, the ones the monokernel backend's
``check_fits`` uses, so a plan that fits here passes that check after the weights load.
``plan_context`` is pure (free bytes and weight bytes are inputs) so it is tested on CPU.

The weights are counted as the device will hold them (``device_weight_bytes``): dense in the
device dtype for the engines that compute with dense matrices, and for the monokernel as its
backend packs them (``LayerPacking``, which the engine passes: a checkpoint's own groups
pack to a quarter to three quarters of bf16's bytes).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from monokernel.errors import InvalidRequestError
from monokernel.models.config import ModelConfig
from monokernel.models.transformer import PREFILL_CHUNK
from monokernel.runtime import kv_memory
from monokernel.runtime.prefill_tp import ShardedPrefill
from monokernel.runtime.prefill_tp_graphs import graph_bytes as tp_graph_bytes
from monokernel.weights.formats import DEFAULT_FORMAT
from monokernel.weights.names import expected_shapes
from monokernel.weights.quantize import GroupsPlan, int4_group_of
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
    they reach the device (from --quantize and the checkpoint it read: Engine._layer_packing).
    The engines that compute with dense matrices hold them in the device dtype whatever this
    says.

    ``fmt``: their weight format (weights/formats: bf16, --quantize's, or a checkpoint's
    groups' method). ``groups``: they are packed from a checkpoint's own groups in this plan
    (weights/quantize.py GroupsPlan), so their dense values never reach the device (a GGUF's
    stay unread on the host: weights/lazy_weights.py). ``groups_on_device``: those groups are
    on the one GPU already, whole, beside the layers' dense values (an AWQ/GPTQ checkpoint,
    read to the GPU and decoded there), not copied there a layer at a time from the host."""

    fmt: str = DEFAULT_FORMAT
    groups: GroupsPlan | None = None
    groups_on_device: bool = False


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


def device_weight_bytes(
    cfg: ModelConfig, weight_bytes: int, engine: str, tp: int, s: PlanSettings
) -> int:
    """The bytes the weights take on the (first) device for ``engine``, from
    ``weight_bytes`` (``dense_weight_bytes`` in the device dtype) and ``s.layers``.

    The torch and reference engines hold every tensor dense. So does the monokernel while it
    packs them in a format (--quantize: the dense source is on the device when the backend
    checks its memory, and repacking consumes it a layer at a time: ``repack_bytes``). From a
    checkpoint's own groups it holds the other tensors dense and every layer's packed
    matrices (``kv_memory.group_pack_bytes``; what packing them adds on top is
    ``group_packing_bytes``), and the groups and dense layers too where those were read to
    the GPU. At ``tp`` > 1, rank 0's share (``_tp_rank0_bytes``)."""
    layers = s.layers
    if engine != "monokernel":
        return weight_bytes
    if tp > 1:
        rank = rank_config(shard_config(cfg, 0, tp))
        # Each rank's shard goes to its GPU in bf16: the layers' 1/tp, the whole embedding,
        # its own LM-head rows.
        dense = weight_bytes * 2 // s.dtype_bytes
        embed = 2 * cfg.vocab_size * cfg.hidden_size
        head = 0 if cfg.tie_word_embeddings else embed
        own_head = 2 * rank.vocab_size * cfg.hidden_size
        groups = _tp_groups(cfg, layers)
        if groups is None:
            return (dense - embed - head) // tp + embed + own_head
        # Its layers come as its blocks of the groups, copied to its GPU whole, then packed.
        rest = dense - embed - head - 2 * kv_memory.layer_matrix_params(cfg)
        packed = kv_memory.group_bytes(rank, groups) + kv_memory.group_pack_bytes(rank, groups)
        return rest // tp + embed + own_head + packed
    if layers.groups is None:
        return weight_bytes
    packed = kv_memory.group_pack_bytes(cfg, layers.groups)
    if layers.groups_on_device:
        return weight_bytes + kv_memory.group_bytes(cfg, layers.groups) + packed
    return weight_bytes - s.dtype_bytes * kv_memory.layer_matrix_params(cfg) + packed


def need_bytes(
    cfg: ModelConfig, n: int, weight_bytes: int, engine: str, tp: int, s: PlanSettings
) -> int:
    """Device bytes (on the first GPU) for the weights and an ``n``-token context.
    ``weight_bytes``: ``dense_weight_bytes`` in the device dtype, whatever the engine."""
    if engine == "monokernel" and tp > 1:
        return _tp_rank0_bytes(cfg, n, weight_bytes, tp, s)
    weights = device_weight_bytes(cfg, weight_bytes, engine, tp, s)
    if engine == "monokernel":
        # What MonokernelBackend's check adds to what is on the device by then (fold as its
        # default, consume as the engine builds it); packed groups are among the weights.
        layers, convert = s.layers, s.dtype_bytes != 2
        if layers.groups is None:
            extra = kv_memory.repack_bytes(
                cfg, fold=False, convert=convert, fmt=layers.fmt, consume=s.consume
            )
        else:
            extra = kv_memory.group_packing_bytes(cfg, layers.groups, convert)
        return weights + kv_memory.needed_bytes(
            cfg, n, s.chunk_tokens, s.precision, extra, s.graphs, layers.fmt
        )
    # torch / reference: no repacking, a cache in the model's dtype, a prefill in chunks of
    # PREFILL_CHUNK whose activations are the model's dtype (the "bf16" count: no fp32
    # copies) and whose attention may materialise its scores and mask (SDPA's math path).
    chunk = min(PREFILL_CHUNK, n)
    scores = chunk * n * (cfg.num_heads * 4 + 1)
    return weights + kv_memory.needed_bytes(
        cfg, n, chunk, "bf16", extra=scores, kv_dtype_bytes=s.dtype_bytes
    )


def _tp_rank0_bytes(cfg: ModelConfig, n: int, weight_bytes: int, tp: int, s: PlanSettings) -> int:
    """Rank 0 of the TP backend (runtime/backends/monokernel/tp.py) holds the most: its shard
    (``device_weight_bytes``), repacked, its KV heads' cache and RoPE tables, its prefill's
    workspace and the partial sums the sharded prefill exchanges (runtime/prefill_tp.py), and
    its prefill graphs (runtime/prefill_tp_graphs.py). The checkpoint itself stays in host
    memory."""
    rank = rank_config(shard_config(cfg, 0, tp))
    fmt = s.layers.fmt
    chunk = min(s.chunk_tokens, n)
    groups = _tp_groups(cfg, s.layers)
    if groups is None:
        extra = kv_memory.repack_bytes(rank, fold=False, convert=False, fmt=fmt, consume=True)
    else:
        extra = kv_memory.group_packing_bytes(rank, groups, convert=False)
    extra += ShardedPrefill.extra_bytes(chunk, cfg.hidden_size, tp)
    if s.graphs:
        extra += tp_graph_bytes(rank, s.chunk_tokens, n, s.precision)
    shard = device_weight_bytes(cfg, weight_bytes, "monokernel", tp, s)
    return shard + kv_memory.needed_bytes(rank, n, chunk, s.precision, extra, fmt=fmt)


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
    # The monokernel holds the checkpoint's matrices and its repacked copies at once while
    # loading; the torch engine needs neither the copies nor their room.
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
    message = (
        f"{asked} needs {gib(need)} on {s.where} ({gib(weights)} of weights + "
        f"{gib(need - weights)} for a {n}-token context: KV cache, prefill workspace"
        + (", weight repacking" if engine == "monokernel" else "")
        + f", reserve) but {gib(free)} is free; "
        + _advice(cfg, n, free, weight_bytes, engine, tp, s)
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
