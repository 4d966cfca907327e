"""Tensor-parallel sharding of our weight dict (pure PyTorch): what rank r of N holds.

The split (Megatron-style) makes every layer need exactly two all-reduces of one [h] vector
and keeps everything else local:

* attention: rank r owns the contiguous query heads [r*nh/N, (r+1)*nh/N) and the KV heads
  they read, [r*nkv/N, (r+1)*nkv/N) (rows of wq / wk / wv and of bq / bk / bv). Its KV cache
  holds only those heads. q_norm / k_norm act on one head_dim vector each: replicated.
* O-proj: rank r holds Wo[:, its q columns] and produces a *partial* [h] output; the sum over
  ranks (all-reduce #1) is Wo @ attn. The o bias is replicated and added once, by every rank,
  after the reduction (not folded into one rank's partial), so every rank's partial is
  bias-free and the shards of all ranks have the same keys and shapes.
* MLP: gate/up rows [r*i/N, (r+1)*i/N) and the same columns of down; down gives a partial
  [h] output, summed over ranks (all-reduce #2). The MLP has no bias (refused by config).
* LM head: rows (vocabulary ids) [vocab_start, vocab_end) per rank, a balanced split that
  allows any vocab size >= N. Each rank finds its best (score, global id); the token is the
  max over ranks, ties to the lower id (the sampling rule's tie-break). A tied head is sliced
  from the embedding; the shard always has ``lm_head`` (the slice), even when tied.
* Replicated: the embedding (each rank gathers the token's row itself), every RMSNorm gain,
  the final norm, and the residual stream: after each all-reduce every rank holds the same
  full [h] vector, so norms need no communication.

GQA policy: N must divide num_key_value_heads (each rank holds whole KV heads; KV heads are
never replicated across ranks), which makes it divide num_attention_heads too. N must also
divide intermediate_size. ``valid_tp_sizes`` lists what a model accepts.

Row blocks are views of the input tensors (no copy); column blocks are contiguous copies.

Sharding runs on the checkpoint's dense matrices, before ``weights/repack.py``: each rank
packs its own shard in the weight format (``weights/formats``), so a format needs nothing
here. A 4- or 8-bit checkpoint's own groups split the same way (``shard_groups``), whole
groups only; the matrices a rank packs from them are left out of its dense shard
(``shard_weights``' ``packed``) and never read, so a GGUF's layer matrices, made dense only
when read (weights/lazy_weights.py), are never made for --tp either. (``WeightFormat.
slice_rows`` / ``slice_cols`` cut matrices that are already packed.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from monokernel.errors import UnsupportedModelError
from monokernel.models.config import ModelConfig
from monokernel.weights.checkpoint_quant import Fp8Blocks
from monokernel.weights.group_quant import GroupQuant
from monokernel.weights.names import Weights, check_weight_shapes, layer_shapes


class TensorParallelError(UnsupportedModelError, ValueError):
    """The model cannot be split over the asked number of ranks (or the rank is invalid)."""


@dataclass(frozen=True, slots=True)
class ShardConfig:
    """The per-rank dimensions of rank ``rank`` of ``tp``."""

    base: ModelConfig
    tp: int
    rank: int
    heads: int  # query heads on this rank
    kv_heads: int  # KV heads on this rank
    intermediate: int  # gate/up rows and down columns on this rank
    vocab_start: int  # first global token id of this rank's LM-head rows
    vocab_end: int  # one past the last

    @property
    def head_dim(self) -> int:
        return self.base.head_dim

    @property
    def hidden(self) -> int:
        return self.base.hidden_size

    @property
    def q_size(self) -> int:
        return self.heads * self.base.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.base.head_dim

    @property
    def vocab_local(self) -> int:
        return self.vocab_end - self.vocab_start

    def layer_config(self) -> ModelConfig:
        """A ModelConfig whose layer dims are this rank's: run through the reference forward's
        layer code it yields the rank's partial outputs. o_bias is off because the bias is
        added after the reduction; the vocabulary fields stay global (embedding replicated)."""
        return dataclasses.replace(
            self.base,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            intermediate_size=self.intermediate,
            o_bias=False,
        )


def valid_tp_sizes(cfg: ModelConfig) -> tuple[int, ...]:
    """Every N this model can be split over (see the GQA policy above)."""
    return tuple(
        n
        for n in range(1, cfg.num_kv_heads + 1)
        if cfg.num_kv_heads % n == 0
        and cfg.num_heads % n == 0
        and cfg.intermediate_size % n == 0
        and cfg.vocab_size >= n
    )


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Refuse, naming the numbers and the valid sizes, a split the model does not allow."""
    valid = ", ".join(str(n) for n in valid_tp_sizes(cfg))
    if not isinstance(tp, int) or tp < 1:
        raise TensorParallelError(f"tensor-parallel size must be an integer >= 1, got {tp!r}")
    problems = []
    if cfg.num_kv_heads % tp:
        problems.append(
            f"num_key_value_heads={cfg.num_kv_heads} (each rank must hold whole KV heads; "
            "KV heads are not replicated)"
        )
    if cfg.num_heads % tp:
        problems.append(f"num_attention_heads={cfg.num_heads}")
    if cfg.intermediate_size % tp:
        problems.append(f"intermediate_size={cfg.intermediate_size}")
    if cfg.vocab_size < tp:
        problems.append(f"vocab_size={cfg.vocab_size} (fewer ids than ranks)")
    if problems:
        raise TensorParallelError(
            f"tensor-parallel size {tp} does not divide {'; nor '.join(problems)}; "
            f"valid sizes for this model: {valid}"
        )


def vocab_range(vocab_size: int, rank: int, tp: int) -> tuple[int, int]:
    """Balanced contiguous split: sizes differ by at most one id, lower ranks smaller."""
    return rank * vocab_size // tp, (rank + 1) * vocab_size // tp


def shard_config(cfg: ModelConfig, rank: int, tp: int) -> ShardConfig:
    check_tp(cfg, tp)
    if not isinstance(rank, int) or not 0 <= rank < tp:
        raise TensorParallelError(f"rank must be in [0, {tp}), got {rank!r}")
    start, end = vocab_range(cfg.vocab_size, rank, tp)
    return ShardConfig(
        base=cfg,
        tp=tp,
        rank=rank,
        heads=cfg.num_heads // tp,
        kv_heads=cfg.num_kv_heads // tp,
        intermediate=cfg.intermediate_size // tp,
        vocab_start=start,
        vocab_end=end,
    )


def expected_shard_shapes(sc: ShardConfig) -> dict[str, tuple[int, ...]]:
    cfg = sc.base
    shapes: dict[str, tuple[int, ...]] = {
        "embed": (cfg.vocab_size, sc.hidden),
        "norm": (sc.hidden,),
        "lm_head": (sc.vocab_local, sc.hidden),
    }
    for n in range(cfg.num_layers):
        shapes |= layer_shapes(cfg, n, sc.q_size, sc.kv_size, sc.intermediate, sc.head_dim)
    return shapes


def _rows(t: torch.Tensor, start: int, size: int) -> torch.Tensor:
    return t[start : start + size]


def _cols(t: torch.Tensor, start: int, size: int) -> torch.Tensor:
    return t[:, start : start + size].contiguous()


# A tensor's block on one rank: (first, count) of its rows, then of its columns; None: all.
_Block = tuple[tuple[int, int] | None, tuple[int, int] | None]


def _layer_blocks(sc: ShardConfig) -> dict[str, _Block]:
    """Each per-layer name's block on rank ``sc.rank``, in the shard's order."""
    q = (sc.rank * sc.q_size, sc.q_size)
    kv = (sc.rank * sc.kv_size, sc.kv_size)
    i = (sc.rank * sc.intermediate, sc.intermediate)
    blocks: dict[str, _Block] = {
        "attn_norm": (None, None),
        "wq": (q, None),
        "wk": (kv, None),
        "wv": (kv, None),
        "wo": (None, q),
        "ffn_norm": (None, None),
        "w_gate": (i, None),
        "w_up": (i, None),
        "w_down": (None, i),
    }
    cfg = sc.base
    if cfg.qkv_bias:
        blocks |= {"bq": (q, None), "bk": (kv, None), "bv": (kv, None)}
    if cfg.o_bias:
        blocks["bo"] = (None, None)
    if cfg.qk_norm:
        blocks |= {"q_norm": (None, None), "k_norm": (None, None)}
    return blocks


def _shard_layer(
    w: Mapping[str, torch.Tensor], sc: ShardConfig, n: int, packed: Collection[str]
) -> Weights:
    p = f"layers.{n}."
    out: Weights = {}
    for short, (rows, cols) in _layer_blocks(sc).items():
        name = p + short
        if name in packed:
            continue  # read here, a GGUF's LazyWeights would make the whole matrix dense
        t = w[name]
        if rows is not None:
            t = _rows(t, *rows)
        if cols is not None:
            t = _cols(t, *cols)
        out[name] = t
    return out


def shard_weights(
    cfg: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    rank: int,
    tp: int,
    packed: Collection[str] = (),
) -> Weights:
    """Rank ``rank``'s tensors (see the module docstring), on the device of ``weights``.
    ``packed``: the layer matrices the rank packs from their groups (``shard_groups``), left
    out of the shard and never read; the names and shapes of all are checked all the same."""
    sc = shard_config(cfg, rank, tp)
    check_weight_shapes(weights, cfg)
    head = weights["embed"] if cfg.tie_word_embeddings else weights["lm_head"]
    out: Weights = {
        "embed": weights["embed"],
        "norm": weights["norm"],
        "lm_head": head[sc.vocab_start : sc.vocab_end],
    }
    for n in range(cfg.num_layers):
        out |= _shard_layer(weights, sc, n, packed)
    return out


def shard_groups(
    cfg: ModelConfig, groups: Mapping[str, GroupQuant], rank: int, tp: int
) -> dict[str, GroupQuant]:
    """Rank ``rank``'s blocks of a 4-bit model's seven matrices a layer, split as
    ``shard_weights`` splits the dense ones (their bits unchanged). TensorParallelError where
    a column block would cut a group (check_tp_groups says so before anything is read)."""
    sc = shard_config(cfg, rank, tp)
    check_tp_groups(cfg, tp, next(iter(groups.values())).group)
    q0, kv0, i0 = rank * sc.q_size, rank * sc.kv_size, rank * sc.intermediate
    out: dict[str, GroupQuant] = {}
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        out |= {
            p + "wq": groups[p + "wq"].row_block(q0, sc.q_size),
            p + "wk": groups[p + "wk"].row_block(kv0, sc.kv_size),
            p + "wv": groups[p + "wv"].row_block(kv0, sc.kv_size),
            p + "wo": groups[p + "wo"].col_block(q0, sc.q_size),
            p + "w_gate": groups[p + "w_gate"].row_block(i0, sc.intermediate),
            p + "w_up": groups[p + "w_up"].row_block(i0, sc.intermediate),
            p + "w_down": groups[p + "w_down"].col_block(i0, sc.intermediate),
        }
    return out


def shard_fp8_blocks(cfg: ModelConfig, blocks: Fp8Blocks, rank: int, tp: int) -> Fp8Blocks:
    """Rank ``rank``'s scales of an FP8 checkpoint's block-scaled layer matrices, split as
    ``shard_weights`` splits the matrices: each block's scale repeated over its rows (so a
    rank's rows need not start on a block), the O and down projections' column blocks whole
    blocks (check_tp_groups with the block's columns says so first). One row a block."""
    sc = shard_config(cfg, rank, tp)
    check_tp_groups(cfg, tp, blocks.cols, "FP8 block scales")
    q0, kv0, i0 = rank * sc.q_size, rank * sc.kv_size, rank * sc.intermediate
    bn = blocks.cols
    rows = {"wq": (q0, sc.q_size), "wk": (kv0, sc.kv_size), "wv": (kv0, sc.kv_size)}
    rows |= {"w_gate": (i0, sc.intermediate), "w_up": (i0, sc.intermediate)}
    cols = {"wo": (q0, sc.q_size), "w_down": (i0, sc.intermediate)}
    out: dict[str, torch.Tensor] = {}
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        for name, (start, size) in rows.items():
            full = blocks.row_scales(p + name, start + size)
            out[p + name] = full[start : start + size].contiguous()
        for name, (start, size) in cols.items():  # both project onto the hidden size
            full = blocks.row_scales(p + name, cfg.hidden_size)
            out[p + name] = full[:, start // bn : (start + size) // bn].contiguous()
    return Fp8Blocks(1, bn, out)


def tp_blocks_stream(cfg: ModelConfig, tp: int, blocks: Fp8Blocks) -> bool:
    """Whether each of ``tp`` ranks streams its blocks of an FP8 checkpoint's block-scaled
    matrices as they are: quantize.blocks_stream on a rank's sizes (its layers stream as fp8
    tiles, and its inputs, the O and down projections' column blocks among them, are whole
    blocks)."""
    from monokernel.weights.quantize import blocks_stream

    return blocks_stream(rank_config(shard_config(cfg, 0, tp)), blocks)


def check_tp_groups(cfg: ModelConfig, tp: int, group: int, what: str = "4-bit groups") -> None:
    """4-bit groups (or FP8 block scales) of ``group`` columns split over ``tp`` ranks only
    whole: each rank's columns of the O and down projections (q_size / tp, intermediate /
    tp) must be whole groups."""
    sc = shard_config(cfg, 0, tp)
    blocks = (("q heads x head_dim / tp", sc.q_size), ("intermediate / tp", sc.intermediate))
    cut = [f"{name} {cols}" for name, cols in blocks if cols % group]
    if cut:
        raise TensorParallelError(
            f"{what} of {group} columns cannot split over --tp {tp}: a rank's "
            f"{', '.join(cut)} is not a multiple of {group}"
        )


def rank_config(sc: ShardConfig) -> ModelConfig:
    """The ModelConfig one rank's kernel is built and repacked for: the rank's heads, KV
    heads, intermediate rows and vocabulary rows. The o-bias stays on (the kernel adds it once
    after the reduction), and the LM head is the shard's own slice (never tied)."""
    return dataclasses.replace(
        sc.base,
        num_heads=sc.heads,
        num_kv_heads=sc.kv_heads,
        intermediate_size=sc.intermediate,
        vocab_size=sc.vocab_local,
        tie_word_embeddings=False,
    )
