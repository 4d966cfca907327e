"""Stage B's plan, mirrored from ``attn_plan`` in ``csrc/attention_window.cuh`` so host code
(the stage-skew probe, tests) knows which CTAs attend at a position without a GPU."""

from __future__ import annotations

ATTN_MIN_RANGE = 64  # MK_ATTN_MIN_RANGE: group units' fewest positions per range


def attn_units(
    pos: int, grid: int, heads: int, kv_heads: int, chunk: int, group_from: int = 1 << 30
) -> int:
    """CTAs with an attention unit at position ``pos`` (CTAs 0 .. units - 1): head units
    (heads x ranges of ``chunk`` positions) while they fit the grid, else group units."""
    n = pos + 1
    splits, group_splits = grid // heads, grid // kv_heads
    fit = -(-n // chunk)
    if splits == 0 or fit > splits or n >= group_from:
        return kv_heads * min(-(-n // ATTN_MIN_RANGE), group_splits)
    return heads * fit
