"""The kernel's per-step work split, mirrored from the CUDA sources so it can be checked on
the CPU: which CTAs attend (``attn_units``, from ``attn_plan`` in
``csrc/attention_window.cuh``) and how stage D's gate/up row pairs are shared between
preloading idle CTAs and streaming warps (``ffn_split``, ``csrc/ffn_preload.cuh``)."""

from __future__ import annotations

from dataclasses import dataclass

WARPS = 16  # MK_WARPS: 512 threads a CTA
ATTN_MIN_RANGE = 64  # MK_ATTN_MIN_RANGE


def attn_units(
    pos: int, grid: int, heads: int, kv_heads: int, chunk: int, group_from: int = 1 << 30
) -> int:
    """CTAs with an attention unit at position ``pos`` (CTAs 0 .. units - 1)."""
    n = pos + 1
    splits, group_splits = grid // heads, grid // kv_heads
    fit = -(-n // chunk)
    if splits == 0 or fit > splits or n >= group_from:
        return kv_heads * min(-(-n // ATTN_MIN_RANGE), group_splits)
    return heads * fit


@dataclass(frozen=True, slots=True)
class FfnSplit:
    pre: int  # pairs [0, pre) preloaded by idle CTAs, [pre, pairs) streamed
    blocks: tuple[tuple[int, int], ...]  # per idle CTA (in CTA order): (first pair, count)
    per_warp: int  # streamed pairs of the busiest warp


def ffn_split(pairs: int, grid: int, units: int, capacity: int) -> FfnSplit:
    """Stage D's split for ``pairs`` gate/up pairs, ``units`` attending CTAs of ``grid``, and
    ``capacity`` pairs of shared memory an idle CTA can fill."""
    idle, warps = grid - units, grid * WARPS
    none = FfnSplit(0, (), -(-pairs // warps))
    if capacity == 0 or idle <= 0:
        return none
    m = max(1, -(-(pairs - idle * capacity) // warps))
    pre = pairs - m * warps
    if pre <= 0:
        return none
    c, rem = divmod(pre, idle)
    blocks = tuple((i * c + min(i, rem), c + (1 if i < rem else 0)) for i in range(idle))
    return FfnSplit(pre, blocks, m)
