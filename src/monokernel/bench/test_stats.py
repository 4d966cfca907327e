"""The order statistics the bench reports, on lists whose answers are known by hand."""

from __future__ import annotations

import pytest

from monokernel.bench.stats import percentile, summarize


def test_percentiles_interpolate_linearly() -> None:
    xs = [float(v) for v in range(1, 11)]  # 1..10: position (n-1)*q/100 = 9q/100
    assert percentile(xs, 50) == pytest.approx(5.5)
    assert percentile(xs, 10) == pytest.approx(1.9)
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 10.0


def test_order_does_not_matter_and_odd_counts_hit_the_middle() -> None:
    assert summarize([3.0, 1.0, 2.0]) == pytest.approx({"median": 2.0, "p10": 1.2, "p90": 2.8})
    assert summarize([7.0]) == {"median": 7.0, "p10": 7.0, "p90": 7.0}
    # Two repeats: the spread sits inside the pair.
    assert summarize([10.0, 20.0]) == pytest.approx({"median": 15.0, "p10": 11.0, "p90": 19.0})


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)
