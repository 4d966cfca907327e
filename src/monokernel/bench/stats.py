"""Order statistics of a few timed repeats: median and the p10/p90 spread."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), interpolating linearly between order statistics.

    This is numpy's default ("linear") rule, written out so the bench needs no numpy and the
    numbers in the JSON can be checked by hand: with n values sorted, position
    ``(n - 1) * q / 100`` between the two neighbours."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """``{"median", "p10", "p90"}`` of ``values``; with 2-3 repeats p10/p90 sit between the
    extremes, so they show the spread without pretending to be tail latencies."""
    return {
        "median": percentile(values, 50),
        "p10": percentile(values, 10),
        "p90": percentile(values, 90),
    }
