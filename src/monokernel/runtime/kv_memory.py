"""Sizing the monokernel's KV cache against the GPU's free memory.

The cache is allocated whole at load time (the kernel indexes it by absolute position), so
a context that cannot fit must be refused then, with numbers, rather than fail on the first
long prompt. Prefill needs transient memory on top (``prefill.workspace_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from monokernel.errors import InvalidRequestError
from monokernel.models.config import ModelConfig
from monokernel.runtime.prefill import workspace_bytes
from monokernel.runtime.prefill_graphs import MAX_SUFFIX_BUCKET
from monokernel.weights.formats import DEFAULT_FORMAT, WeightFormat, get_format
from monokernel.weights.formats.int4 import Int4Groups
from monokernel.weights.formats.int8 import Int8Rows
from monokernel.weights.quantize import GroupsPlan

# Left free for what is allocated later and not counted here: cuBLAS and attention
# workspaces, the kernel's module and buffers, allocator fragmentation.
RESERVE_BYTES = 512 * 1024 * 1024
# The backend's bf16 copy of a checkpoint that arrives in another dtype (every tensor: the
# embedding and the norms too, not only a format's matrices).
_CONVERT_BYTES = torch.bfloat16.itemsize
# A GroupQuant's float32 scale and offset, a group.
_GROUP_PAIR_BYTES = 8


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """K and V of one position over every layer."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def rope_bytes_per_token(cfg: ModelConfig) -> int:
    """The RoPE tables ``weights.repack`` builds for every position: cos, sin and angles, fp32.
    Per position like the cache, so the longest context that fits counts them too."""
    return 3 * (cfg.head_dim // 2) * 4


def repack_bytes(
    cfg: ModelConfig,
    fold: bool,
    convert: bool,
    fmt: str = DEFAULT_FORMAT,
    consume: bool = False,
    groups: GroupsPlan | None = None,
) -> int:
    """What ``weights.repack.repack`` allocates beyond the weights it is given (bf16) and the
    RoPE tables, its matrices packed in the weight format ``fmt``: the fused QKV and gate/up
    matrices, a folded LM head, and the other matrices where the format does not pack in
    place; plus a bf16 copy of everything when the weights arrive in another dtype.
    ``consume`` (repack's): each layer's sources are freed once packed, so one layer's
    matrices are the most held twice.

    ``groups``: the layers are packed from a checkpoint's own groups in this plan (``fmt``
    and ``consume`` then do not apply; ``fold`` cannot be): see ``group_repack_bytes``."""
    if groups is not None:
        return group_repack_bytes(cfg, groups, convert)
    f = get_format(fmt)
    h, i, q = cfg.hidden_size, cfg.intermediate_size, cfg.q_size
    per_layer = f.matrix_bytes(q + 2 * cfg.kv_size, h) + f.matrix_bytes(2 * i, h)
    if not f.packs_in_place:
        per_layer += f.matrix_bytes(h, q) + f.matrix_bytes(h, i)
    total = (1 if consume else cfg.num_layers) * per_layer
    if fold or not f.packs_in_place:
        total += f.matrix_bytes(cfg.vocab_size, h)
    if convert:
        total += _CONVERT_BYTES * cfg.num_parameters()
    return total


def _stage_format(width: tuple[str, int]) -> WeightFormat:
    method, group = width
    return Int4Groups(group) if method == "int4" else Int8Rows(group=group)


def layer_matrix_params(cfg: ModelConfig) -> int:
    """Weights in every layer's seven linear matrices: the part of a model that streams in a
    weight format or from a checkpoint's own groups; the rest (embedding, LM head, norms,
    biases) stays in the device dtype whatever the format."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    return cfg.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * i)


def _stage_widths(plan: GroupsPlan) -> tuple[tuple[str, int], tuple[str, int], tuple[str, int]]:
    """(QKV, layers, down): each stage's (format, group), a stage without its own taking the
    layers'."""
    return (
        plan.qkv if plan.qkv[0] else plan.layers,
        plan.layers,
        plan.down if plan.down[0] else plan.layers,
    )


def group_pack_bytes(cfg: ModelConfig, plan: GroupsPlan) -> int:
    """Every layer's packed matrices (scales included) from a checkpoint's own groups, each
    stage in its plan's format (weights/quantize.py GroupsPlan)."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    qkv, layers, down = (_stage_format(w) for w in _stage_widths(plan))
    per_layer = (
        qkv.matrix_bytes(q + 2 * kv, h)
        + layers.matrix_bytes(h, q)
        + layers.matrix_bytes(2 * i, h)
        + down.matrix_bytes(h, i)
    )
    return cfg.num_layers * per_layer


def _unpacked(rows: int, cols: int, group: int) -> int:
    """A [rows, cols] GroupQuant's bytes: a byte a weight (q is uint8 whatever its bits) and
    a float32 scale and offset a group."""
    return rows * cols + _GROUP_PAIR_BYTES * rows * (cols // group)


def _layer_group_bytes(cfg: ModelConfig, plan: GroupsPlan) -> tuple[int, int, int, int]:
    """One layer's groups as GroupQuant holds them: (QKV, O, gate/up, down)."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    (_, qkv_g), (_, layers_g), (_, down_g) = _stage_widths(plan)
    return (
        _unpacked(q + 2 * kv, h, qkv_g),
        _unpacked(h, q, layers_g),
        _unpacked(2 * i, h, layers_g),
        _unpacked(h, i, down_g),
    )


def group_bytes(cfg: ModelConfig, plan: GroupsPlan) -> int:
    """Every layer's groups as GroupQuant holds them, in ``plan``'s groups: what a device
    holds of them where they are there whole (an AWQ/GPTQ checkpoint read to the GPU, a
    tensor-parallel rank's blocks), not one layer at a time."""
    return cfg.num_layers * sum(_layer_group_bytes(cfg, plan))


def group_packing_bytes(cfg: ModelConfig, plan: GroupsPlan, convert: bool) -> int:
    """What packing the layers from a checkpoint's own groups allocates beside the packed
    matrices themselves (``group_pack_bytes``): one layer's groups on the device at a time
    while it is packed, its QKV and gate/up twice (the fused copies). ``convert``: a bf16 copy
    of what the device holds besides them (embedding, LM head, norms, biases)."""
    qkv, o, gate_up, down = _layer_group_bytes(cfg, plan)
    total = 2 * qkv + o + 2 * gate_up + down
    if convert:
        total += _CONVERT_BYTES * (cfg.num_parameters() - layer_matrix_params(cfg))
    return total


def group_repack_bytes(cfg: ModelConfig, plan: GroupsPlan, convert: bool) -> int:
    """``repack_bytes`` for layers packed from a checkpoint's own groups in ``plan``: the
    groups stay on the host and the layer matrices are not among the weights on the device
    (nor made at all: weights/lazy_weights.py), so every layer's packed matrices are new
    (``group_pack_bytes``), beside what packing them takes (``group_packing_bytes``)."""
    return group_pack_bytes(cfg, plan) + group_packing_bytes(cfg, plan, convert)


def graph_bytes(
    cfg: ModelConfig, max_len: int, chunk_tokens: int, precision: str, fmt: str = DEFAULT_FORMAT
) -> int:
    """The prefill graphs' memory pool (runtime/prefill_graphs.py), beside eager prefill's:
    a fresh prompt's largest chunk, and a turn's graph (its activations, the key rows it
    reads, its mask as bool and as the attention's float copy)."""
    largest, turn = min(chunk_tokens, max_len), min(MAX_SUFFIX_BUCKET, max_len)
    return (
        workspace_bytes(cfg, largest, largest, precision, fmt)
        + workspace_bytes(cfg, turn, max_len, precision, fmt)
        + 5 * turn * max_len
    )


def needed_bytes(
    cfg: ModelConfig,
    max_len: int,
    chunk_tokens: int,
    precision: str,
    extra: int = 0,
    graphs: bool = False,
    fmt: str = DEFAULT_FORMAT,
    kv_dtype_bytes: int = 2,
) -> int:
    """The cache and RoPE tables for ``max_len`` positions, the prefill workspace (weights in
    the format ``fmt``), the reserve, and ``extra`` (other allocations still to come that do
    not grow with the context, e.g. ``repack_bytes``). ``kv_dtype_bytes``: the cache's element
    size (the monokernel's is bf16; the torch engine's is the model's dtype)."""
    return (
        (kv_bytes_per_token(cfg, kv_dtype_bytes) + rope_bytes_per_token(cfg)) * max_len
        + workspace_bytes(cfg, min(chunk_tokens, max_len), max_len, precision, fmt)
        + RESERVE_BYTES
        + extra
        + (graph_bytes(cfg, max_len, chunk_tokens, precision, fmt) if graphs else 0)
    )


def free_device_bytes(device: torch.device) -> int:
    """What torch can still allocate on ``device``: the driver's free memory plus blocks
    torch's caching allocator holds but does not use."""
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + int(cached)


def max_len_that_fits(
    cfg: ModelConfig,
    free: int,
    chunk_tokens: int,
    precision: str,
    extra: int = 0,
    graphs: bool = False,
    fmt: str = DEFAULT_FORMAT,
) -> int:
    """The longest context whose cache and prefill fit in ``free`` bytes (0 if none)."""

    return longest_fitting(
        lambda n: needed_bytes(cfg, n, chunk_tokens, precision, extra, graphs, fmt) <= free
    )


def longest_fitting(fits: Callable[[int], bool], limit: int = 1 << 40) -> int:
    """The largest n in [1, limit] with ``fits(n)`` (0 if none), for a ``fits`` that stays
    false once false: every byte count here grows with the context, so bisection is exact."""
    lo, hi = 0, 1
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def check_fits(
    cfg: ModelConfig,
    max_len: int,
    free: int,
    chunk_tokens: int,
    precision: str,
    where: str,
    extra: int = 0,
    graphs: bool = False,
    fmt: str = DEFAULT_FORMAT,
) -> int:
    """Raise InvalidRequestError naming the bytes needed and free when a ``max_len`` cache
    cannot fit; returns the bytes needed otherwise. ``extra``, ``fmt``: as in
    ``needed_bytes``."""
    need = needed_bytes(cfg, max_len, chunk_tokens, precision, extra, graphs, fmt)
    if need <= free:
        return need
    cache = kv_bytes_per_token(cfg) * max_len
    rope = rope_bytes_per_token(cfg) * max_len
    work = need - cache - rope - RESERVE_BYTES - extra
    fits = max_len_that_fits(cfg, free, chunk_tokens, precision, extra, graphs, fmt)
    raise InvalidRequestError(
        f"a context of {max_len} tokens needs {need:,} bytes on {where} (KV cache "
        f"{cache:,} + prefill workspace {work:,} + weight repacking {extra:,} + RoPE tables "
        f"{rope:,} + reserve {RESERVE_BYTES:,}) but only {free:,} bytes are free; "
        + (
            f"at most {fits} tokens fit: lower --max-model-len"
            if fits
            else "no context fits: free GPU memory or use a smaller model"
        )
    )
