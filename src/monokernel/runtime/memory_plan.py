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
"""

from __future__ import annotations

from dataclasses import dataclass

from monokernel.errors import InvalidRequestError
from monokernel.models.config import ModelConfig
from monokernel.models.transformer import PREFILL_CHUNK
from monokernel.runtime import kv_memory
from monokernel.runtime.prefill_tp import ShardedPrefill
from monokernel.runtime.prefill_tp_graphs import graph_bytes as tp_graph_bytes
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


@dataclass(frozen=True, slots=True)
class ContextPlan:
    max_model_len: int
    note: str  # the startup line: the context and why it is that long
    need_bytes: int | None = None  # weights + cache + workspace + reserve; None on CPU
    free_bytes: int | None = None


def gib(n: int) -> str:
    """``n`` bytes for a message: GiB, one decimal."""
    return f"{n / GIB:.1f} GiB"


def need_bytes(
    cfg: ModelConfig, n: int, weight_bytes: int, engine: str, tp: int, s: PlanSettings
) -> int:
    """Device bytes (on the first GPU) for the weights and an ``n``-token context."""
    if engine == "monokernel" and tp > 1:
        return _tp_rank0_bytes(cfg, n, weight_bytes, tp, s)
    if engine == "monokernel":
        # fold as MonokernelBackend's default, consume as the engine builds it.
        extra = kv_memory.repack_bytes(
            cfg, fold=False, convert=s.dtype_bytes != 2, consume=s.consume
        )
        return weight_bytes + kv_memory.needed_bytes(
            cfg, n, s.chunk_tokens, s.precision, extra, s.graphs
        )
    # torch / reference: no repacking, a cache in the model's dtype, a prefill in chunks of
    # PREFILL_CHUNK whose activations are the model's dtype (the "bf16" count: no fp32
    # copies) and whose attention may materialise its scores and mask (SDPA's math path).
    chunk = min(PREFILL_CHUNK, n)
    scores = chunk * n * (cfg.num_heads * 4 + 1)
    return weight_bytes + kv_memory.needed_bytes(
        cfg, n, chunk, "bf16", extra=scores, kv_dtype_bytes=s.dtype_bytes
    )


def _tp_rank0_bytes(cfg: ModelConfig, n: int, weight_bytes: int, tp: int, s: PlanSettings) -> int:
    """Rank 0 of the TP backend (runtime/backends/monokernel/tp.py) holds the most: its shard
    in bf16 (the layers' 1/tp, its LM-head rows, the whole embedding), repacked, its KV heads'
    cache and RoPE tables, its prefill's workspace and the partial sums the sharded prefill
    exchanges (runtime/prefill_tp.py), and its prefill graphs (runtime/prefill_tp_graphs.py).
    The checkpoint itself stays in host memory."""
    rank = rank_config(shard_config(cfg, 0, tp))
    layers = weight_bytes * 2 // s.dtype_bytes
    embed = 2 * cfg.vocab_size * cfg.hidden_size
    head = 0 if cfg.tie_word_embeddings else embed
    shard = (layers - embed - head) // tp + embed + 2 * rank.vocab_size * cfg.hidden_size
    chunk = min(s.chunk_tokens, n)
    extra = kv_memory.repack_bytes(rank, fold=False, convert=False, consume=True)
    extra += ShardedPrefill.extra_bytes(chunk, cfg.hidden_size, tp)
    if s.graphs:
        extra += tp_graph_bytes(rank, s.chunk_tokens, n, s.precision)
    return shard + kv_memory.needed_bytes(rank, n, chunk, s.precision, extra)


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
        half = PlanSettings(s.chunk_tokens, s.precision, s.graphs, 2, s.gpus, s.where)
        if longest_context(cfg, free, weight_bytes * 2 // s.dtype_bytes, engine, tp, half):
            return "--dtype bfloat16 fits (half the weight bytes)"
    advice = [
        "the model is too large in bf16 for this GPU (weights are loaded in bf16 whatever the "
        "checkpoint stores): use a smaller model or a GPU with more free memory"
    ]
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
    message = (
        f"{asked} needs {gib(need)} on {s.where} ({gib(weight_bytes)} of weights + "
        f"{gib(need - weight_bytes)} for a {n}-token context: KV cache, prefill workspace"
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
    ``weight_bytes``: the weights as they will sit on the device. ``requested``:
    ``--max-model-len`` or None to choose. Raises InvalidRequestError, one line naming the
    bytes and what would fit, when nothing or not the asked length fits."""
    s = settings or PlanSettings()
    model_max = cfg.max_position_embeddings
    capped = requested is not None and requested > model_max
    asked = f"--max-model-len {requested}" if requested is not None else ""
    if free is None:
        n = min(requested or DEFAULT_MAX_MODEL_LEN, model_max)
        why = f"{asked} capped at the model's maximum" if capped else asked or "the CPU default"
        return ContextPlan(n, f"context: {n} tokens ({why}; model max {model_max})")
    after = f"{gib(max(free - weight_bytes, 0))} free after {gib(weight_bytes)} of weights"
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
