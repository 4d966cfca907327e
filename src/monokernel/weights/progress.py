"""A bytes progress bar for loading weights, then one summary line; a note for slow steps.

The bar is tqdm, as for the default model's download (``weights/default_model.py``), so
the two look alike. It shows only where someone watches (stderr is a terminal) unless a
caller forces it: tests and servers whose stderr is a log stay quiet.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from types import TracebackType
from typing import TextIO

# A step that ends sooner goes unannounced: a line per fast step would be noise.
SLOW_STEP_S = 1.0


def progress_wanted(progress: bool, force: bool = False, stream: TextIO | None = None) -> bool:
    """Whether to draw: forced, or asked for and ``stream`` (default stderr) is a terminal."""
    if force:
        return True
    out = stream if stream is not None else sys.stderr
    isatty = getattr(out, "isatty", None)
    return progress and callable(isatty) and bool(isatty())


def format_bytes(n: float) -> str:
    """Decimal units, as disks and HF's shard sizes count: ``16.1 GB``, ``19.1 MB``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def format_seconds(s: float) -> str:
    """``12.3 s``; small models load in well under a second, where one decimal says 0.0."""
    return f"{s:.1f} s" if s >= 1 else f"{s:.3f} s"


def summary_line(nbytes: int, seconds: float, shards: int) -> str:
    """``loaded 16.1 GB in 12.3 s (1.31 GB/s) from 4 shards``."""
    rate = nbytes / seconds if seconds > 0 else 0.0
    return (
        f"loaded {format_bytes(nbytes)} in {format_seconds(seconds)} ({rate / 1e9:.2f} GB/s) "
        f"from {shards} shard{'' if shards == 1 else 's'}"
    )


class ByteProgress:
    """Count bytes as they load; on a clean exit, replace the bar by the summary line.

    Disabled, it only counts, so callers need no second code path.
    """

    def __init__(self, total: int, desc: str, enabled: bool, stream: TextIO | None = None):
        self.total = total
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.start = time.perf_counter()
        self._bar = None
        if enabled:
            from tqdm import tqdm

            # leave=False: the summary line is the record; a finished bar beside it is noise.
            self._bar = tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                desc=desc,
                file=self.stream,
                leave=False,
                dynamic_ncols=True,
            )

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        if self._bar is not None:
            self._bar.update(nbytes)

    def note(self, text: str) -> None:
        """Text after the bar, e.g. which shard is being read."""
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)

    def finish(self, shards: int, seconds: float | None = None) -> str:
        """Close the bar and print the summary line when enabled; returns the line."""
        elapsed = time.perf_counter() - self.start if seconds is None else seconds
        line = summary_line(self.done, elapsed, shards)
        self.close()
        if self.enabled:
            print(line, file=self.stream, flush=True)
        return line

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ByteProgress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # On an error the bar goes without a summary: the exception is the message.
        self.close()


@contextlib.contextmanager
def slow_step(
    note: str, enabled: bool = True, after_s: float = SLOW_STEP_S, stream: TextIO | None = None
) -> Iterator[None]:
    """Print ``note...`` (one line) if the step inside is still running after ``after_s``.

    A start's slow steps (dequantising a GGUF, converting its tokenizer) would otherwise
    leave the terminal silent for seconds; the same steps on a small file are instant and
    say nothing. The note goes to stderr even when it is a log, unlike the bar: a server's
    log should show where its start spends its time too.
    """
    if not enabled:
        yield
        return
    out = stream if stream is not None else sys.stderr
    timer = threading.Timer(after_s, lambda: print(f"{note}...", file=out, flush=True))
    timer.daemon = True  # never keep the process alive for a note
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
