"""Our tensor names, their shapes, and the one table that maps HF names onto them.

Every loader (safetensors, GGUF) produces a flat ``dict[str, Tensor]`` in *our* names, in
the HF ``nn.Linear`` convention ``[out_features, in_features]``; ``check_weights`` then
fails loudly on a missing, misshaped or unused tensor.

Our names, with shapes (h = hidden, q = heads*head_dim, kv = kv_heads*head_dim,
i = intermediate, V = vocab, d = head_dim):

    embed                 [V, h]
    layers.{n}.attn_norm  [h]
    layers.{n}.wq         [q, h]      layers.{n}.bq  [q]    (qkv_bias)
    layers.{n}.wk         [kv, h]     layers.{n}.bk  [kv]   (qkv_bias)
    layers.{n}.wv         [kv, h]     layers.{n}.bv  [kv]   (qkv_bias)
    layers.{n}.q_norm     [d]         layers.{n}.k_norm [d] (qk_norm)
    layers.{n}.wo         [h, q]      layers.{n}.bo  [h]    (o_bias)
    layers.{n}.ffn_norm   [h]
    layers.{n}.w_gate     [i, h]
    layers.{n}.w_up       [i, h]
    layers.{n}.w_down     [h, i]
    norm                  [h]
    lm_head               [V, h]      (absent when tie_word_embeddings)
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping
from typing import TypeVar

import torch

from monokernel.errors import MissingTensorError, TensorShapeError, UnexpectedTensorError
from monokernel.models.config import ModelConfig
from monokernel.models.transformer import Weights as Weights  # what the loaders import
from monokernel.weights.lazy_weights import LazyWeights

# check_weights hands back the mapping it was given, a dict or a LazyWeights alike.
W = TypeVar("W", bound=MutableMapping[str, torch.Tensor])

# HF per-layer suffix -> our per-layer name.
HF_LAYER_NAMES: dict[str, str] = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "self_attn.o_proj.weight": "wo",
    "self_attn.o_proj.bias": "bo",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
HF_GLOBAL_NAMES: dict[str, str] = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head",
}
# Buffers some checkpoints carry that are recomputed, never read.
HF_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def hf_to_ours(hf_name: str) -> str | None:
    """Our name for an HF tensor name; None for a name no table knows."""
    if hf_name in HF_GLOBAL_NAMES:
        return HF_GLOBAL_NAMES[hf_name]
    m = _HF_LAYER.match(hf_name)
    if m and m.group(2) in HF_LAYER_NAMES:
        return f"layers.{m.group(1)}.{HF_LAYER_NAMES[m.group(2)]}"
    return None


def ours_to_hf(name: str) -> str:
    for hf, ours in HF_GLOBAL_NAMES.items():
        if ours == name:
            return hf
    _, layer, short = name.split(".", 2)
    for hf, ours in HF_LAYER_NAMES.items():
        if ours == short:
            return f"model.layers.{layer}.{hf}"
    raise KeyError(name)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, v = cfg.hidden_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embed": (v, h), "norm": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (v, h)
    for n in range(cfg.num_layers):
        shapes |= layer_shapes(cfg, n, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.head_dim)
    return shapes


def layer_shapes(
    cfg: ModelConfig, n: int, q: int, kv: int, i: int, d: int
) -> dict[str, tuple[int, ...]]:
    """Layer n's tensors and their shapes with q / kv query and key-value widths, i MLP
    rows and head size d (the whole model's, or a tensor-parallel rank's share of q, kv and
    i; the norms and the O bias stay the hidden size's, added after the reduction)."""
    h, p = cfg.hidden_size, f"layers.{n}."
    shapes: dict[str, tuple[int, ...]] = {
        p + "attn_norm": (h,),
        p + "wq": (q, h),
        p + "wk": (kv, h),
        p + "wv": (kv, h),
        p + "wo": (h, q),
        p + "ffn_norm": (h,),
        p + "w_gate": (i, h),
        p + "w_up": (i, h),
        p + "w_down": (h, i),
    }
    if cfg.qkv_bias:
        shapes |= {p + "bq": (q,), p + "bk": (kv,), p + "bv": (kv,)}
    if cfg.o_bias:
        shapes[p + "bo"] = (h,)
    if cfg.qk_norm:
        shapes |= {p + "q_norm": (d,), p + "k_norm": (d,)}
    return shapes


def weight_shape(weights: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """``weights[name].shape``, without making a LazyWeights' unread matrix."""
    if isinstance(weights, LazyWeights):
        return tuple(weights.shape(name))
    return tuple(weights[name].shape)


def check_weight_shapes(
    weights: Mapping[str, torch.Tensor], cfg: ModelConfig, source: str = "checkpoint"
) -> None:
    """``check_weights``' checks, ``weights`` left as it is. Only a tied ``lm_head`` and the
    embedding are read (compared); the shapes of the rest come from the mapping, so a GGUF's
    unread layer matrices stay unread (weights/lazy_weights.py)."""
    names = set(weights)
    if cfg.tie_word_embeddings and "lm_head" in names:
        names.discard("lm_head")
        if "embed" in names and not torch.equal(weights["lm_head"], weights["embed"]):
            raise UnexpectedTensorError(
                f"{source}: lm_head differs from embed but the config ties them "
                "(tie_word_embeddings=true)"
            )
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - names)
    if missing:
        raise MissingTensorError(
            f"{source}: missing tensor(s) {', '.join(missing[:8])}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        )
    unused = sorted(names - set(expected))
    if unused:
        raise UnexpectedTensorError(
            f"{source}: tensor(s) the model does not use: {', '.join(unused[:8])}"
        )
    for name, shape in expected.items():
        got = weight_shape(weights, name)
        if got != shape:
            raise TensorShapeError(f"{source}: tensor {name} has shape {got}, expected {shape}")


def check_weights(weights: W, cfg: ModelConfig, source: str = "checkpoint") -> W:
    """Validate names and shapes; drop a tied ``lm_head`` only if it equals ``embed``."""
    check_weight_shapes(weights, cfg, source)
    if cfg.tie_word_embeddings:
        weights.pop("lm_head", None)
    return weights
