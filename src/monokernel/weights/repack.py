"""Load-time repacking of the weights into what the monokernel streams (pure PyTorch).

Done once per model, on any device, and tested on the CPU through the schedule interpreter
(``monokernel.kernels.schedule``), which runs the kernel's stages on these tensors:

* RMSNorm gains are folded into the matrix that follows the norm (attn_norm into Q/K/V,
  ffn_norm into gate/up, the final norm into the LM head), so the kernel only normalises.
  A tied LM head becomes a folded *copy*; the embedding table stays as it was.
* Q, K and V become one matrix (rows: q heads, then k heads, then v heads), and gate/up one
  matrix with rows interleaved (2r = gate r, 2r+1 = up r) so one warp produces silu(g)*u.
* Every streamed matrix (a layer's wqkv, wo, wgu, wdown; the LM head), logical [out, in],
  is then packed by the weight format (``weights/formats``): for bf16 the matrix itself,
  row-major with the input dimension contiguous. ``pack.wqkv`` etc. are the tensors the
  kernel streams, ``pack.matrices`` the packed matrices with their format.
* RoPE cos/sin tables come from ``monokernel.models.rope.rope_tables`` (llama3 scaling too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import torch

from monokernel.models.config import ModelConfig
from monokernel.models.rope import rope_tables
from monokernel.weights.checkpoint_quant import Fp8Blocks
from monokernel.weights.formats import DEFAULT_FORMAT, PackedMatrix, get_format
from monokernel.weights.formats.fp8 import Fp8Rows
from monokernel.weights.formats.tiles import tiles_for
from monokernel.weights.group_quant import GroupQuant
from monokernel.weights.group_quant import fuse_rows as gq_fuse_rows
from monokernel.weights.group_quant import interleave_rows as gq_interleave_rows
from monokernel.weights.names import Weights
from monokernel.weights.quantize import config_format, group_format, pack_quantized

MATRICES: tuple[str, ...] = ("wqkv", "wo", "wgu", "wdown")  # a layer's streamed matrices


def _streamed(name: str) -> property:
    """``pack.<name>``: the tensor the kernel streams for ``pack.matrices[name]`` (the backend
    puts its address in the kernel's weight table); assigning one moves that matrix's data."""

    def get(pack: LayerPack | Repacked) -> torch.Tensor:
        return pack.matrices[name].data

    def put(pack: LayerPack | Repacked, data: torch.Tensor) -> None:
        pack.matrices[name] = dataclasses.replace(pack.matrices[name], data=data)

    return property(get, put)


@dataclass(slots=True)
class LayerPack:
    # MATRICES -> packed (shapes logical, [out, in]): wqkv [q + 2*kv, h] attn_norm folded;
    # wo [h, q]; wgu [2*i, h] rows interleaved gate/up, ffn_norm folded; wdown [h, i].
    matrices: dict[str, PackedMatrix]
    bqkv: torch.Tensor | None  # [q + 2*kv] float32 (qkv_bias)
    q_norm: torch.Tensor | None  # [d] float32 (qk_norm)
    k_norm: torch.Tensor | None  # [d] float32 (qk_norm)
    bo: torch.Tensor | None  # [h] float32 (o_bias)
    attn_gain: torch.Tensor | None = None  # [h] float32, only when not folded
    ffn_gain: torch.Tensor | None = None  # [h] float32, only when not folded

    wqkv = _streamed("wqkv")
    wo = _streamed("wo")
    wgu = _streamed("wgu")
    wdown = _streamed("wdown")


@dataclass(slots=True)
class Repacked:
    layers: list[LayerPack]
    embed: torch.Tensor  # [V, h]   unfolded, the weights' dtype (a row gathered a token)
    matrices: dict[str, PackedMatrix]  # "lm_head" -> [V, h], final norm folded
    rope_cos: torch.Tensor  # [max_len, d/2] float32
    rope_sin: torch.Tensor  # [max_len, d/2] float32
    norm_gain: torch.Tensor | None = None  # [h] float32, only when not folded
    format: str = DEFAULT_FORMAT  # the layers' streamed matrices' (weights/formats)
    head_format: str = DEFAULT_FORMAT  # the LM head's

    lm_head = _streamed("lm_head")


def fold_gain(w: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """W @ (g * x) == (W * g) @ x: scale each input column, rounding once to w's dtype."""
    return (w.float() * gain.float()[None, :]).to(w.dtype).contiguous()


def fuse_rows(*mats: torch.Tensor) -> torch.Tensor:
    return torch.cat(mats, dim=0).contiguous()


def interleave_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[n, k], [n, k] -> [2n, k] with rows a0, b0, a1, b1, ..."""
    return torch.stack((a, b), dim=1).reshape(2 * a.shape[0], a.shape[1]).contiguous()


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float().contiguous()


def _pack_groups(
    groups: Mapping[str, GroupQuant], p: str, tiles: bool, device: torch.device
) -> dict[str, PackedMatrix]:
    """Layer ``p``'s matrices from the checkpoint's own groups, each in int4 or int8's grouped
    tiles as its width says (quantize.py group_format; a stage may differ from the others:
    GroupsPlan), fused as repack_layer fuses the dense ones, their bits unchanged (int4 in the
    tile layout if ``tiles``: tiles.py tiles_for), on ``device``."""

    def pack(gq: GroupQuant) -> PackedMatrix:
        return group_format(gq, tiles).pack_groups(gq.q, gq.scale, gq.offset)

    # Copied here, a layer at a time: the device never holds the whole model's groups
    # (1.3 bytes a weight unpacked) beside its packed matrices (a 32B Q4_K_M: 42 + 32 GB).
    names = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    g = {name: groups[p + name].to(device) for name in names}
    return {
        "wqkv": pack(gq_fuse_rows(g["wq"], g["wk"], g["wv"])),
        "wo": pack(g["wo"]),
        "wgu": pack(gq_interleave_rows(g["w_gate"], g["w_up"])),
        "wdown": pack(g["w_down"]),
    }


def _pack_fp8_blocks(w: Weights, blocks: Fp8Blocks, p: str) -> dict[str, PackedMatrix]:
    """Layer ``p``'s matrices in fp8 tiles with a checkpoint's block scales, fused as
    repack_layer fuses the others: each block's scale repeated over its rows, the rows fused
    or interleaved with their matrices', so every weight keeps its own block's scale and
    packing finds the checkpoint's E4M3 values again (weights/formats/fp8.py)."""
    fmt = Fp8Rows(tiles=True, block=blocks.cols)

    def s(name: str) -> torch.Tensor:
        return blocks.row_scales(p + name, w[p + name].shape[0])

    return {
        "wqkv": fmt.pack(
            fuse_rows(w[p + "wq"], w[p + "wk"], w[p + "wv"]), fuse_rows(s("wq"), s("wk"), s("wv"))
        ),
        "wo": fmt.pack(w[p + "wo"], s("wo")),
        "wgu": fmt.pack(
            interleave_rows(w[p + "w_gate"], w[p + "w_up"]), interleave_rows(s("w_gate"), s("w_up"))
        ),
        "wdown": fmt.pack(w[p + "w_down"], s("w_down")),
    }


def repack_layer(
    cfg: ModelConfig,
    w: Weights,
    n: int,
    fold: bool = True,
    fmt: str = DEFAULT_FORMAT,
    row_scales: Mapping[str, torch.Tensor] | None = None,
    groups: Mapping[str, GroupQuant] | None = None,
    fp8_blocks: Fp8Blocks | None = None,
    act_stats: Mapping[str, torch.Tensor] | None = None,
) -> LayerPack:
    p = f"layers.{n}."
    scales = row_scales or {}
    attn_g, ffn_g = w[p + "attn_norm"], w[p + "ffn_norm"]
    fold_or_keep = fold_gain if fold else (lambda m, _g: m)
    bqkv = None
    if cfg.qkv_bias:
        bqkv = torch.cat((w[p + "bq"], w[p + "bk"], w[p + "bv"])).float().contiguous()
    if groups is not None:
        if fold:
            raise ValueError("a checkpoint's own groups cannot take a folded norm gain")
        matrices = _pack_groups(
            groups,
            p,
            tiles_for("int4", cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size),
            attn_g.device,
        )
    elif fp8_blocks is not None:
        if fold:
            raise ValueError("a checkpoint's fp8 block scales cannot take a folded norm gain")
        matrices = _pack_fp8_blocks(w, fp8_blocks, p)
    else:
        if fold and act_stats is not None:
            raise ValueError("input statistics are the unfolded matrices': not with fold")
        layer_fmt = config_format(fmt, cfg)

        def pack(m: torch.Tensor, name: str) -> PackedMatrix:
            # A column block takes the whole rows' scales; int4, the statistics of the
            # matrix's input (a fused matrix's inputs are one: its first matrix's).
            if p + name in scales:
                return layer_fmt.pack(m, scales[p + name])
            return pack_quantized(layer_fmt, p + name, m, act_stats)

        matrices = {
            "wqkv": pack(
                fold_or_keep(fuse_rows(w[p + "wq"], w[p + "wk"], w[p + "wv"]), attn_g), "wq"
            ),
            "wo": pack(w[p + "wo"], "wo"),
            "wgu": pack(
                fold_or_keep(interleave_rows(w[p + "w_gate"], w[p + "w_up"]), ffn_g), "w_gate"
            ),
            "wdown": pack(w[p + "w_down"], "w_down"),
        }
    return LayerPack(
        matrices=matrices,
        bqkv=bqkv,
        q_norm=_f32(w.get(p + "q_norm")) if cfg.qk_norm else None,
        k_norm=_f32(w.get(p + "k_norm")) if cfg.qk_norm else None,
        bo=_f32(w.get(p + "bo")) if cfg.o_bias else None,
        attn_gain=None if fold else _f32(attn_g),
        ffn_gain=None if fold else _f32(ffn_g),
    )


def repack(
    cfg: ModelConfig,
    weights: Weights,
    max_len: int,
    fold: bool = True,
    fmt: str = DEFAULT_FORMAT,
    consume: bool = False,
    head_fmt: str = DEFAULT_FORMAT,
    row_scales: Mapping[str, torch.Tensor] | None = None,
    groups: Mapping[str, GroupQuant] | None = None,
    fp8_blocks: Fp8Blocks | None = None,
    act_stats: Mapping[str, torch.Tensor] | None = None,
) -> Repacked:
    """All of the kernel's tensors, on the device of ``weights``: the layers' streamed
    matrices packed in the weight format ``fmt`` (weights/formats), the LM head in
    ``head_fmt`` (it keeps the checkpoint's format under --quantize, as vLLM's does), the rest
    in the dtype of ``weights``.

    ``fold=False`` keeps the norm gains as fp32 vectors the kernel applies itself: the same
    bytes per token (a gain is h floats), without rounding W*g to the weights' dtype.
    ``row_scales``: the scales to pack the named matrices with (a rank's column blocks get
    the whole rows', weights/quantize.py whole_row_scales). ``groups``: a 4- or 8-bit
    checkpoint's own groups of each layer's seven matrices (Checkpoint.groups), packed in
    int4 or int8 groups with their bits unchanged instead of quantising ``weights``; needs
    ``fold=False``. They may lie on another device (the host): each layer's are copied to
    that of ``weights`` as it is packed. ``weights``' layer matrices are then never read
    (a GGUF's LazyWeights never makes them: weights/lazy_weights.py).
    ``fp8_blocks``: an FP8 checkpoint's block scales (Checkpoint.fp8_blocks), with which the
    layers pack in fp8 tiles as the checkpoint stored them; needs ``fold=False``.
    ``act_stats``: with ``fmt`` int4, each layer matrix's input statistics by weight name
    (runtime/calibration.py), which its groups' search is weighted by (quantize.py
    pack_quantized: the same as the other engines' fake_quantize); needs ``fold=False``.
    ``consume``: each layer's tensors are popped from ``weights`` once packed (and its
    groups from ``groups``, where that is a mutable mapping), so where the caller holds no
    other reference the repacking needs one layer's memory on top of the model, not a second
    copy (a 32B model's 65 GB fit an 80 GB GPU once, not twice).
    """
    embed = weights["embed"]
    head = embed if cfg.tie_word_embeddings else weights["lm_head"]
    cos, sin = rope_tables(cfg, max_len, embed.device)
    pack_head = get_format(head_fmt).pack
    layers = []
    for n in range(cfg.num_layers):
        layers.append(
            repack_layer(cfg, weights, n, fold, fmt, row_scales, groups, fp8_blocks, act_stats)
        )
        if consume:
            layer = f"layers.{n}."
            for name in [k for k in weights if k.startswith(layer)]:
                del weights[name]
            # Groups go as the weights do where the mapping is the caller's own to empty (a TP
            # rank's, on its GPU); where the caller keeps another reference, this frees nothing.
            if isinstance(groups, MutableMapping):
                for name in [k for k in groups if k.startswith(layer)]:
                    del groups[name]
    return Repacked(
        layers=layers,
        embed=embed.contiguous(),
        matrices={"lm_head": pack_head(fold_gain(head, weights["norm"]) if fold else head)},
        rope_cos=cos.contiguous(),
        rope_sin=sin.contiguous(),
        norm_gain=None if fold else _f32(weights["norm"]),
        format=fmt,
        head_format=head_fmt,
    )
