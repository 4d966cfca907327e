"""Reading the tokens a running monokernel publishes in host-mapped memory.

The kernel writes token i to ``out[2 + i]``, then the count to ``out[0]`` (a system-scope
fence between), and sets ``out[1]`` when it stops by itself; the host polls without
sleeping, so a token reaches the consumer a few microseconds after the kernel wrote it.
Shared by the single-GPU and tensor-parallel backends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import Any

from monokernel.runtime.backends.base import CancelToken

CHECK_EVERY = 64  # idle polls between health checks (a check costs a driver call)


def read_tokens(
    out: Any, cancel: CancelToken | None, check: Callable[[float], None]
) -> Generator[int, None, bool]:
    """Yield tokens from ``out`` (indexable int words) until the kernel is done (returns
    True) or ``cancel`` is set (returns False). ``check(seconds_since_progress)`` runs every
    CHECK_EVERY idle polls and raises on a dead or stalled kernel."""
    got, last_progress, idle = 0, time.monotonic(), 0
    while True:
        count = out[0]
        while got < count:
            if cancel is not None and cancel.is_set():
                return False
            token = out[2 + got]
            got += 1
            yield token
            last_progress = time.monotonic()
        if out[1] and got >= out[0]:
            return True
        if cancel is not None and cancel.is_set():
            return False
        idle += 1
        if idle % CHECK_EVERY == 0:
            check(time.monotonic() - last_progress)
            time.sleep(0)  # let other Python threads run
