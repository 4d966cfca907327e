"""Named real model shapes and random weights in them, for benchmarks and GPU tests."""

from __future__ import annotations

import torch

from monokernel.models.config import ModelConfig, RopeScaling
from monokernel.weights.names import Weights, expected_shapes

SHAPES: dict[str, ModelConfig] = {
    "llama-3.2-1b": ModelConfig(
        family="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192),
    ),
    "qwen2.5-coder-1.5b": ModelConfig(
        family="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        qkv_bias=True,
    ),
    "qwen3-0.6b": ModelConfig(
        family="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        qk_norm=True,
    ),
    "smollm2-135m": ModelConfig(
        family="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    # Every optional feature at once, in sizes no power of two divides: catches indexing
    # that only works for the common shapes.
    "odd": ModelConfig(
        family="qwen3",
        vocab_size=1003,
        hidden_size=520,
        intermediate_size=1400,
        num_layers=3,
        num_heads=5,
        num_kv_heads=1,
        head_dim=104,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        qkv_bias=True,
        o_bias=True,
        qk_norm=True,
    ),
}


def random_weights(
    cfg: ModelConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    logit_scale: float = 1.0,
) -> Weights:
    """Weights in ``cfg``'s shapes: matrices ~ N(0, 1/fan_in), gains ~ 1 + N(0, 0.1^2).

    ``logit_scale`` multiplies the LM head (and the embedding when tied): large values spread
    the logits so that greedy decoding has no near ties.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    out: Weights = {}
    for name, shape in expected_shapes(cfg).items():
        short = name.rsplit(".", 1)[-1]
        if len(shape) == 1 and short in ("attn_norm", "ffn_norm", "norm", "q_norm", "k_norm"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
        elif len(shape) == 1:  # biases
            t = 0.1 * torch.randn(shape, generator=gen, device=device)
        elif short == "embed":
            t = torch.randn(shape, generator=gen, device=device)
            if cfg.tie_word_embeddings:
                t = t * (logit_scale / shape[1] ** 0.5)
        else:
            t = torch.randn(shape, generator=gen, device=device) / shape[1] ** 0.5
            if short == "lm_head":
                t = t * logit_scale
        out[name] = t.to(dtype)
    return out
