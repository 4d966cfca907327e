"""Sizing the monokernel's load and KV cache against the GPU's free memory.

The cache is allocated whole at load time (the kernel indexes it by absolute position), so
a context that cannot fit must be refused then, with numbers, rather than fail on the first
long prompt. Prefill needs transient memory on top (``prefill.workspace_bytes``).

The backend checks before it repacks, while the layers' sources are still on the device,
and what it allocates after comes in two phases whose peaks do not add (``load_phases``):
(a) repacking the layers one at a time (weights/repack.py), each layer's sources freed once
packed where nothing else holds them; (b) the cache, the prefill's workspace and its graphs
beside the packed weights. Counting (b)'s cache on top of (a)'s sources would refuse a
32B model --quantize fp8 on an 80 GB GPU the context that fits beside its fp8 layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from monokernel.errors import InvalidRequestError
from monokernel.models.config import ModelConfig
from monokernel.runtime.prefill import workspace_bytes
from monokernel.runtime.prefill_graphs import MAX_SUFFIX_BUCKET
from monokernel.weights.formats import DEFAULT_FORMAT, WeightFormat
from monokernel.weights.formats.fp8 import Fp8Rows
from monokernel.weights.formats.int4 import Int4Groups
from monokernel.weights.formats.int8 import Int8Rows
from monokernel.weights.formats.tiles import tiles_for
from monokernel.weights.group_quant import _CHUNK_GPU
from monokernel.weights.quantize import GroupsPlan, config_format

# Left free for what is allocated later and not counted here: cuBLAS and attention
# workspaces, the kernel's module and buffers, allocator fragmentation. Kept in both phases:
# repacking fragments the allocator's blocks as much as anything after it.
RESERVE_BYTES = 512 * 1024 * 1024
# The backend's bf16 copy of a checkpoint that arrives in another dtype (every tensor: the
# embedding and the norms too, not only a format's matrices).
_CONVERT_BYTES = torch.bfloat16.itemsize
# A layer's sources as repack reads them (bf16: the backend's copy where they were not).
_SOURCE_BYTES = torch.bfloat16.itemsize
# A GroupQuant's float32 scale and offset, a group.
_GROUP_PAIR_BYTES = 8
_F32 = 4
# Working memory of packing one matrix, bytes a weight, beside its source, its fused copy
# and its packed result: the peak of the format's pack as written (weights/formats), which
# test_kv_memory measures on the CPU. fp8 (rows, tiles, block scales): the float32 copy,
# the scaled and the clamped values. int8 rows: the float32 copy, scaled, rounded, clamped.
# int4 tiles (pack_tiles): the quants widened to int32, their fragments, the shifted words
# and the packed int64 words; int4 rows (pack_nibbles): the two half-byte planes. A
# folded bf16 matrix: its float32 copy and the product.
_FP8_WORK = 12
_INT8_WORK = 16
_INT4_TILES_WORK = 13
_INT4_ROWS_WORK = 1
_FOLD_WORK = 8
# group_quant.quantize_rtn's search (--quantize int4), bytes a weight of the chunk of rows
# it works on: ~20 unweighted, ~31 weighted by input statistics (measured on the CPU).
_SEARCH_WORK = 32
# The matrices repack makes of a layer (weights/repack.py MATRICES), and those it fuses
# from several of the checkpoint's (a copy, even where the format packs in place).
_MATRICES = ("wqkv", "wo", "wgu", "wdown")
_FUSED = frozenset({"wqkv", "wgu"})


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """K and V of one position over every layer."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def rope_bytes_per_token(cfg: ModelConfig) -> int:
    """The RoPE tables ``weights.repack`` builds for every position: cos, sin and angles, fp32.
    Per position like the cache, so the longest context that fits counts them too."""
    return 3 * (cfg.head_dim // 2) * 4


def _stage_format(width: tuple[str, int], tiles: bool = False) -> WeightFormat:
    method, group = width
    return Int4Groups(group, tiles) if method == "int4" else Int8Rows(group=group)


def layer_matrix_params(cfg: ModelConfig) -> int:
    """Weights in every layer's seven linear matrices: the part of a model that streams in a
    weight format or from a checkpoint's own groups; the rest (embedding, LM head, norms,
    biases) stays in the device dtype whatever the format."""
    return cfg.num_layers * sum(r * c for r, c in _layer_shapes(cfg).values())


def _layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """A layer's streamed matrices, [rows, cols] (weights/repack.py LayerPack)."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    return {"wqkv": (q + 2 * kv, h), "wo": (h, q), "wgu": (2 * i, h), "wdown": (h, i)}


def _stage_widths(plan: GroupsPlan) -> tuple[tuple[str, int], tuple[str, int], tuple[str, int]]:
    """(QKV, layers, down): each stage's (format, group), a stage without its own taking the
    layers'."""
    return (
        plan.qkv if plan.qkv[0] else plan.layers,
        plan.layers,
        plan.down if plan.down[0] else plan.layers,
    )


@dataclass(frozen=True, slots=True)
class Packing:
    """What the monokernel's repack (weights/repack.py) starts from on the device and what it
    makes there, as far as memory goes.

    ``fmt``: the layers' weight format (--quantize's, or the groups' method); ``groups``:
    they are packed from a checkpoint's own groups in this plan instead of from dense
    matrices; ``fp8_block``: fp8 packed with a checkpoint's block scales of that many
    columns (0: a scale a row). ``consume``: each layer's sources on the device are freed
    once packed (repack's ``consume``: the backend owns the weights). ``dense_layers``: the
    layers' dense matrices are on the device (without groups; with them never: a
    checkpoint's are made only when read, weights/lazy_weights.py, a TP rank's stay on the
    host). ``groups_on_device``: the groups are on the device whole (AWQ/GPTQ, a TP rank's
    blocks), not copied there a layer at a time; ``owns_groups``: nothing else holds them,
    so ``consume`` frees them too (a TP rank's; a checkpoint's stay with the engine).
    ``fold``: the norm gains are folded into copies of the matrices and the LM head;
    ``convert``: the weights arrive in another dtype and the backend copies them to bf16
    first."""

    fmt: str = DEFAULT_FORMAT
    groups: GroupsPlan | None = None
    fp8_block: int = 0
    consume: bool = False
    dense_layers: bool = True
    groups_on_device: bool = False
    owns_groups: bool = False
    fold: bool = False
    convert: bool = False


def _layer_formats(cfg: ModelConfig, p: Packing) -> dict[str, WeightFormat]:
    """The format each of a layer's matrices is packed in, as repack_layer picks it."""
    if p.groups is not None:
        h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        tiles = tiles_for("int4", h, q, kv, i)  # repack's _pack_groups
        qkv, layers, down = (_stage_format(w, tiles) for w in _stage_widths(p.groups))
        return {"wqkv": qkv, "wo": layers, "wgu": layers, "wdown": down}
    if p.fp8_block:
        return dict.fromkeys(_MATRICES, Fp8Rows(tiles=True, block=p.fp8_block))
    return dict.fromkeys(_MATRICES, config_format(p.fmt, cfg))


def group_pack_bytes(cfg: ModelConfig, plan: GroupsPlan) -> int:
    """Every layer's packed matrices (scales included) from a checkpoint's own groups, each
    stage in its plan's format (weights/quantize.py GroupsPlan)."""
    shapes, formats = _layer_shapes(cfg), _layer_formats(cfg, Packing(groups=plan))
    return cfg.num_layers * sum(formats[m].matrix_bytes(*shapes[m]) for m in _MATRICES)


def _unpacked(rows: int, cols: int, group: int) -> int:
    """A [rows, cols] GroupQuant's bytes: a byte a weight (q is uint8 whatever its bits) and
    a float32 scale and offset a group."""
    return rows * cols + _GROUP_PAIR_BYTES * rows * (cols // group)


def _layer_group_bytes(cfg: ModelConfig, plan: GroupsPlan) -> dict[str, int]:
    """One layer's groups as GroupQuant holds them, by the matrix they pack into (QKV and
    gate/up: their matrices' together, the size of their fused copies)."""
    (_, qkv_g), (_, layers_g), (_, down_g) = _stage_widths(plan)
    group = {"wqkv": qkv_g, "wo": layers_g, "wgu": layers_g, "wdown": down_g}
    return {m: _unpacked(r, c, group[m]) for m, (r, c) in _layer_shapes(cfg).items()}


def group_bytes(cfg: ModelConfig, plan: GroupsPlan) -> int:
    """Every layer's groups as GroupQuant holds them, in ``plan``'s groups: what a device
    holds of them where they are there whole (an AWQ/GPTQ checkpoint read to the GPU, a
    tensor-parallel rank's blocks), not one layer at a time."""
    return cfg.num_layers * sum(_layer_group_bytes(cfg, plan).values())


def _vector_bytes(cfg: ModelConfig, fold: bool) -> int:
    """A LayerPack's float32 vectors, new copies of the checkpoint's: the QKV bias, the
    q/k norms, the O bias, and the norm gains where they are not folded."""
    n = (cfg.q_size + 2 * cfg.kv_size) * cfg.qkv_bias + 2 * cfg.head_dim * cfg.qk_norm
    n += cfg.hidden_size * cfg.o_bias + (0 if fold else 2 * cfg.hidden_size)
    return _F32 * n


def _work_bytes(f: WeightFormat, rows: int, cols: int, p: Packing, folded: bool) -> int:
    """Packing one [rows, cols] matrix in ``f`` (``folded``: a norm gain folded into it
    first): what it holds at its peak beside its source, its fused copy and its result (the
    _*_WORK constants)."""
    n = rows * cols
    if f.packs_in_place:
        return _FOLD_WORK * n if folded else 0
    if isinstance(f, Int4Groups):
        relaid = (_INT4_TILES_WORK if f.tiles else _INT4_ROWS_WORK) * n
        if p.groups is not None:
            return relaid
        # --quantize int4: the matrix's GroupQuant, and before it is whole the search's
        # chunk of rows, then the packing's own.
        chunk = min(rows, max(1, _CHUNK_GPU // cols)) * cols
        return _unpacked(rows, cols, f.group) + max(relaid, _SEARCH_WORK * chunk)
    if p.groups is not None:  # int8 groups: the byte tiles are the packed data itself
        return 0
    return (_FP8_WORK if isinstance(f, Fp8Rows) else _INT8_WORK) * n


@dataclass(frozen=True, slots=True)
class RepackBytes:
    """Device bytes repacking adds to what was there before it (the RoPE tables apart):
    ``peak`` while it packs, ``weights`` once it is done. Either is less the sources it has
    freed by then, so ``weights`` is negative where the packed layers take less than the
    dense ones they replace (--quantize from bf16)."""

    peak: int
    weights: int
    layer: int  # one layer's packed matrices and vectors
    freed: int  # one layer's sources freed once it is packed
    transient: int  # the costliest layer's copies and working memory beside them


def repack_phase(cfg: ModelConfig, p: Packing) -> RepackBytes:
    """Phase (a): repack packs the layers in order, each one's packed matrices new beside
    its sources, which are freed once the layer is done (``p.consume``); a fused matrix is
    a copy first, and packing one holds its working memory. Layer k's peak is then the k
    layers before it (packed, less their freed sources), its own packed matrices and its
    costliest matrix's copy and working memory; the peak is layer 0's where packing frees
    more than it makes, else the last layer's. Then a folded LM head: a bf16 copy made
    through float32."""
    shapes, formats = _layer_shapes(cfg), _layer_formats(cfg, p)
    grouped = p.groups is not None
    # Where the format packs in place (bf16) an unfused matrix is its source itself: neither
    # new nor freed.
    new = [m for m in _MATRICES if grouped or m in _FUSED or not formats[m].packs_in_place]
    layer = sum(formats[m].matrix_bytes(*shapes[m]) for m in new) + _vector_bytes(cfg, p.fold)
    groups = _layer_group_bytes(cfg, p.groups) if p.groups is not None else {}
    freed = 0
    if p.consume and p.dense_layers:
        freed += sum(_SOURCE_BYTES * shapes[m][0] * shapes[m][1] for m in new)
    if p.consume and p.groups_on_device and p.owns_groups:
        freed += sum(groups.values())

    def fused_copy(m: str) -> int:
        if m not in _FUSED:
            return 0
        if grouped:
            return groups[m]
        # bf16 unfolded: the fused copy is the packed matrix itself, counted in ``layer``.
        packs_copy = formats[m].packs_in_place and not p.fold
        return 0 if packs_copy else _SOURCE_BYTES * shapes[m][0] * shapes[m][1]

    # Groups on the host are copied to the device a layer at a time and held while it packs.
    copied = sum(groups.values()) if grouped and not p.groups_on_device else 0
    transient = copied + max(
        fused_copy(m) + _work_bytes(formats[m], *shapes[m], p, p.fold and m in _FUSED)
        for m in _MATRICES
    )
    step = layer - freed
    peak = max(0, (cfg.num_layers - 1) * step) + layer + transient
    weights = cfg.num_layers * step
    if p.fold:
        head = cfg.vocab_size * cfg.hidden_size
        peak = max(peak, weights + (_SOURCE_BYTES + _FOLD_WORK) * head)
        weights += _SOURCE_BYTES * head
    if p.convert:
        # The bf16 copy is made whole before repacking; with groups the layer matrices are
        # not among what is copied (weights/lazy_weights.py leaves them unread).
        params = cfg.num_parameters() - (0 if p.dense_layers else layer_matrix_params(cfg))
        peak += _CONVERT_BYTES * params
        weights += _CONVERT_BYTES * params
    return RepackBytes(peak, weights, layer, freed, transient)


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
    not grow with the context, e.g. the repacked weights' change: ``load_phases``).
    ``kv_dtype_bytes``: the cache's element size (the monokernel's is bf16; the torch
    engine's is the model's dtype)."""
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


@dataclass(frozen=True, slots=True)
class LoadPhases:
    """What the monokernel backend's load needs beside what is on the device when it checks
    (bytes), at each phase's peak, in the order it allocates (backend.py): ``repacking``,
    phase (a): the RoPE tables (repack builds them first), then the layers packed one at a
    time (``repack_phase``); ``serving``, phase (b): the repacked weights' change
    (``repack``'s ``weights``: less the sources freed), the RoPE tables, then the KV cache,
    the prefill's workspace and graphs and what else the caller counts (``context``). Each
    keeps RESERVE_BYTES spare. The peaks do not add: nothing of (b) is allocated until (a)
    is over, and (a)'s transients are gone by then."""

    repack: RepackBytes
    rope: int
    context: int
    repacking: int
    serving: int

    @property
    def peak(self) -> int:
        return max(self.repacking, self.serving)

    @property
    def binding(self) -> str:
        """The phase whose peak is the load's: "repacking" or "serving"."""
        return "repacking" if self.repacking > self.serving else "serving"


def load_phases(
    cfg: ModelConfig,
    max_len: int,
    chunk_tokens: int,
    precision: str,
    packing: Packing,
    graphs: bool = False,
    extra: int = 0,
) -> LoadPhases:
    """The two phases of the monokernel backend's load for a ``max_len`` context
    (LoadPhases). ``chunk_tokens``, ``precision``: the prefill's; ``graphs``: its CUDA
    graphs are on; ``extra``: what else is allocated beside the cache that does not grow
    with the context (a TP rank's partial sums and prefill graphs)."""
    repack = repack_phase(cfg, packing)
    rope = rope_bytes_per_token(cfg) * max_len
    serving = needed_bytes(
        cfg, max_len, chunk_tokens, precision, repack.weights + extra, graphs, packing.fmt
    )
    context = serving - repack.weights - rope - RESERVE_BYTES
    repacking = rope + repack.peak + RESERVE_BYTES
    return LoadPhases(repack, rope, context, repacking, serving)


def check_load_fits(
    cfg: ModelConfig,
    max_len: int,
    free: int,
    chunk_tokens: int,
    precision: str,
    where: str,
    packing: Packing,
    graphs: bool = False,
    extra: int = 0,
) -> LoadPhases:
    """The load's phases for a ``max_len`` context (``load_phases``) where both fit in
    ``free`` bytes (measured with the layers' sources on the device); else
    InvalidRequestError naming the phase that does not fit, its bytes and what would."""
    phases = load_phases(cfg, max_len, chunk_tokens, precision, packing, graphs, extra)
    if phases.peak <= free:
        return phases

    def fits_in_free(n: int) -> bool:
        return load_phases(cfg, n, chunk_tokens, precision, packing, graphs, extra).peak <= free

    fits = longest_fitting(fits_in_free)
    advice = (
        f"at most {fits} tokens fit: lower --max-model-len"
        if fits
        else "no context fits: free GPU memory or use a smaller model"
    )
    r = phases.repack
    if phases.binding == "repacking":
        what = "from their groups" if packing.groups is not None else f"in {packing.fmt}"
        raise InvalidRequestError(
            f"repacking the layers {what} needs {phases.repacking:,} bytes on {where} at its "
            f"peak, before the KV cache is allocated (the layers packed so far and the next: "
            f"{r.peak:,}, a layer {r.layer:,} bytes packed and up to {r.transient:,} of copies "
            f"and working memory while it packs, {r.freed:,} bytes of its sources freed once "
            f"it is; RoPE tables {phases.rope:,}; reserve {RESERVE_BYTES:,}) but only "
            f"{free:,} bytes are free beside the weights; {advice}"
        )
    cache = kv_bytes_per_token(cfg) * max_len
    raise InvalidRequestError(
        f"a context of {max_len} tokens needs {phases.serving:,} bytes on {where} once the "
        f"layers are repacked (KV cache {cache:,} + prefill workspace and graphs "
        f"{phases.context - cache:,} + repacked weights {r.weights:+,} beside those loaded "
        f"+ RoPE tables {phases.rope:,} + reserve {RESERVE_BYTES:,}) but only {free:,} "
        f"bytes are free; {advice}"
    )
