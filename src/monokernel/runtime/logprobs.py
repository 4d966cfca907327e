"""Log-probabilities of the generated tokens (OpenAI's ``logprobs`` / ``top_logprobs``).

Of the model's own distribution: ``log_softmax`` of the raw logits at each step, before the
temperature, penalties or a grammar's mask shape the draw (vLLM's default, "raw
logprobs"), so a token's figure says what the model thought of it whatever the sampling
settings. The engines that sample on the host (torch, reference) compute them from the
logits they already hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One generated token's log-probability and the ``n`` most likely ids' (largest first,
    ties to the lower id), as (id, logprob) pairs."""

    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, token: int, n: int) -> TokenLogprobs:
    """``token``'s log-probability under ``logits`` [V] (any float dtype, computed in
    float32) and the ``n`` most likely ids'."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if n > 0:
        values, ids = torch.topk(lp, min(n, lp.numel()))
        pairs = zip(ids.tolist(), values.tolist(), strict=True)
        top = tuple(sorted(pairs, key=lambda p: (-p[1], p[0])))
    return TokenLogprobs(float(lp[token]), top)
