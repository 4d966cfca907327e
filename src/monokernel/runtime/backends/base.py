"""The contract every decode backend (reference, torch, monokernel) fulfils.

A backend turns prompt token ids into a stream of generated token ids. Everything textual
(tokenising, detokenising, stop strings, timings) lives in the Engine above it, so the
backends differ only in how fast they produce the same ids.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from monokernel.runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from monokernel.runtime.constrained import TokenMatcher
    from monokernel.runtime.logprobs import TokenLogprobs


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams  # seed already fixed (SamplingParams.with_seed)
    max_new_tokens: int
    stop_token_ids: frozenset[int]  # generation ends after emitting one of these
    # sampling.constraint's grammar state for this request: the backend masks the logits
    # with it before each draw and advances it with the drawn token (torch and reference
    # engines; others refuse constrained requests in the Engine).
    matcher: TokenMatcher | None = None
    # With sampling.logprobs set, a list the backend appends each generated token's
    # TokenLogprobs to (runtime/logprobs.py) before yielding the token (torch and reference
    # engines; the Engine refuses logprobs elsewhere).
    logprobs: list[TokenLogprobs] | None = None


class CancelToken:
    """Set from any thread; a backend checks it at least once per generated token."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


class Backend(Protocol):
    name: str

    def stream(self, request: DecodeRequest, cancel: CancelToken) -> Iterator[int]:
        """Yield generated ids in order. Stops after a stop id (which is yielded), after
        ``max_new_tokens`` ids, or soon after ``cancel`` is set. Closing the iterator early
        must leave the backend ready for the next request."""
        ...

    def close(self) -> None:
        """Free device memory; the backend is unusable afterwards."""
        ...


def planned_reuse(backend: object, prompt: Sequence[int]) -> int | None:
    """Prompt tokens the backend's prefix cache will supply instead of prefilling them (the
    monokernel backend's ``PrefixCache``); None for a backend without one.

    The backend reports nothing after a request, but ``PrefixCache.plan`` is pure and is the
    very plan the request's cache fill then follows, so asking it just before the request
    gives the number the request uses."""
    plan = getattr(getattr(backend, "prefix", None), "plan", None)
    return None if plan is None else int(plan(list(prompt)).reuse)
