"""Stage B's plan, mirrored from ``attn_plan`` in ``csrc/attention_window.cuh`` so host code
(the stage-skew probe, tests) knows which CTAs attend at a position without a GPU."""

from __future__ import annotations

# Group units' fewest positions a range by default (build.py attn_min_range, MK_ATTN_MIN_RANGE).
ATTN_MIN_RANGE = 64


def head_units_fit(n: int, chunk: int, splits: int) -> bool:
    """Whether head units cover ``n`` positions: each range within the ``chunk``-position
    window and heads x ranges within the grid (``splits`` = grid // heads; 0: never)."""
    return splits > 0 and -(-n // chunk) <= splits


def attn_units(
    pos: int,
    grid: int,
    heads: int,
    kv_heads: int,
    chunk: int,
    group_from: int = 1 << 30,
    head_range: int = 0,
    merge_ns: int = 1,
    min_range: int = ATTN_MIN_RANGE,
) -> int:
    """CTAs with an attention unit at position ``pos`` (CTAs 0 .. units - 1): head units
    (heads x ranges of ``chunk`` positions) while they fit the grid, else group units.
    ``head_range`` > 0 (MK_ATTN_RANGE): head units split a head into ranges of about that
    many positions even where one fits the window, up to ``merge_ns`` (kMergeNs, layout.py
    MERGE_NS) and grid // heads ranges; group units take ranges of at least ``min_range``
    positions (MK_ATTN_MIN_RANGE)."""
    n = pos + 1
    splits = grid // heads
    if not head_units_fit(n, chunk, splits) or n >= group_from:
        return kv_heads * min(-(-n // min_range), grid // kv_heads)
    ns = -(-n // chunk)
    if head_range > 0:
        ns = max(ns, min(-(-n // head_range), merge_ns, splits))
    return heads * ns
