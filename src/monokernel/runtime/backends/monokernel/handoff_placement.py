"""Where the hand-off buffer lies, chosen at load by timing a few places.

The tagged vectors the kernel's stages hand to each other (x, qkv, delta, attn_out, act and
the attention partials: one buffer, ``MonokernelBackend.use_handoff``) are polled by every SM
several times a layer. Which physical pages they land on moves decode speed on an H100 by up
to ~1% (docs/perf-notes.md), and no alignment rule predicts it (the L2's address hash is not
documented). So the backend tries its own buffer and a few fresh ones, times a short
teacher-forced decode on each, and keeps the fastest: where it lies changes no result, only
speed. ``MONOKERNEL_HANDOFF_SEARCH=0`` turns it off.

The weights' own place matters less (a few µs a token at most between fresh copies), so they
are not searched: a copy costs their size in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from monokernel import envs
from monokernel.errors import InvalidRequestError

# Fresh buffers tried beside the backend's own one: about a third of places are fast, so all
# eight are slow about one time in thirty.
DEFAULT_CANDIDATES = 7
# What one timing decodes: (first position, steps) spans, 128 steps in all. A short request
# (64-token prompt, 512 generated) decodes positions 64-576, where a head's 128-position
# ranges number 1 to 5; these two spans rank places nearly as a whole request's positions do,
# at a quarter of the cost.
SPANS: tuple[tuple[int, int], ...] = ((96, 64), (352, 64))
FINALISTS = 2  # places timed again after the first round; a place's time is its best


@dataclass(frozen=True, slots=True)
class HandoffChoice:
    """What the search timed: µs per decode step of each place (0: the backend's own
    buffer), and the one kept."""

    us_per_step: tuple[float, ...]
    chosen: int
    spans: tuple[tuple[int, int], ...]  # (first position, steps) of each timed decode

    def as_dict(self) -> dict[str, object]:
        return {
            "us_per_step": list(self.us_per_step),
            "chosen": self.chosen,
            "spans": [list(s) for s in self.spans],
        }


class _Searchable(Protocol):
    handoff: torch.Tensor
    device: torch.device
    max_seq_len: int

    def use_handoff(self, buf: torch.Tensor) -> None: ...

    def timed_decode(self, forced: torch.Tensor, start_pos: int) -> float: ...


def handoff_places(asked: int | None) -> int:
    """Fresh places to try: ``asked``, else MONOKERNEL_HANDOFF_SEARCH (its default is
    DEFAULT_CANDIDATES)."""
    if asked is None:
        return int(envs.MONOKERNEL_HANDOFF_SEARCH)
    if asked < 0:
        raise InvalidRequestError(f"handoff_search must be 0 (off) or more places; got {asked}")
    return asked


def search_plan(
    max_seq_len: int, spans: tuple[tuple[int, int], ...] = SPANS
) -> tuple[tuple[int, int], ...] | None:
    """The spans of ``spans`` a cache of ``max_seq_len`` positions holds; where it holds none,
    one span of the first's length (or the cache's, from 16 steps) at the cache's end; None
    where the cache is too short for a timing worth having."""
    fit = tuple(s for s in spans if s[0] + s[1] <= max_seq_len)
    if fit:
        return fit
    steps = min(spans[0][1], max_seq_len)
    return ((max_seq_len - steps, steps),) if steps >= 16 else None


def span_us_per_step(
    backend: _Searchable, forced: torch.Tensor, spans: tuple[tuple[int, int], ...]
) -> float:
    """µs per step over teacher-forced decodes of ``spans`` ((first position, steps) each,
    fed ``forced[:steps]``), weighted by their steps: the search's timing of a place."""
    total = sum(backend.timed_decode(forced[:n], start) * n for start, n in spans)
    return total / sum(n for _, n in spans) * 1e6


def choose_handoff(
    backend: _Searchable,
    vocab_size: int,
    candidates: int = DEFAULT_CANDIDATES,
    spans: tuple[tuple[int, int], ...] = SPANS,
    finalists: int = FINALISTS,
) -> HandoffChoice | None:
    """Time the backend's own hand-off buffer and ``candidates`` fresh ones once each, the
    ``finalists`` fastest once more, and keep the fastest (the others go back to the
    allocator). A timing is the mean step of teacher-forced decodes over the plan's spans.
    None: nothing was tried (the cache is too short for a timing, or no candidates were
    asked for)."""
    plan = search_plan(backend.max_seq_len, spans)
    if plan is None or candidates < 1:
        return None
    own = backend.handoff
    places = [own] + [torch.empty_like(own) for _ in range(candidates)]
    gen = torch.Generator().manual_seed(0)
    longest = max(n for _, n in plan)
    forced = torch.randint(0, vocab_size, (longest,), generator=gen, dtype=torch.int32)
    forced = forced.to(backend.device)  # [longest]
    backend.timed_decode(forced[: plan[0][1]], plan[0][0])  # warm-up: launch, caches, clocks

    def time_at(i: int) -> float:
        backend.use_handoff(places[i])
        return span_us_per_step(backend, forced, plan)

    best = [time_at(i) for i in range(len(places))]
    for i in sorted(range(len(places)), key=best.__getitem__)[:finalists]:
        best[i] = min(best[i], time_at(i))
    chosen = min(range(len(places)), key=best.__getitem__)
    backend.use_handoff(places[chosen])
    return HandoffChoice(tuple(best), chosen, plan)
