"""Random weights in a model's real shapes, for benchmarks and GPU tests: the speed of a
batch-1 decode depends on the shapes only, and its correctness is checked against the
reference on the same weights."""

from __future__ import annotations

import torch

from monokernel.models.config import ModelConfig
from monokernel.weights.names import Weights, expected_shapes


def random_weights(
    cfg: ModelConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    logit_scale: float = 1.0,
    store: torch.device | str | None = None,
) -> Weights:
    """Weights in ``cfg``'s shapes: matrices ~ N(0, 1/fan_in), gains ~ 1 + N(0, 0.1^2).

    ``logit_scale`` multiplies the LM head (and the embedding when tied): large values spread
    the logits so that greedy decoding has no near ties. ``store``: where each tensor is
    kept once drawn on ``device`` (the host, for a model larger than one GPU: drawn on the
    GPU, it takes seconds instead of minutes); by default ``device``.
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
        out[name] = t.to(dtype) if store is None else t.to(device=store, dtype=dtype)
    return out
