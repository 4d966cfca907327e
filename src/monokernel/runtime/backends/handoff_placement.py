"""Where the hand-off buffer lies, chosen at load by timing a few places.

The tagged vectors the kernel's stages hand to each other (x, qkv, delta, attn_out, act and
the attention partials: one buffer, ``MonokernelBackend.use_handoff``) are polled by every SM
several times a layer. Which physical pages they land on moves decode speed on an H100 by up
to ~1% (docs/perf-notes.md step 48: 1,271.6-1,283.0 µs/token on Qwen2.5-Coder-1.5B with
only this buffer moved; Llama-3.2-1B within its noise), and no alignment rule predicts it
(the L2's address hash is not documented). So the backend tries its own buffer and a few
fresh ones, times a short teacher-forced decode on each, and keeps the fastest: where it
lies changes no result, only speed. ``MONOKERNEL_HANDOFF_SEARCH=0`` turns it off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch

from monokernel.errors import InvalidRequestError

# Fresh buffers tried beside the backend's own one. Of eleven places measured on one H100
# (docs/perf-notes.md step 52) four were fast and seven ~4.5 µs a token slower; with eight
# places all are slow about one time in thirty.
DEFAULT_CANDIDATES = 7
STEPS = 64  # decode steps a timing runs: 80 ms on Qwen2.5-Coder-1.5B
FINALISTS = 2  # places timed again after the first round; a place's time is its best
# Positions the timings decode at: the hand-offs' polls and the attention partials' merges
# as a short request has them (head-unit ranges of 128-256 positions merged), not those of
# a first token.
START_POS = 256


@dataclass(frozen=True, slots=True)
class HandoffChoice:
    """What the search timed: µs per decode step of each place (0: the backend's own
    buffer), and the one kept."""

    us_per_step: tuple[float, ...]
    chosen: int
    start_pos: int
    steps: int

    def as_dict(self) -> dict[str, object]:
        return {
            "us_per_step": list(self.us_per_step),
            "chosen": self.chosen,
            "start_pos": self.start_pos,
            "steps": self.steps,
        }


class _Searchable(Protocol):
    handoff: torch.Tensor
    device: torch.device
    max_seq_len: int

    def use_handoff(self, buf: torch.Tensor) -> None: ...

    def timed_decode(self, forced: torch.Tensor, start_pos: int) -> float: ...


def handoff_places(asked: int | None) -> int:
    """Fresh places to try: ``asked``, else MONOKERNEL_HANDOFF_SEARCH, else the default."""
    if asked is None:
        env = os.environ.get("MONOKERNEL_HANDOFF_SEARCH", "").strip()
        if not env:
            return DEFAULT_CANDIDATES
        if not env.isdigit():
            raise InvalidRequestError(
                f"MONOKERNEL_HANDOFF_SEARCH={env!r}: give 0 (off) or a number of places"
            )
        return int(env)
    if asked < 0:
        raise InvalidRequestError(f"handoff_search must be 0 (off) or more places; got {asked}")
    return asked


def search_plan(max_seq_len: int, steps: int = STEPS) -> tuple[int, int] | None:
    """(start position, steps) of the timings for a cache of ``max_seq_len`` positions, or
    None where the cache is too short for a timing worth having."""
    steps = min(steps, max_seq_len)
    if steps < 16:
        return None
    return min(START_POS, max_seq_len - steps), steps


def choose_handoff(
    backend: _Searchable,
    vocab_size: int,
    candidates: int = DEFAULT_CANDIDATES,
    steps: int = STEPS,
    finalists: int = FINALISTS,
) -> HandoffChoice | None:
    """Time the backend's own hand-off buffer and ``candidates`` fresh ones once each, the
    ``finalists`` fastest once more, and keep the fastest (the others go back to the
    allocator). None: nothing was tried (the cache is too short for a timing, or no
    candidates were asked for)."""
    plan = search_plan(backend.max_seq_len, steps)
    if plan is None or candidates < 1:
        return None
    start, steps = plan
    own = backend.handoff
    places = [own] + [torch.empty_like(own) for _ in range(candidates)]
    gen = torch.Generator().manual_seed(0)
    forced = torch.randint(0, vocab_size, (steps,), generator=gen, dtype=torch.int32)
    forced = forced.to(backend.device)  # [steps]
    backend.timed_decode(forced, start)  # warm-up: first launch, caches, clocks

    def time_at(i: int) -> float:
        backend.use_handoff(places[i])
        return backend.timed_decode(forced, start) * 1e6

    best = [time_at(i) for i in range(len(places))]
    for i in sorted(range(len(places)), key=best.__getitem__)[:finalists]:
        best[i] = min(best[i], time_at(i))
    chosen = min(range(len(places)), key=best.__getitem__)
    backend.use_handoff(places[chosen])
    return HandoffChoice(tuple(best), chosen, start, steps)
