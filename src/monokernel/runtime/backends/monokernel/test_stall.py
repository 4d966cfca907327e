"""A monokernel that stops producing tokens (fault injection, MONOKERNEL_DEBUG_STALL): the
request fails with a clear error within MONOKERNEL_STALL_SECONDS plus the stop grace, not a
hang; a kernel that stops once cancelled leaves the backend serving, one that does not (its
other CTAs then trap: a kernel fault) leaves it failed for good.

GPU tests (marker ``gpu``); the hard stall runs in a child process, since the fault it
causes leaves that process's CUDA context unusable.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from monokernel import envs
from monokernel.models.shapes import SHAPES
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.backends.monokernel.kernel import (
    STOP_GRACE_SECONDS,
    KernelStuckError,
    debug_stall,
)
from monokernel.runtime.sampling import SamplingParams
from monokernel.testing.gpu_models import hopper_with, random_ids
from monokernel.testing.oracle import assert_greedy_matches, peaked
from monokernel.weights.random_weights import random_weights

needs_hopper = pytest.mark.skipif(not hopper_with(4), reason="needs a Hopper GPU (sm_90)")
GREEDY = SamplingParams(temperature=0.0)


def _request(prompt: list[int], n: int) -> DecodeRequest:
    return DecodeRequest(tuple(prompt), GREEDY, n, frozenset())


@pytest.mark.parametrize(
    ("text", "want"), [("", (-1, 0)), ("3", (3, 0)), ("12:hard", (12, 1)), (" 0 ", (0, 0))]
)
def test_the_injection_setting(text: str, want: tuple[int, int]) -> None:
    with envs.overridden(MONOKERNEL_DEBUG_STALL=text or None):
        assert debug_stall() == want


@pytest.mark.parametrize("text", ["x", "3:soft", "-1", "3:"])
def test_a_bad_injection_setting_is_refused(text: str) -> None:
    with envs.overridden(MONOKERNEL_DEBUG_STALL=text), pytest.raises(ValueError, match="STEP"):
        debug_stall()


@pytest.mark.gpu
@needs_hopper
def test_a_stall_fails_its_request_in_bounded_time_and_the_next_one_runs() -> None:
    from monokernel.runtime.backends.monokernel import MonokernelBackend

    cfg, dev = SHAPES["odd"], torch.device("cuda")
    weights = peaked(cfg, random_weights(cfg, device=dev, seed=41))
    prompt = random_ids(24, cfg.vocab_size, seed=42)
    mk = MonokernelBackend(cfg, weights, 256, dev)
    with envs.overridden(MONOKERNEL_DEBUG_STALL="3", MONOKERNEL_STALL_SECONDS="2"):
        got: list[int] = []
        t0 = time.monotonic()
        with pytest.raises(KernelStuckError, match="produced no token for 2 s"):
            got.extend(mk.stream(_request(prompt, 64), CancelToken()))
        took = time.monotonic() - t0
    assert len(got) == 4  # the first token comes from the prefill, then steps 0-2's
    assert took < 2 + STOP_GRACE_SECONDS + 2, f"the failure took {took:.1f} s"
    assert mk.failure is None  # the kernel stopped when cancelled: the backend still serves
    after = list(mk.stream(_request(prompt, 64), CancelToken()))
    mk.close()
    assert after[:4] == got and len(after) == 64
    assert_greedy_matches(cfg, weights, prompt, after, "after a stall")


_HARD = textwrap.dedent(
    """
    import time, torch
    from monokernel.errors import EngineFailedError
    from monokernel.models.shapes import SHAPES
    from monokernel.runtime.backends.base import CancelToken, DecodeRequest
    from monokernel.runtime.backends.monokernel import MonokernelBackend
    from monokernel.runtime.sampling import SamplingParams
    from monokernel.weights.random_weights import random_weights

    cfg, dev = SHAPES["odd"], torch.device("cuda")
    mk = MonokernelBackend(cfg, random_weights(cfg, device=dev, seed=43), 256, dev)
    request = DecodeRequest((1, 2, 3), SamplingParams(temperature=0.0), 64, frozenset())
    t0 = time.monotonic()
    try:
        list(mk.stream(request, CancelToken()))
        print("RESULT no error")
    except EngineFailedError as e:
        print(f"RESULT EngineFailedError {time.monotonic() - t0:.1f} s: {e}")
    try:
        list(mk.stream(request, CancelToken()))
    except EngineFailedError:
        print("RESULT refused after failure:", mk.failure is not None)
    """
)


@pytest.mark.gpu
@needs_hopper
def test_a_stall_that_ignores_the_cancel_fails_the_backend_for_good() -> None:
    env = dict(os.environ, MONOKERNEL_DEBUG_STALL="3:hard", MONOKERNEL_STALL_SECONDS="30")
    run = subprocess.run(
        [sys.executable, "-c", _HARD], env=env, capture_output=True, text=True, timeout=180
    )
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT")]
    print("\n".join(lines), run.stderr[-2000:] if not lines else "")
    assert lines and lines[0].startswith("RESULT EngineFailedError"), run.stderr[-2000:]
    seconds = float(lines[0].split()[2])
    assert seconds < 30, "the other CTAs' traps (~10 s) should end it before the stall limit"
    assert lines[-1] == "RESULT refused after failure: True"
