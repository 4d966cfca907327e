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


def test_group_units_ranges_of_at_least_the_builds_min_range_up_to_the_grid() -> None:
    # Qwen2.5-Coder-32B on 132 SMs: 8 KV heads, at most 16 ranges each; head units cover 288.
    assert attn_units(575, 132, 40, 8, 96) == 8 * 9  # 576 positions in ranges of >= 64
    assert attn_units(575, 132, 40, 8, 96, min_range=32) == 8 * 16  # 18 ranges: the grid's 16
    assert attn_units(100, 132, 32, 8, 512, group_from=50, min_range=16) == 8 * 7


def test_short_head_ranges_up_to_what_the_reader_merges_and_the_grid_holds() -> None:
    # Qwen2.5-Coder-1.5B on 132 SMs: 12 heads, window 320, C merges up to 5 ranges.
    assert attn_units(63, 132, 12, 2, 320, head_range=64, merge_ns=5) == 12
    assert attn_units(64, 132, 12, 2, 320, head_range=64, merge_ns=5) == 24
    assert attn_units(1000, 132, 12, 2, 320, head_range=64, merge_ns=5) == 12 * 5
    # Llama-3.2-1B: 32 heads, so 4 ranges a head fill the grid whatever the reader holds.
    assert attn_units(300, 132, 32, 8, 512, head_range=64, merge_ns=8) == 128
    # The window still decides where it needs more ranges than short ones would give.
    assert attn_units(1000, 132, 12, 2, 128, head_range=512, merge_ns=5) == 12 * 8
