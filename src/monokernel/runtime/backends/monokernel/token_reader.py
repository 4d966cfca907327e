"""Reading the tokens a running monokernel publishes in host-mapped memory.

The kernel writes token i as ``out[2 + i] = i's id + 1`` (the words are zeroed before the
launch, so nonzero means written), the count to ``out[0]``, and sets ``out[1]`` when it
stops by itself, after a system-scope fence that makes every token word visible first. The
host polls the next token's word itself without sleeping, so a token reaches the consumer a
few microseconds after the kernel wrote it, and the kernel needs no fence per token. Shared
by the single-GPU and tensor-parallel backends.
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
    CHECK_EVERY idle polls and raises on a dead or stalled kernel. ``out`` holds at least one
    word past the last token the launch can write (it stays 0)."""
    got, last_progress, idle = 0, time.monotonic(), 0
    while True:
        word = out[2 + got]
        while word:
            if cancel is not None and cancel.is_set():
                return False
            got += 1
            yield word - 1
            last_progress = time.monotonic()
            word = out[2 + got]
        if out[1]:  # fenced after every token word: re-read the next one before stopping
            if not out[2 + got]:
                return True
            continue
        if cancel is not None and cancel.is_set():
            return False
        idle += 1
        if idle % CHECK_EVERY == 0:
            check(time.monotonic() - last_progress)
            time.sleep(0)  # let other Python threads run
