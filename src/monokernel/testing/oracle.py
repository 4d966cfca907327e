"""Weights the GPU tests decode greedily: ``peaked`` gives the LM head heavy-tailed row norms,
so the logits have a clear argmax at almost every step and kernels with different summation
orders agree token for token with the float32 reference (models/transformer.py, read through
its ``Float32View``).
"""

from __future__ import annotations

from collections.abc import Mapping

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


def assert_logits_match(
    cfg: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    seq: list[int],
    prompt_n: int,
    got: torch.Tensor,
    label: str,
    tolerance: float = 1e-2,
) -> None:
    """``got`` [steps, V], logits teacher-forced on ``seq`` after its first ``prompt_n``
    tokens, are the float32 reference's on ``weights`` (read through ``Float32View``, or a
    view of one's own such as weights.quantize.DequantizedView): relative L2 at most
    ``tolerance`` at every step."""
    from monokernel.models.transformer import Float32View, Transformer

    n = len(seq)
    ref = Transformer(cfg, Float32View(weights), n)
    tokens = torch.tensor(seq, device=got.device)
    want = ref.forward(tokens, 0, ref.new_cache(n))[prompt_n - 1 : -1]  # [steps, V]
    assert got.shape == want.shape, f"{label}: logits {tuple(got.shape)}, want {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{label}: unwritten or non-finite logits"
    rel = (got - want).norm(dim=-1) / want.norm(dim=-1)  # [steps]
    print(f"{label}: rel L2 max {rel.max():.2e} mean {rel.mean():.2e}")
    worst = int(rel.argmax())
    assert float(rel.max()) <= tolerance, f"{label}, step {worst}: rel L2 {float(rel[worst]):.3e}"
