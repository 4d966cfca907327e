"""Perplexity of the CPU's packed decode step (backends/cpu_packed.py) on the packaged text.

The same windows and scoring as ``perplexity.perplexity``, but every position's logits come
from the packed step (4/8-bit matrices, bf16 into the kernels) instead of the float32
reference, so the two numbers put a figure on what the CPU path costs (issue 40: 21.1349
against the reference's 21.1369 on the default model). A forward of several tokens through
the packed step equals as many single steps bitwise, so this scores what decoding computes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from monokernel.models.config import ModelConfig
from monokernel.models.transformer import KVCache, Transformer
from monokernel.runtime.backends.cpu_packed import PackedCpuStep
from monokernel.runtime.perplexity import (
    DEFAULT_WINDOW,
    Perplexity,
    check_windows,
    score_windows,
)


class _PackedModel:
    """What ``score_windows`` reads of a Transformer, answered by the packed step: one
    cache of ``window`` positions, rewritten from position 0 by every window."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], window: int) -> None:
        ref = Transformer(cfg, weights, window)
        self.cache = ref.new_cache(window)
        self.step = PackedCpuStep(ref, self.cache)

    def new_cache(self, n: int) -> KVCache:
        return self.cache

    def forward(self, tokens: torch.Tensor, start: int, cache: KVCache) -> torch.Tensor:
        return self.step.forward_tokens(tokens, start)


def packed_perplexity(
    cfg: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    ids: Sequence[int],
    window: int = DEFAULT_WINDOW,
) -> Perplexity:
    """``perplexity.perplexity`` of ``ids`` with the packed CPU step (weights on the CPU)."""
    check_windows(ids, window)
    window = min(window, len(ids))
    model = _PackedModel(cfg, {k: v.float() for k, v in weights.items()}, window)
    return score_windows(model, ids, window)  # type: ignore[arg-type]
