"""The slow-step note: said once a step outlasts its threshold, never for a fast step."""

from __future__ import annotations

import io
import time

from monokernel.weights.progress import slow_step


def test_a_slow_step_is_announced_while_it_runs() -> None:
    out = io.StringIO()
    with slow_step("loading weights", after_s=0.01, stream=out):
        deadline = time.monotonic() + 10
        while not out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert out.getvalue() == "loading weights...\n"


def test_a_fast_step_says_nothing() -> None:
    out = io.StringIO()
    with slow_step("loading weights", after_s=5.0, stream=out):
        pass
    time.sleep(0.05)
    assert out.getvalue() == ""


def test_disabled_says_nothing() -> None:
    out = io.StringIO()
    with slow_step("loading weights", enabled=False, after_s=0.0, stream=out):
        time.sleep(0.05)
    assert out.getvalue() == ""


def test_an_error_cancels_the_note() -> None:
    out = io.StringIO()
    try:
        with slow_step("loading weights", after_s=0.05, stream=out):
            raise ValueError("boom")
    except ValueError:
        pass
    time.sleep(0.1)
    assert out.getvalue() == ""
