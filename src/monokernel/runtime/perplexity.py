"""Perplexity of a model on a fixed text kept in the package, with the reference forward.

It exists to put a number on what a change to the weights costs (``--quantize fp8|int8|int4``
against the checkpoint as loaded): the reference (``models/transformer.py``) computes in the
weights' own dtype with no kernel of ours in the way, so two runs differ only by their
weights. The text (``workloads/texts/perplexity.txt``, about 10k tokens for a SmolLM2-style
BPE) was written for this repository and mixes what a coding agent reads: design prose,
Python and shell listings, a README, a changelog and plain narrative. It is not taken from
a public corpus, so a model's score on it is not flattered by having memorised it.

The text is cut into consecutive, non-overlapping windows of ``window`` tokens, each scored
from an empty cache: its first token is context only, and each later token is scored given
the ones before it in the same window. Non-overlapping windows undercount the context a
long-context model could use (a sliding window would score every token with a full window
behind it), but they cost one forward per token instead of ``window``, and a comparison
between two weight sets only needs the same protocol on both sides.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Protocol

import torch
import torch.nn.functional as F

from monokernel.models.config import ModelConfig
from monokernel.models.transformer import PREFILL_CHUNK, Transformer

DEFAULT_WINDOW = 1024
# Where the text lives: workloads/texts/ in the package (pyproject's package-data ships it).
TEXT_PACKAGE = "monokernel.workloads"
TEXT_PARTS: tuple[str, ...] = ("texts", "perplexity.txt")


@dataclass(frozen=True, slots=True)
class Perplexity:
    tokens: int  # tokens scored: every window of n tokens scores n - 1
    nll: float  # mean negative log-likelihood per scored token, in nats
    ppl: float  # exp(nll)


class TextEncoder(Protocol):
    """What ``text_ids`` needs of a tokenizer (``tokenizer.Tokenizer`` is one)."""

    def encode(self, text: str) -> list[int]: ...


def read_text(parts: Sequence[str] = TEXT_PARTS) -> str:
    """The packaged text (or another under ``TEXT_PACKAGE``: ``parts`` its path there), as
    written."""
    node = resources.files(TEXT_PACKAGE)
    for part in parts:
        node = node / part
    return node.read_text(encoding="utf-8")


def text_ids(tokenizer: TextEncoder, max_tokens: int | None = None) -> list[int]:
    """The packaged text's token ids (special tokens as the model's tokenizer adds them by
    default), the first ``max_tokens`` of them when given."""
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1; got {max_tokens}")
    ids = list(tokenizer.encode(read_text()))
    return ids if max_tokens is None else ids[:max_tokens]


def _window_nll_sum(model: Transformer, tokens: torch.Tensor) -> float:
    """Sum of -log p(token i | tokens before i) over i = 1..n-1 of one window, from an empty
    cache. Forwards of at most PREFILL_CHUNK tokens, as the reference's prefill does: one
    forward over a long window would hold attention scores [heads, n, n]."""
    n = tokens.shape[0]
    cache = model.new_cache(n)
    total = 0.0
    for a in range(0, n, PREFILL_CHUNK):
        b = min(a + PREFILL_CHUNK, n)
        logits = model.forward(tokens[a:b], a, cache)  # [b - a, V]: predicts a+1 .. b
        # The window's last position predicts a token outside it: not scored.
        scored = min(b, n - 1) - a
        if scored <= 0:
            continue
        logp = F.log_softmax(logits[:scored].float(), dim=-1)
        targets = tokens[a + 1 : a + 1 + scored]
        # float64 accumulation: tens of thousands of terms in float32 drift in the 6th digit.
        total -= logp.gather(1, targets[:, None]).double().sum().item()
    return total


def check_windows(ids: Sequence[int], window: int) -> None:
    """ValueError for a window or a text too short to score anything."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens (one of context); got {window}")
    if len(ids) < 2:
        raise ValueError(f"perplexity needs at least 2 tokens; got {len(ids)}")


def score_windows(model: Transformer, ids: Sequence[int], window: int) -> Perplexity:
    """``ids`` scored by ``model`` (a Transformer, or what answers its ``new_cache`` and
    ``forward``) in consecutive windows of ``window`` tokens, the last one shorter, each
    from an empty cache."""
    all_ids = torch.tensor(list(ids), dtype=torch.long, device=getattr(model, "device", None))
    total, scored = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids), window):
            tokens = all_ids[start : start + window]
            # A trailing window of one token has nothing to score.
            if tokens.shape[0] < 2:
                continue
            total += _window_nll_sum(model, tokens)
            scored += tokens.shape[0] - 1
    nll = total / scored
    return Perplexity(tokens=scored, nll=nll, ppl=math.exp(nll))


def perplexity(
    cfg: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    ids: Sequence[int],
    window: int = DEFAULT_WINDOW,
    device: torch.device | str | None = None,
) -> Perplexity:
    """Score ``ids`` in consecutive windows of ``window`` tokens (the last one shorter), each
    from an empty cache, with the reference forward on ``weights`` as they are (their dtype;
    moved to ``device`` when given, else where they lie). Deterministic for given weights
    and ids: nothing is kept between calls or between windows."""
    check_windows(ids, window)
    if device is not None:
        weights = {name: t.to(device) for name, t in weights.items()}
    model = Transformer(cfg, dict(weights), min(window, len(ids)))
    return score_windows(model, ids, window)
