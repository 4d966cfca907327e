"""A request under ``--speculative`` on the monokernel (greedy, or sampled by temperature
alone: verify_pass.drawn_in_passes): launches of the step build and of the pass build
taking turns (docs/speculative.md).

A pass costs more than a step (on the default model a pass of 4 positions ~3 steps, of one
~1.3), so it pays only where its draft is nearly sure to be kept. The request therefore
decodes by steps until its last ``ngram_max`` tokens occurred earlier in it (the output is
copying its context), then by passes that draft and verify in the kernel, until a pass has
no draft or keeps none of it (``Params::draft_exit``), then by steps again. The host watches
for the repeat while the step build runs (one dictionary lookup a token, off the GPU's path)
and stops it after the step it is running; each hand-over costs one launch and no token.
Both builds draw a position's token by the same rule from the same key (the seed and the
position), so every token is the one decoding by steps alone draws, sampled or not.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from typing import TYPE_CHECKING

from monokernel.runtime.backends.base import CancelToken
from monokernel.runtime.sampling import SamplingParams
from monokernel.runtime.speculative import NgramDrafter, SpeculativeConfig

if TYPE_CHECKING:
    from monokernel.runtime.backends.monokernel.request import RequestDriver
    from monokernel.runtime.backends.monokernel.verify_pass import Drafting


class RepeatWatch:
    """Whether a request's last ``length`` tokens occurred earlier in it (``repeat``), kept
    up to date as tokens arrive (``add``); the index of the request's tokens is built at the
    first token, while the kernel runs, not before the launch."""

    def __init__(self, tokens: Sequence[int], length: int) -> None:
        self._pending: list[int] = list(tokens)
        self._config = SpeculativeConfig(num_tokens=1, ngram_max=length, ngram_min=length)
        self._index: NgramDrafter | None = None
        self.repeat = False

    def add(self, token: int) -> bool:
        """``token`` appended; whether the tokens now end with a repeat."""
        return self.extend((token,))

    def extend(self, tokens: Sequence[int]) -> bool:
        """``tokens`` appended; whether the tokens now end with a repeat (one lookup, after
        the last of them)."""
        if self._index is None:
            self._index = NgramDrafter(self._config, self._pending)
            self._pending = []
        self._index.extend(tokens)
        self.repeat = bool(self._index.draft(1))
        return self.repeat


def drafted_tokens(
    driver: RequestDriver,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams,
    stop_ids: Sequence[int],
    cancel: CancelToken | None,
    first_from_prefill: bool,
    drafting: Drafting,
) -> Iterator[int]:
    """The ids of one request, by steps where nothing repeats and by passes where the
    output repeats its context."""
    tokens = list(prompt_ids)
    watch = RepeatWatch(tokens, drafting.ngram[1])
    # What one launch of the whole request could draw (request.checked_steps): a launch that
    # ends at the cache's end does not hand over.
    left = min(max_new_tokens, driver.max_seq_len - len(tokens) + 1)
    passes, first = False, True
    while left > 0:
        got: list[int] = []
        if passes:  # until a pass has no draft or keeps none of it
            launch = driver.run(
                tokens, left, sampling, stop_ids, cancel, drafting=drafting, continued=True
            )
            yield from _kept(launch, got)
            watch.extend(got)
        else:  # until the watch sees a repeat (it sees every token the launch yields)
            launch = driver.run(
                tokens, left, sampling, stop_ids, cancel,
                first_from_prefill=first and first_from_prefill, continued=not first,
                handback=watch.add,
            )  # fmt: skip
            yield from _kept(launch, got)
        first = False
        tokens += got
        left -= len(got)
        if not got or got[-1] in stop_ids or (cancel is not None and cancel.is_set()):
            return
        # Passes after steps that stopped at a repeat (unless the step in flight broke it);
        # after passes, steps: the last pass's draft was not kept, or there was none.
        passes = not passes and watch.repeat


def _kept(tokens: Generator[int, None, None], into: list[int]) -> Iterator[int]:
    """``tokens``, each also appended to ``into``; closing this closes ``tokens`` (its
    launch stops the kernel)."""
    try:
        for t in tokens:
            into.append(t)
            yield t
    finally:
        tokens.close()
