"""The timing marks read as a stage profile (CPU), on a made-up step of a known clock."""

from __future__ import annotations

import pytest

from monokernel.kernels import layout
from monokernel.runtime.backends.monokernel.probes import stage_profile


def test_stage_profile_sums_each_stage_over_the_layers() -> None:
    L, ghz = 2, 1.5
    t = [0] * layout.mark_words(L)

    def put(name: str, value: int, layer: int = 0) -> None:
        t[layout.mark_slot(name, layer, L)] = value

    # Stage s of layer l works 100 * (s + 1) cycles, then waits 10 * (l + 1).
    c = 1000
    put("step.start", c)
    for layer in range(L):
        for s, (stage, _) in enumerate(layout.LAYER_STAGES):
            c += 100 * (s + 1)
            put(f"{stage}.work", c, layer)
            c += 10 * (layer + 1)
            put(f"{stage}.wait", c, layer)
    put("lm_head.work", c + 600)
    put("lm_head.wait", c + 650)
    put("sample.work", c + 680)
    cycles = c + 680 - 1000
    put("step.start_ns", 5_000)
    put("step.end_ns", 5_000 + round(cycles / ghz))
    got = stage_profile(t, L)
    assert got["clock_GHz"] == pytest.approx(ghz, rel=1e-3)
    us = 1e-3 / ghz  # µs a cycle
    for s, letter in enumerate("ABCDE"):
        assert got[f"{letter}.work"] == pytest.approx(L * 100 * (s + 1) * us, rel=1e-3)
        assert got[f"{letter}.wait"] == pytest.approx((10 + 20) * us, rel=1e-3)
    assert got["F.work"] == pytest.approx(600 * us, rel=1e-3)
    assert got["F.wait"] == pytest.approx(50 * us, rel=1e-3)
    assert got["S.work"] == pytest.approx(30 * us, rel=1e-3)
    assert got["total"] == pytest.approx(cycles * us, rel=1e-3)
