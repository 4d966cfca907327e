"""Stage B's plan as the host mirrors it (kernels/plan.py)."""

from __future__ import annotations

from monokernel.kernels.plan import attn_units


def test_head_units_while_ranges_fit_the_grid() -> None:
    assert attn_units(0, 132, 32, 8, 512) == 32
    assert attn_units(511, 132, 32, 8, 512) == 32
    assert attn_units(512, 132, 32, 8, 512) == 64
    assert attn_units(4 * 512 - 1, 132, 32, 8, 512) == 128


def test_group_units_past_the_grid_or_when_forced() -> None:
    assert attn_units(4 * 512, 132, 32, 8, 512) == 8 * 16  # 5 ranges a head do not fit
    assert attn_units(100, 132, 32, 8, 512, group_from=50) == 8 * 2  # 101 positions: 2 ranges
    assert attn_units(5, 20, 32, 8, 512) == 8  # more heads than CTAs: group units only
