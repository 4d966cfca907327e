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

A pass with no draft (nothing matched: most of free-form chat) runs the backend's own
one-token decode step (``Speculating._plain_step``), the very call decoding without drafts
makes, so it costs what a plain step costs and draws the same token. A greedy pass with a
draft may take the backend's greedy picks without the logits (``Speculating._greedy_pass``),
as its plain greedy step does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial

import torch

from monokernel.errors import InvalidRequestError
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.sampling import SamplingParams, sample

METHODS = ("ngram",)
MAX_DRAFT = 32  # a verification pass grows with the draft; past ~32 tokens it stops paying
# K when not given: on the CPU a pass of 4 positions costs ~2 one-token steps and one of 5
# ~2.8, and K = 3 beat K = 4 on both the copying and the chat workloads (docs/speculative.md,
# session 37). On the monokernel K = 7 gained more on the default model's three workloads
# (H200, session 51) but lost 9% where the model continues a pattern instead of copying it
# (38% of the drafts kept), where K = 3 gained 2%: 3 is the default everywhere.
DEFAULT_DRAFT = 3


# --ngram-max / --ngram-min where none is given, by engine (others: NGRAM_DEFAULT). The
# monokernel's pass of 4 positions costs ~3 of its steps (docs/speculative.md), so it drafts
# only where the output repeats a long run of its context: on the default model's chat
# workload 1.02x with 6 / 3 against 0.93x with 4 / 2 (H100, session 40).
NGRAM_DEFAULT = (4, 2)
NGRAM_DEFAULTS: dict[str, tuple[int, int]] = {"monokernel": (6, 3)}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``--speculative ngram --num-speculative-tokens K --ngram-max N --ngram-min M``."""

    method: str = "ngram"
    num_tokens: int = DEFAULT_DRAFT  # K: tokens drafted a step at most
    # The longest and the shortest suffix matched (a shortest of 1 drafts after any repeated
    # token); None: the engine's own (``bounds``).
    ngram_max: int | None = None
    ngram_min: int | None = None
    # Not asked for (no --speculative): drafts only where the backend's passes pay by
    # default (``drafts_by_default``), and quietly nothing elsewhere.
    by_default: bool = False

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
        for bound in (self.ngram_max, self.ngram_min):
            if bound is not None and (not isinstance(bound, int) or not 1 <= bound <= 64):
                raise InvalidRequestError(
                    f"--ngram-min and --ngram-max must be integers in [1, 64]; got {bound!r}"
                )
        if self.ngram_max is not None and self.ngram_min is not None:
            self.bounds()

    def for_engine(self, engine: str) -> SpeculativeConfig:
        """This config as ``engine`` runs it: the n-gram bounds its own where not given."""
        longest, shortest = self.bounds(engine)
        return replace(self, ngram_max=longest, ngram_min=shortest)

    def bounds(self, engine: str = "") -> tuple[int, int]:
        """(longest, shortest) suffix matched on ``engine``: the given ones, else the
        engine's defaults (NGRAM_DEFAULTS); InvalidRequestError where they cross."""
        default_max, default_min = NGRAM_DEFAULTS.get(engine, NGRAM_DEFAULT)
        longest = default_max if self.ngram_max is None else self.ngram_max
        shortest = default_min if self.ngram_min is None else self.ngram_min
        if not shortest <= longest:
            raise InvalidRequestError(
                f"n-gram bounds must satisfy 1 <= --ngram-min <= --ngram-max <= 64; got "
                f"{shortest} and {longest}"
                + (f" ({engine}'s defaults fill the one not given)" if engine else "")
            )
        return longest, shortest


class NgramDrafter:
    """Drafts from one token sequence that grows at its end (prompt, then output)."""

    def __init__(self, config: SpeculativeConfig, tokens: Sequence[int] = ()) -> None:
        self.config = config
        self.longest, self.shortest = config.bounds()
        self.tokens: list[int] = []
        # n -> n-gram -> end (exclusive) of its latest occurrence that has a token after it
        self._index: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(self.shortest, self.longest + 1)
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
        for n in range(min(self.longest, end), self.shortest - 1, -1):
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


def accept(drawn: Sequence[int], draft: Sequence[int]) -> list[int]:
    """``verify`` for a pass whose draws are all made already (``drawn[j]``: the token the
    rule drew at row j, len(draft) + 1 of them): the drawn tokens up to and including the
    first that differs from the draft."""
    for j, token in enumerate(drawn[: len(draft)]):
        if token != draft[j]:
            return list(drawn[: j + 1])
    return list(drawn[: len(draft) + 1])


# forward(tokens, start) -> logits [len(tokens), V]: the model over ``tokens`` at positions
# [start, start + len), writing their K/V into the backend's cache (rows past the accepted
# ones are rewritten by the next pass before anything reads them).
Forward = Callable[[list[int], int], torch.Tensor]
# step(token, pos, params) -> the token the backend's one-token decode step draws at pos + 1
# after ``token`` at ``pos`` (its K/V written at ``pos``).
Step = Callable[[int, int, SamplingParams], int]
# greedy_pass(tokens, start) -> the greedy token at each of positions start + 1.. (as
# ``step`` picks it after each), or None where the backend has no cheaper way than Forward.
GreedyPass = Callable[[list[int], int], list[int] | None]


def verify_one(forward: Forward, token: int, at: int, params: SamplingParams) -> int:
    """The token a forward of ``token`` alone at ``at`` draws at ``at + 1``."""
    return sample(forward([token], at)[0], params, at + 1)


def passes_serve(request: DecodeRequest) -> bool:
    """Whether verification passes can serve ``request``: not with a grammar (each draft
    would need checking against it first), logit processing or logprobs (they go a token at
    a time)."""
    return request.matcher is None and not request.sampling.host_fields()


def speculative_stream(
    forward: Forward,
    first_logits: torch.Tensor,
    request: DecodeRequest,
    cancel: CancelToken,
    config: SpeculativeConfig,
    max_seq_len: int,
    stats: SpeculationStats,
    step: Step | None = None,
    greedy_pass: GreedyPass | None = None,
    drafting: bool = True,
) -> Iterator[int]:
    """A backend's decode loop with n-gram drafts: the same ids as one token a pass.
    ``first_logits`` [V]: the prompt's last position's, from the backend's prefill.
    ``step``: the backend's plain decode step, which a pass without a draft runs (None: a
    ``forward`` of one token); ``greedy_pass``: its greedy picks for a pass with a draft.
    ``drafting`` False: no draft is made, every pass is ``step`` (a backend whose passes
    over several positions would not sum as its step does)."""
    assert passes_serve(request), "such a request decodes without drafts (Speculating.drafting)"
    if step is None:
        step = partial(verify_one, forward)
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
        room = min(request.max_new_tokens - produced - 1, max_seq_len - at - 1)
        draft = drafter.draft(room) if drafting else []
        pos = at + 1
        if not draft:
            # Nothing to verify: the step decoding without drafts runs, not a verification
            # pass of one position, which may cost more (the torch engine's eager forward
            # on a GPU, its wider LM head on the CPU).
            pending = [step(last, at, sp)]
            continue
        stats.passes += 1
        stats.drafted += len(draft)
        picks = greedy_pass([last, *draft], at) if sp.greedy and greedy_pass else None
        if picks is not None:
            pending = accept(picks, draft)
        else:
            pending = verify(forward([last, *draft], at), draft, sp, pos)


class Speculating:
    """What a backend with a ``_forward`` (see Forward) and this mixin gains:
    ``set_speculative`` and ``_speculate``, its decode loop with drafts; ``speculation``
    holds the last request's counts. A backend whose plain decode step is not a ``_forward``
    of one token overrides ``_plain_step`` (see Step), and ``_greedy_pass`` (see GreedyPass)
    where its greedy step picks otherwise than the argmax of ``_forward``'s logits."""

    speculative: SpeculativeConfig | None = None
    speculation: SpeculationStats | None = None

    def _forward(self, tokens: list[int], start: int) -> torch.Tensor:
        raise NotImplementedError

    def _plain_step(self, token: int, pos: int, params: SamplingParams) -> int:
        return verify_one(self._forward, token, pos, params)

    def _greedy_pass(self, tokens: list[int], start: int) -> list[int] | None:
        return None

    def drafts_verified(self) -> bool:
        """Whether a pass over several positions picks what the plain step would at each:
        where not, drafts would change the ids, so none is made."""
        return True

    def drafts_by_default(self) -> bool:
        """Whether requests draft without --speculative: where the workloads measured no loss
        on free-form chat (issue 36's rule for a default). Not the reference engine's, which
        is not the one anybody decodes with for speed."""
        return False

    def set_speculative(self, config: SpeculativeConfig | None) -> None:
        """Draft from the request's own tokens and verify several a pass; None: one token a
        pass."""
        self.speculative = config

    def drafting(self, request: DecodeRequest) -> bool:
        """Whether ``request`` decodes with drafts (``_speculate``): under --speculative,
        where passes_serve it. The others decode one token a pass, which gives the same
        tokens; ``speculation`` is reset for the request (nothing drafted, or None without
        --speculative)."""
        if self.speculative is None:
            self.speculation = None
            return False
        self.speculation = SpeculationStats()
        return passes_serve(request)

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
            self._plain_step,
            self._greedy_pass,
            self.drafts_verified(),
        )
