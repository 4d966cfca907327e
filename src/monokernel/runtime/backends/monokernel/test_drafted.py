"""drafted.py on the CPU: the turns of step and pass launches a drafted request makes, over
a driver that plays the kernel's part from a known greedy continuation (the step build
yields it a token a step and finishes the step in flight when handed back; the pass build
keeps what the continuation confirms of each draft and ends as Params::draft_exit says)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from monokernel.runtime.backends.base import CancelToken
from monokernel.runtime.backends.monokernel.drafted import RepeatWatch, drafted_tokens
from monokernel.runtime.backends.monokernel.verify_pass import drawn_in_passes
from monokernel.runtime.sampling import SamplingParams
from monokernel.runtime.speculative import NgramDrafter, SpeculativeConfig

K, NGRAM = 3, (2, 4)


@dataclass
class ScriptedDriver:
    """Launches over ``prompt``, whose greedy continuation is ``script``."""

    prompt: list[int]
    script: list[int]
    launches: list[tuple[str, bool, bool, int]] = field(default_factory=list)
    max_seq_len: int = 4096
    # Every launch gets it.
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))

    def run(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: Any,
        stop_ids: Sequence[int],
        cancel: CancelToken | None,
        first_from_prefill: bool = False,
        drafting: Any = None,
        continued: bool = False,
        handback: Callable[[int], bool] | None = None,
    ) -> Iterator[int]:
        assert sampling is self.sampling and list(prompt_ids[: len(self.prompt)]) == self.prompt
        # request.checked_steps: a launch draws what the cache has room for.
        assert len(prompt_ids) <= self.max_seq_len
        max_new_tokens = min(max_new_tokens, self.max_seq_len - len(prompt_ids) + 1)
        kind = "steps" if drafting is None else "passes"
        self.launches.append((kind, continued, first_from_prefill, len(prompt_ids)))
        tokens = list(prompt_ids)
        done = len(tokens) - len(self.prompt)  # of the script, before this launch
        made = 0
        if drafting is None:
            handed = False
            while made < max_new_tokens and not (cancel is not None and cancel.is_set()):
                t = self.script[done + made]
                made += 1
                yield t
                if t in stop_ids or handed:
                    return
                handed = handback is not None and handback(t)  # the step in flight still runs
            return
        drafter = NgramDrafter(
            SpeculativeConfig(num_tokens=K, ngram_min=NGRAM[0], ngram_max=NGRAM[1])
        )
        drafter.extend(tokens)
        for step in range(max_new_tokens):
            draft = drafter.draft(max_new_tokens - made - 1)
            if not draft and step > 0:
                return
            kept = []
            for i in range(len(draft) + 1):
                kept.append(self.script[done + made + i])
                if i == len(draft) or kept[-1] != draft[i] or kept[-1] in stop_ids:
                    break
            for t in kept:
                if cancel is not None and cancel.is_set():
                    return
                made += 1
                yield t
                if t in stop_ids or made == max_new_tokens:
                    return
            drafter.extend(kept)
            if len(kept) == 1:
                return


def _drafted(
    driver: ScriptedDriver,
    n: int,
    stops: Sequence[int] = (),
    cancel: CancelToken | None = None,
    first_from_prefill: bool = True,
) -> list[int]:
    drafting: Any = SimpleNamespace(ngram=NGRAM)
    return list(
        drafted_tokens(
            driver,
            driver.prompt,
            n,
            driver.sampling,
            stops,
            cancel,
            first_from_prefill,
            drafting,  # type: ignore[arg-type]
        )
    )


def _case(seed: int) -> ScriptedDriver:
    """A prompt whose continuation copies runs of it with free text between."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1000) for _ in range(300)]
    script: list[int] = []
    while len(script) < 400:
        start = rng.randrange(250)
        script += prompt[start : start + rng.randrange(5, 40)]  # a copy
        script += [1000 + rng.randrange(1000) for _ in range(rng.randrange(0, 12))]  # new text
    return ScriptedDriver(prompt, script)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_turns_stream_the_continuation(seed: int) -> None:
    driver = _case(seed)
    assert _drafted(driver, 400) == driver.script[:400]
    kinds = [k for k, *_ in driver.launches]
    assert kinds[0] == "steps" and "passes" in kinds
    # Steps and passes take turns, a pass launch only where a repeat was seen.
    assert all(a != b or a == "steps" for a, b in itertools.pairwise(kinds))
    first = driver.launches[0]
    assert first[1:3] == (False, True)  # fresh, its first token from the prefill
    assert all(cont and not ffp for _, cont, ffp, _ in driver.launches[1:])
    # Each launch starts where the one before it ended.
    ends = [n for *_, n in driver.launches]
    assert ends == sorted(ends) and len(set(ends)) == len(ends)


def test_passes_begin_at_a_repeat_of_ngram_max_tokens() -> None:
    driver = _case(3)
    _drafted(driver, 400)
    for kind, _, _, n in driver.launches[1:]:
        if kind == "passes":
            tokens = (driver.prompt + driver.script)[:n]
            tail = tokens[-NGRAM[1] :]
            earlier = [
                tokens[j : j + NGRAM[1]] for j in range(len(tokens) - NGRAM[1]) if j + NGRAM[1] < n
            ]
            assert tail in earlier


def test_budgets_stops_and_cancel_end_where_steps_would() -> None:
    driver = _case(4)
    whole = driver.script
    for n in (1, 2, 37, 150):
        assert _drafted(_case(4), n) == whole[:n]
    stop = whole[120]
    assert _drafted(_case(4), 400, stops=[stop]) == whole[: whole.index(stop) + 1]
    cancel, got = CancelToken(), []
    for t in drafted_tokens(
        driver,
        driver.prompt,
        400,
        driver.sampling,
        (),
        cancel,
        True,
        SimpleNamespace(ngram=NGRAM),  # type: ignore[arg-type]
    ):
        got.append(t)
        if len(got) == 90:
            cancel.set()
    assert got == whole[:90]


def test_free_text_never_launches_passes() -> None:
    prompt = list(range(200))
    driver = ScriptedDriver(prompt, list(range(1000, 1300)))
    assert _drafted(driver, 300) == driver.script
    assert [k for k, *_ in driver.launches] == ["steps"]


def test_repeat_watch() -> None:
    watch = RepeatWatch([5, 6, 7, 8, 9], 3)
    assert not watch.repeat
    assert [watch.add(t) for t in (1, 6, 7, 8, 9, 2)] == [False, False, False, True, True, False]
    assert watch.repeat is False


def test_a_sampled_request_takes_the_same_turns_with_its_own_sampling() -> None:
    driver = _case(0)
    driver.sampling = SamplingParams(temperature=0.7, seed=3)
    assert _drafted(driver, 200) == driver.script[:200]
    assert "passes" in [k for k, *_ in driver.launches]


@pytest.mark.parametrize(
    ("sampling", "in_passes"),
    [
        (SamplingParams(temperature=0.0), True),
        (SamplingParams(temperature=0.7, seed=1), True),
        (SamplingParams(temperature=0.7, seed=1, top_k=100), False),
        (SamplingParams(temperature=0.7, seed=1, top_k=49152), True),  # the whole vocabulary
        (SamplingParams(temperature=0.7, seed=1, top_p=0.9), False),
        (SamplingParams(temperature=0.7, seed=1, min_p=0.05), False),
        (SamplingParams(temperature=0.0, top_p=0.9), True),  # greedy ignores top-p
    ],
)
def test_which_draws_a_pass_makes(sampling: SamplingParams, in_passes: bool) -> None:
    assert drawn_in_passes(sampling, 49152) is in_passes


def test_a_budget_past_the_cache_ends_where_the_cache_does() -> None:
    driver = _case(5)
    driver.max_seq_len = len(driver.prompt) + 150  # room for 151 tokens, as steps have
    assert _drafted(driver, 400) == driver.script[:151]
    assert "passes" in [k for k, *_ in driver.launches]
