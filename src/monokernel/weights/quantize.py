"""``--quantize fp8|int8|int4``: a bf16 or float32 checkpoint quantised at load.

The monokernel packs each layer's matrices in the asked-for weight format
(``weights/formats``): fp8 and int8 one byte a weight and a float32 scale a row, half the
bytes of bf16; int4 four bits a weight and a float32 scale and offset a group of 128
columns (int4_group: fewer where 128 does not divide the model's sizes; each group's pair
searched for its least squared error, group_quant.quantize_rtn, weighted by the inputs'
statistics over a calibration text where the engine has them: runtime/calibration.py), 28%
of bf16's bytes. The other engines (the reference, torch-compiled) cannot read those bytes;
they get ``fake_quantize``'s weights instead: each quantised matrix replaced by the
dequantised values the kernel multiplies by, in the checkpoint's dtype, so every engine
computes the same model and the monokernel's tokens can still be checked against the
reference's (int4: with the same statistics, computed once per checkpoint).

A checkpoint stored in 4 or 8 bits with its own groups (GGUF, AWQ, GPTQ: Checkpoint.groups)
streams those groups as they are (``groups_plan``: int4, int8's grouped tiles, or the two
side by side, a stage each).

Only the seven matrices of every layer are quantised. The LM head and the embedding keep the
checkpoint's format, as vLLM's ``--quantize`` does: they are the most sensitive matrices
(every logit goes through the head, every token through its embedding row), and the
embedding is a table the kernel gathers one row of a token, not a matrix it streams.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from monokernel.errors import MonokernelError
from monokernel.models.config import ModelConfig
from monokernel.weights.formats import PackedMatrix, WeightFormat, get_format
from monokernel.weights.formats.fp8 import Fp8Rows
from monokernel.weights.formats.int4 import DEFAULT_GROUP, Int4Groups
from monokernel.weights.formats.int4 import GROUPS as INT4_GROUPS
from monokernel.weights.formats.int8 import Int8Rows
from monokernel.weights.formats.tiles import block_fits, tile_misfits, tiles_for
from monokernel.weights.group_quant import GroupQuant

if TYPE_CHECKING:
    from monokernel.weights.checkpoint_quant import Fp8Blocks

QUANTIZE_METHODS: tuple[str, ...] = ("fp8", "int8", "int4")  # each also a weight format's name
# A layer's linear weights, as weights/names.py spells them ("layers.{n}.wq", ...).
LINEAR_NAMES: tuple[str, ...] = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


class UnsupportedQuantizationError(MonokernelError, ValueError):
    """A ``--quantize`` method that no weight format implements."""


def check_method(method: str) -> str:
    """``method`` itself, or UnsupportedQuantizationError naming the accepted ones."""
    if method not in QUANTIZE_METHODS:
        raise UnsupportedQuantizationError(
            f"--quantize {method!r} is not supported; choose from {', '.join(QUANTIZE_METHODS)}"
        )
    return method


def int4_group(cols: Iterable[int]) -> int:
    """``--quantize int4``'s group for a model whose matrices have these input sizes: 128
    where it divides them all, else the largest of the kernel's smaller groups that does
    (64 for the default model's 576)."""
    sizes = tuple(cols)
    for group in sorted((g for g in INT4_GROUPS if g <= DEFAULT_GROUP), reverse=True):
        if all(c % group == 0 for c in sizes):
            return group
    raise UnsupportedQuantizationError(
        f"--quantize int4: input sizes {sorted(set(sizes))} are not whole groups of "
        f"{min(INT4_GROUPS)} columns"
    )


def method_format(method: str, weights: Mapping[str, torch.Tensor]) -> WeightFormat:
    """The weight format ``method`` packs ``weights``' layers in, for the engines that see
    only the weights (fake_quantize, DequantizedView): int4's group is the one int4_group
    picks for their matrices' input sizes, config_format's for the same model."""
    fmt = get_format(method)
    if method != "int4":
        return fmt
    cols = (w.shape[1] for name, w in weights.items() if is_quantized(name))
    return Int4Groups(int4_group(cols))


def int4_group_of(cfg: ModelConfig) -> int:
    """int4_group for the model ``cfg`` describes (its matrices' input sizes)."""
    return int4_group((cfg.hidden_size, cfg.q_size, cfg.intermediate_size))


def config_format(method: str, cfg: ModelConfig) -> WeightFormat:
    """The weight format ``method`` (a --quantize method, or bf16) packs a model in, known
    by its config: what the kernel's repack, its build and the bench's byte count use."""
    tiles = tiles_for(method, cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size)
    if method == "int4":
        return Int4Groups(int4_group_of(cfg), tiles=tiles)
    if method == "fp8":
        return Fp8Rows(tiles=tiles)
    return get_format(method)


def blocks_stream(cfg: ModelConfig, blocks: Fp8Blocks) -> bool:
    """Whether the monokernel streams an FP8 checkpoint's block scales as they are: its
    layers stream as fp8 tiles (tiles.py tiles_for) and every matrix's input is whole blocks
    the kernel reads (tiles.py block_fits; csrc Fp8BlockTiles)."""
    inputs = (cfg.hidden_size, cfg.q_size, cfg.intermediate_size)
    if not block_fits(blocks.cols) or any(k % blocks.cols for k in inputs):
        return False
    return tiles_for("fp8", cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size)


def is_quantized(name: str) -> bool:
    """Whether ``--quantize`` quantises the tensor called ``name`` (one of a layer's seven
    linear weights)."""
    parts = name.split(".")
    return len(parts) == 3 and parts[0] == "layers" and parts[2] in LINEAR_NAMES


def pack_quantized(
    fmt: WeightFormat,
    name: str,
    w: torch.Tensor,
    stats: Mapping[str, torch.Tensor] | None = None,
) -> PackedMatrix:
    """The layer matrix ``name`` (w) packed in ``fmt``: int4 with the input statistics
    ``stats[name]`` where given (runtime/calibration.py; group_quant.quantize_rtn weighs
    its search with them), every other format as it packs alone."""
    if stats is not None and isinstance(fmt, Int4Groups):
        return fmt.pack(w, act=stats[name])
    return fmt.pack(w)


def fake_quantize(
    weights: Mapping[str, torch.Tensor],
    method: str,
    consume: bool = False,
    stats: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """A new dict of ``weights`` where each layer's linear weight w is what the kernel
    multiplies by once w is packed in format ``method``: ``dense(pack(w))`` in w's dtype
    (exact for float32, the reference's precision). Everything else (the embedding, the LM
    head, norms, biases) is the same tensor object, untouched. ``stats``: int4's input
    statistics by weight name (pack_quantized), the ones the monokernel packs with.

    One matrix at a time, so the working memory is one matrix's float32 copy and its packed
    bytes on top of the dicts. ``weights`` is not changed, unless ``consume`` (a dict the
    caller owns, as cast_weights empties its input): each tensor is then popped as it is
    replaced, so the model is held once, not twice.
    """
    fmt = method_format(check_method(method), weights)
    out: dict[str, torch.Tensor] = {}
    for name in list(weights):
        w = weights.pop(name) if consume else weights[name]  # type: ignore[attr-defined]
        if is_quantized(name):
            w = fmt.dense(pack_quantized(fmt, name, w, stats), dtype=w.dtype)
        out[name] = w
    return out


def groups_method(groups: Mapping[str, GroupQuant]) -> str:
    """The --quantize method a checkpoint's own groups stand for: int4 where every matrix
    is 4 bits, else int8 (some or all in int8 groups: GroupsPlan)."""
    return "int4" if all(gq.bits == 4 for gq in groups.values()) else "int8"


def group_format(gq: GroupQuant, tiles: bool) -> Int4Groups | Int8Rows:
    """The format instance that packs ``gq`` (int4 in the tile layout if ``tiles``; int8
    groups exist only in tiles)."""
    return Int4Groups(gq.group, tiles=tiles) if gq.bits == 4 else Int8Rows(group=gq.group)


# The layer stages a checkpoint's groups may stream in formats of their own (the kernel's
# MK_QKV_FORMAT / MK_DOWN_FORMAT), and the matrices of each; "layers": the O and gate/up
# projections, in the layers' format.
STAGE_MATRICES: dict[str, tuple[str, ...]] = {
    "layers": ("wo", "w_gate", "w_up"),
    "qkv": ("wq", "wk", "wv"),
    "down": ("w_down",),
}


@dataclass(frozen=True, slots=True)
class GroupsPlan:
    """How the monokernel streams a checkpoint's own groups: (format, group) of the layers'
    matrices, and of the fused QKV and the down projection where theirs differ (("", 0)
    where not): a GGUF Q4_K_M's V and down projections, kept in 6 bits, in int8 groups of
    16 beside int4 tiles in groups of 32."""

    layers: tuple[str, int]
    qkv: tuple[str, int] = ("", 0)
    down: tuple[str, int] = ("", 0)


def stage_groups(groups: Mapping[str, GroupQuant], stage: str) -> dict[str, GroupQuant]:
    """The groups of stage ``stage``'s matrices (STAGE_MATRICES), by weight name."""
    names = STAGE_MATRICES[stage]
    return {k: gq for k, gq in groups.items() if k.rsplit(".", 1)[-1] in names}


def _stage_width(groups: Mapping[str, GroupQuant], stage: str) -> tuple[int, int]:
    widths = {(gq.bits, gq.group) for gq in stage_groups(groups, stage).values()}
    if len(widths) != 1:
        raise UnsupportedQuantizationError(
            f"a checkpoint's {stage} matrices in {sorted(widths)} (bits, group): the kernel "
            "streams a stage in one (weights/gguf_8bit.py uniform_groups makes them so)"
        )
    return widths.pop()


def widths_plan(cfg: ModelConfig, width: Mapping[str, tuple[int, int]]) -> tuple[GroupsPlan, int]:
    """The plan for stages of these (bits, group) widths (``width``: each of STAGE_MATRICES's)
    on a model of ``cfg``'s sizes (a rank's), and the group every matrix is widened to as
    int8 (0: none): each stage in its own width where every stage streams tiles (int8 groups
    always, int4 where tiles.py tiles_for says so), else every matrix in int8 groups of the
    finest group (int4 rows cannot sit beside int8 tiles)."""
    finest = 0
    if len(set(width.values())) > 1:
        tiles = tiles_for("int4", cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size)
        if not tiles and any(bits == 4 for bits, _ in width.values()):
            finest = math.gcd(*(g for _, g in width.values()))
            width = dict.fromkeys(STAGE_MATRICES, (8, finest))
    method = {4: "int4", 8: "int8"}
    bits, group = width["layers"]
    own = {
        stage: (method[width[stage][0]], width[stage][1])
        if width[stage] != width["layers"]
        else ("", 0)
        for stage in ("qkv", "down")
    }
    return GroupsPlan((method[bits], group), own["qkv"], own["down"]), finest


def groups_plan(
    cfg: ModelConfig, groups: Mapping[str, GroupQuant]
) -> tuple[GroupsPlan, dict[str, GroupQuant]]:
    """The plan for ``groups`` on a model of ``cfg``'s sizes (a rank's) (widths_plan of their
    stages' widths), and the groups as it streams them (widened where it says so, their
    values unchanged)."""
    plan, finest = widths_plan(
        cfg, {stage: _stage_width(groups, stage) for stage in STAGE_MATRICES}
    )
    if finest:
        groups = {k: gq.widened(finest) for k, gq in groups.items()}
    return plan, dict(groups)


def groups_stream(cfg: ModelConfig, groups: Mapping[str, GroupQuant]) -> bool:
    """Whether the monokernel streams a checkpoint's own groups as they are: always for 4
    bits; with 8-bit ones (int8 groups, tiles only) where the model's (a rank's) sizes are
    whole tiles (tiles.py tile_misfits). Elsewhere the layers stream their dequantised values
    in bf16."""
    if groups_method(groups) == "int4":
        return True
    return not tile_misfits(cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size)


class DequantizedView(Mapping[str, torch.Tensor]):
    """``weights`` as the float32 reference reads them under ``--quantize method``: each
    layer's matrices through the format's pack and dense in float32 (exactly the values the
    kernel scales its dot products to), everything else in float32, one tensor at a time
    when read (an 8B model's float32 copy would not fit beside the kernel's). ``stats``:
    int4's input statistics, as fake_quantize takes them."""

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        method: str,
        stats: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self._w, self._fmt = weights, method_format(check_method(method), weights)
        self._stats = stats

    def __getitem__(self, name: str) -> torch.Tensor:
        w = self._w[name]
        if is_quantized(name):
            return self._fmt.dense(pack_quantized(self._fmt, name, w, self._stats), torch.float32)
        return w.float()

    def __iter__(self) -> Iterator[str]:
        return iter(self._w)

    def __len__(self) -> int:
        return len(self._w)


# The matrices tensor parallelism splits by input column (weights/shard.py): a rank packs
# its block with the whole rows' scales, so TP=N quantises exactly as TP=1 does.
COLUMN_SPLIT: tuple[str, ...] = ("wo", "w_down")


def whole_row_scales(
    weights: Mapping[str, torch.Tensor], method: str, num_layers: int
) -> dict[str, torch.Tensor]:
    """Each layer's column-split matrices' [rows] scales under ``method``, by weight name."""
    fmt = get_format(check_method(method))
    out: dict[str, torch.Tensor] = {}
    for n in range(num_layers):
        for m in COLUMN_SPLIT:
            name = f"layers.{n}.{m}"
            scales = fmt.row_scales(weights[name])
            assert scales is not None, f"{method} is a scaled format"
            out[name] = scales
    return out
