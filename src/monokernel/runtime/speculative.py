"""Speculative decoding drafted from the request's own tokens (n-gram / prompt lookup).

Coding agents re-emit much of their context: a file with one function changed, a path, a
test name. So the draft for the next tokens is what followed the latest earlier occurrence
of the text's current suffix (the longest n-gram that has one, ``ngram_max`` down to
``ngram_min`` tokens), up to ``num_tokens`` tokens; no draft model. The host drafts from an
index it updates as tokens arrive (a dict per n-gram length: O(ngram_max) work a token).

Verification: one forward pass over [last token, draft...] gives the logits of every drafted
position at once; each position's token is then drawn with the engine's own rule
(``sampling.sample``: argmax for greedy, Gumbel-max keyed by (seed, position) otherwise) and
the draft is accepted while it agrees, the first disagreement being replaced by the drawn
token. A drafted token d is thus accepted exactly when the rule would have drawn d, with
probability p(d), and on rejection the emitted token is a draw from p restricted to the other
tokens: the standard speculative-sampling rule for a point-mass draft, realised with the
same random numbers as plain decoding. So the output is token for token what the same seed
gives without speculation, greedy or sampled: a free oracle for the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from monokernel.errors import InvalidRequestError
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.sampling import SamplingParams, sample

METHODS = ("ngram",)
MAX_DRAFT = 32  # a verification pass grows with the draft; past ~32 tokens it stops paying


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``--speculative ngram --num-speculative-tokens K --ngram-max N --ngram-min M``."""

    method: str = "ngram"
    num_tokens: int = 4  # K: tokens drafted a step at most
    ngram_max: int = 4  # the longest suffix matched
    ngram_min: int = 2  # the shortest suffix matched (1 drafts after any repeated token)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidRequestError(
                f"speculative method {self.method!r}; choose from {', '.join(METHODS)}"
            )
        if not isinstance(self.num_tokens, int) or not 1 <= self.num_tokens <= MAX_DRAFT:
            raise InvalidRequestError(
                f"--num-speculative-tokens must be an integer in [1, {MAX_DRAFT}]; "
                f"got {self.num_tokens!r}"
            )
        if not isinstance(self.ngram_min, int) or not isinstance(self.ngram_max, int):
            raise InvalidRequestError("--ngram-min and --ngram-max must be integers")
        if not 1 <= self.ngram_min <= self.ngram_max <= 64:
            raise InvalidRequestError(
                f"n-gram bounds must satisfy 1 <= --ngram-min <= --ngram-max <= 64; got "
                f"{self.ngram_min} and {self.ngram_max}"
            )


class NgramDrafter:
    """Drafts from one token sequence that grows at its end (prompt, then output)."""

    def __init__(self, config: SpeculativeConfig, tokens: Sequence[int] = ()) -> None:
        self.config = config
        self.tokens: list[int] = []
        # n -> n-gram -> end (exclusive) of its latest occurrence that has a token after it
        self._index: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(config.ngram_min, config.ngram_max + 1)
        }
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            # The n-grams ending just before t now have a follower: index them.
            end = len(self.tokens)
            for n, index in self._index.items():
                if end >= n:
                    index[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(int(t))

    def draft(self, limit: int) -> list[int]:
        """Up to ``min(limit, num_tokens)`` tokens that followed the latest earlier
        occurrence of the longest suffix that has one; [] when none does."""
        k = min(limit, self.config.num_tokens)
        if k <= 0:
            return []
        end = len(self.tokens)
        for n in range(min(self.config.ngram_max, end), self.config.ngram_min - 1, -1):
            at = self._index[n].get(tuple(self.tokens[end - n :]))
            if at is not None:
                return self.tokens[at : at + k]
        return []


@dataclass(slots=True)
class SpeculationStats:
    """Per request: verification passes, tokens drafted, drafted tokens accepted."""

    passes: int = 0
    drafted: int = 0
    accepted: int = 0


def verify(
    logits: torch.Tensor, draft: Sequence[int], params: SamplingParams, first_pos: int
) -> list[int]:
    """The tokens a pass emits. ``logits`` [len(draft) + 1, V]: row j predicts position
    ``first_pos + j``, having seen the draft's first j tokens. Returns the drawn tokens up to
    and including the first that differs from the draft (all len(draft) + 1 when none does)."""
    out: list[int] = []
    for j in range(len(draft) + 1):
        token = sample(logits[j], params, first_pos + j)
        out.append(token)
        if j == len(draft) or token != draft[j]:
            break
    return out


# forward(tokens, start) -> logits [len(tokens), V]: the model over ``tokens`` at positions
# [start, start + len), writing their K/V into the backend's cache (rows past the accepted
# ones are rewritten by the next pass before anything reads them).
Forward = Callable[[list[int], int], torch.Tensor]


def speculative_stream(
    forward: Forward,
    first_logits: torch.Tensor,
    request: DecodeRequest,
    cancel: CancelToken,
    config: SpeculativeConfig,
    max_seq_len: int,
    stats: SpeculationStats,
) -> Iterator[int]:
    """A backend's decode loop with n-gram drafts: the same ids as one token a pass.
    ``first_logits`` [V]: the prompt's last position's, from the backend's prefill."""
    if request.matcher is not None:
        # Drafts would need checking against the grammar before verification.
        raise InvalidRequestError("constrained decoding does not combine with --speculative yet")
    sp, n = request.sampling, len(request.prompt_ids)
    drafter = NgramDrafter(config, request.prompt_ids)
    pending = [sample(first_logits, sp, n)]
    pos = n  # where pending[0] sits
    produced = 0
    while True:
        for j, token in enumerate(pending):
            if cancel.is_set():
                return
            yield token
            produced += 1
            stats.accepted += j > 0  # pending[1:] are drafted tokens the model agreed with
            drafter.extend((token,))
            if token in request.stop_token_ids or produced == request.max_new_tokens:
                return
        last, at = pending[-1], pos + len(pending) - 1  # the newest token and its position
        if at >= max_seq_len:
            return  # the cache is full: no row for the newest token's K/V
        # Drafted tokens past what the request or the cache can take would be wasted work.
        draft = drafter.draft(min(request.max_new_tokens - produced - 1, max_seq_len - at - 1))
        if draft:
            stats.passes += 1
            stats.drafted += len(draft)
        logits = forward([last, *draft], at)
        pending = verify(logits, draft, sp, at + 1)
        pos = at + 1


class Speculating:
    """What a backend with a ``_forward`` (see Forward) and this mixin gains:
    ``set_speculative`` and ``_speculate``, its decode loop with drafts; ``speculation``
    holds the last request's counts."""

    speculative: SpeculativeConfig | None = None
    speculation: SpeculationStats | None = None

    def _forward(self, tokens: list[int], start: int) -> torch.Tensor:
        raise NotImplementedError

    def set_speculative(self, config: SpeculativeConfig | None) -> None:
        """Draft from the request's own tokens and verify several a pass; None: one token a
        pass."""
        self.speculative = config

    def _speculate(
        self,
        first_logits: torch.Tensor,
        request: DecodeRequest,
        cancel: CancelToken,
        max_seq_len: int,
    ) -> Iterator[int]:
        assert self.speculative is not None
        self.speculation = SpeculationStats()
        return speculative_stream(
            self._forward,
            first_logits,
            request,
            cancel,
            self.speculative,
            max_seq_len,
            self.speculation,
        )
