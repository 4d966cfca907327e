"""The hand-off buffer's load-time search, against a stand-in backend whose timings depend
on the buffer it is given (the GPU test in test_backend.py runs the real one)."""

from __future__ import annotations

import pytest
import torch

from monokernel.errors import InvalidRequestError
from monokernel.runtime.backends.monokernel.handoff_placement import (
    DEFAULT_CANDIDATES,
    SPANS,
    choose_handoff,
    handoff_places,
    search_plan,
)


class _Stub:
    """Times each place by the order it was first seen in: ``speeds[k]`` seconds a step for
    the k-th, 5 µs slower the first time a place decodes from a position, so a place's best
    round must count."""

    def __init__(self, speeds: list[float], max_seq_len: int = 4096, numel: int = 37) -> None:
        self.handoff = torch.zeros(numel)
        self.device = torch.device("cpu")
        self.max_seq_len = max_seq_len
        self.speeds = speeds
        self.seen: list[int] = []  # data_ptr of each place, first use first
        self.calls: list[tuple[int, int, int]] = []  # (place, steps, start)

    def use_handoff(self, buf: torch.Tensor) -> None:
        assert buf.shape == self.handoff.shape and buf.dtype == self.handoff.dtype
        self.handoff = buf

    def timed_decode(self, forced: torch.Tensor, start_pos: int) -> float:
        ptr = self.handoff.data_ptr()
        if ptr not in self.seen:
            self.seen.append(ptr)
        assert forced.dtype == torch.int32 and forced.device == self.device
        assert start_pos + forced.numel() <= self.max_seq_len
        self.calls.append((ptr, forced.numel(), start_pos))
        first = sum(1 for p, _, s in self.calls if (p, s) == (ptr, start_pos)) == 1
        return self.speeds[self.seen.index(ptr)] + (5e-6 if first else 0.0)


@pytest.mark.parametrize("fastest", [0, 1, 3])
def test_the_fastest_place_is_kept(fastest: int) -> None:
    speeds = [1.30e-3, 1.28e-3, 1.31e-3, 1.29e-3]
    speeds[fastest] = 1.25e-3
    stub = _Stub(speeds)
    own = stub.handoff
    choice = choose_handoff(stub, vocab_size=100, candidates=3, finalists=2)
    assert choice is not None
    assert choice.chosen == fastest
    # The two fastest after one round are timed again: their best rounds are noise-free;
    # the others carry their first timing's noise, the own buffer's but on the spans after
    # the first (the warm-up decoded that one).
    finalists = sorted(range(4), key=speeds.__getitem__)[:2]
    steps = sum(n for _, n in SPANS)
    for i, us in enumerate(choice.us_per_step):
        noisy_steps = 0 if i in finalists else steps - (SPANS[0][1] if i == 0 else 0)
        assert us == pytest.approx(speeds[i] * 1e6 + 5.0 * noisy_steps / steps)
    assert stub.seen[0] == own.data_ptr() and len(set(stub.seen)) == 4
    assert stub.handoff.data_ptr() == stub.seen[fastest]
    assert choice.spans == SPANS
    # One warm-up, every place once, the finalists once more, over the planned spans.
    assert len(stub.calls) == 1 + (4 + 2) * len(SPANS)
    assert {(n, start) for _, n, start in stub.calls} == {(n, s) for s, n in SPANS}


def test_nothing_is_tried_without_candidates_or_room() -> None:
    stub = _Stub([1e-3])
    own = stub.handoff
    assert choose_handoff(stub, vocab_size=100, candidates=0) is None
    short = _Stub([1e-3], max_seq_len=15)
    assert choose_handoff(short, vocab_size=100) is None
    assert stub.calls == [] and short.calls == [] and stub.handoff is own


def test_search_plan_fits_the_cache() -> None:
    assert search_plan(15) is None
    assert search_plan(16) == ((0, 16),)
    assert search_plan(100) == ((36, 64),)
    assert search_plan(100_000) == SPANS == ((96, 64), (352, 64))
    assert search_plan(400) == ((96, 64),)
    assert search_plan(416) == SPANS


def test_places_from_argument_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MONOKERNEL_HANDOFF_SEARCH", raising=False)
    assert handoff_places(None) == DEFAULT_CANDIDATES
    assert handoff_places(5) == 5
    monkeypatch.setenv("MONOKERNEL_HANDOFF_SEARCH", "0")
    assert handoff_places(None) == 0
    assert handoff_places(2) == 2  # an explicit argument wins
    monkeypatch.setenv("MONOKERNEL_HANDOFF_SEARCH", "many")
    with pytest.raises(ValueError, match="MONOKERNEL_HANDOFF_SEARCH='many'"):
        handoff_places(None)
    monkeypatch.setenv("MONOKERNEL_HANDOFF_SEARCH", "-1")
    with pytest.raises(ValueError, match="MONOKERNEL_HANDOFF_SEARCH='-1'"):
        handoff_places(None)
    with pytest.raises(InvalidRequestError, match="got -1"):
        handoff_places(-1)
