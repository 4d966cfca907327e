"""Load-time repacking of the weights into what the monokernel streams (pure PyTorch).

Done once per model, on any device, and tested on the CPU through the schedule interpreter
(``monokernel.kernels.schedule``), which runs the kernel's stages on these tensors:

* RMSNorm gains are folded into the matrix that follows the norm (attn_norm into Q/K/V,
  ffn_norm into gate/up, the final norm into the LM head), so the kernel only normalises.
  A tied LM head becomes a folded *copy*; the embedding table stays as it was.
* Q, K and V become one matrix (rows: q heads, then k heads, then v heads), and gate/up one
  matrix with rows interleaved (2r = gate r, 2r+1 = up r) so one warp produces silu(g)*u.
* Every matrix stays row-major [out, in] with the input dimension contiguous: the kernel
  gives each warp whole rows and streams a row with 16-byte loads, lanes side by side.
* RoPE cos/sin tables come from ``monokernel.models.rope.rope_tables`` (llama3 scaling too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from monokernel.models.config import ModelConfig
from monokernel.models.rope import rope_tables
from monokernel.weights.names import Weights


@dataclass(slots=True)
class LayerPack:
    wqkv: torch.Tensor  # [q + 2*kv, h]   attn_norm folded
    bqkv: torch.Tensor | None  # [q + 2*kv] float32 (qkv_bias)
    q_norm: torch.Tensor | None  # [d] float32 (qk_norm)
    k_norm: torch.Tensor | None  # [d] float32 (qk_norm)
    wo: torch.Tensor  # [h, q]
    bo: torch.Tensor | None  # [h] float32 (o_bias)
    wgu: torch.Tensor  # [2*i, h]  rows interleaved gate/up, ffn_norm folded
    wdown: torch.Tensor  # [h, i]
    attn_gain: torch.Tensor | None = None  # [h] float32, only when not folded
    ffn_gain: torch.Tensor | None = None  # [h] float32, only when not folded


@dataclass(slots=True)
class Repacked:
    layers: list[LayerPack]
    embed: torch.Tensor  # [V, h]   unfolded
    lm_head: torch.Tensor  # [V, h]   final norm folded
    rope_cos: torch.Tensor  # [max_len, d/2] float32
    rope_sin: torch.Tensor  # [max_len, d/2] float32
    norm_gain: torch.Tensor | None = None  # [h] float32, only when not folded


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


def repack_layer(cfg: ModelConfig, w: Weights, n: int, fold: bool = True) -> LayerPack:
    p = f"layers.{n}."
    attn_g, ffn_g = w[p + "attn_norm"], w[p + "ffn_norm"]
    fold_or_keep = fold_gain if fold else (lambda m, _g: m.contiguous())
    bqkv = None
    if cfg.qkv_bias:
        bqkv = torch.cat((w[p + "bq"], w[p + "bk"], w[p + "bv"])).float().contiguous()
    return LayerPack(
        wqkv=fold_or_keep(fuse_rows(w[p + "wq"], w[p + "wk"], w[p + "wv"]), attn_g),
        bqkv=bqkv,
        q_norm=_f32(w.get(p + "q_norm")) if cfg.qk_norm else None,
        k_norm=_f32(w.get(p + "k_norm")) if cfg.qk_norm else None,
        wo=w[p + "wo"].contiguous(),
        bo=_f32(w.get(p + "bo")) if cfg.o_bias else None,
        wgu=fold_or_keep(interleave_rows(w[p + "w_gate"], w[p + "w_up"]), ffn_g),
        wdown=w[p + "w_down"].contiguous(),
        attn_gain=None if fold else _f32(attn_g),
        ffn_gain=None if fold else _f32(ffn_g),
    )


def repack(cfg: ModelConfig, weights: Weights, max_len: int, fold: bool = True) -> Repacked:
    """All of the kernel's tensors, on the device and in the dtype of ``weights``.

    ``fold=False`` keeps the norm gains as fp32 vectors the kernel applies itself: the same
    bytes per token (a gain is h floats), without rounding W*g to the weights' dtype.
    """
    embed = weights["embed"]
    head = embed if cfg.tie_word_embeddings else weights["lm_head"]
    cos, sin = rope_tables(cfg, max_len, embed.device)
    return Repacked(
        layers=[repack_layer(cfg, weights, n, fold) for n in range(cfg.num_layers)],
        embed=embed.contiguous(),
        lm_head=fold_gain(head, weights["norm"]) if fold else head.contiguous(),
        rope_cos=cos.contiguous(),
        rope_sin=sin.contiguous(),
        norm_gain=None if fold else _f32(weights["norm"]),
    )
