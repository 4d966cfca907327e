"""Weights the GPU tests decode greedily: ``peaked`` gives the LM head heavy-tailed row norms,
so the logits have a clear argmax at almost every step and kernels with different summation
orders agree token for token with the float32 reference (models/transformer.py, read through
its ``Float32View``).
"""

from __future__ import annotations

import torch

from monokernel.models.config import ModelConfig
from monokernel.weights.names import Weights


def peaked(cfg: ModelConfig, weights: Weights, seed: int = 0) -> Weights:
    """``weights`` with the LM head's rows (the embedding's when tied) scaled by
    exp(1.5 N(0, 1)); changed in place and returned."""
    name = "embed" if cfg.tie_word_embeddings else "lm_head"
    head = weights[name]
    gen = torch.Generator(device=head.device).manual_seed(seed)
    scale = torch.exp(1.5 * torch.randn(cfg.vocab_size, 1, generator=gen, device=head.device))
    weights[name] = (head.float() * scale).to(head.dtype)
    return weights


def assert_greedy_matches(
    cfg: ModelConfig, weights: Weights, prompt: list[int], got: list[int], label: str
) -> None:
    """``got``, greedy tokens decoded after ``prompt``, are the float32 reference's argmax.

    The reference is teacher-forced on ``got``, so one near tie cannot derail the steps
    after it; a step where the argmaxes differ passes only if the reference's gap there is
    within rounding (2% of the logits' spread, ~4x the kernel's logit error), and such
    steps must stay rare (at most 1 in 50)."""
    from monokernel.models.transformer import Float32View, Transformer

    n, steps = len(prompt), len(got)
    ref = Transformer(cfg, Float32View(weights), n + steps)
    seq = torch.tensor(prompt + got, device=weights["embed"].device)
    logits = ref.forward(seq[:-1], 0, ref.new_cache(n + steps))[n - 1 :]  # [steps, V]
    chosen = logits.gather(1, seq[n:, None])[:, 0]
    gap = logits.max(dim=-1).values - chosen  # 0 where the kernel chose the argmax
    differ = (logits.argmax(dim=-1) != seq[n:]).nonzero().flatten().tolist()
    print(f"greedy ({label}): {steps - len(differ)}/{steps} steps identical; near ties {differ}")
    assert bool((gap <= 0.02 * logits.std(dim=-1)).all()), f"far from the argmax at {differ}"
    assert len(differ) <= steps // 50
