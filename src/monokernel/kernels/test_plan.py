"""The per-step work split (kernels/plan.py, mirroring csrc/ffn_preload.cuh): every gate/up
pair is computed exactly once, preloads fit the idle CTAs' shared memory, and every warp
keeps a streamed pair (flow.cuh's no-race argument needs an act row from every CTA)."""

from __future__ import annotations

import pytest

from monokernel.bench.shapes import SHAPES
from monokernel.kernels import build as kbuild
from monokernel.kernels.plan import WARPS, attn_units, ffn_split


def _owners(pairs: int, grid: int, units: int, capacity: int) -> tuple[list[int], int]:
    f = ffn_split(pairs, grid, units, capacity)
    seen = [0] * pairs
    for lo, n in f.blocks:
        assert n <= capacity
        for q in range(lo, lo + n):
            seen[q] += 1
    warps = grid * WARPS
    busiest = 0
    for gw in range(warps):  # streamed: pair pre + gw + k * warps
        mine = range(f.pre + gw, pairs, warps)
        assert len(mine) >= 1 or pairs < warps  # fewer pairs than warps: nothing to share
        busiest = max(busiest, len(mine))
        for q in mine:
            seen[q] += 1
    return seen, busiest


@pytest.mark.parametrize(
    ("pairs", "grid", "units", "capacity"),
    [
        (8192, 132, 32, 20),
        (8960, 132, 12, 27),
        (8960, 132, 24, 27),
        (8192, 132, 64, 20),
        (4480, 132, 6, 40),
        (8192, 132, 132, 20),
        (1003, 7, 3, 5),
        (97, 3, 1, 50),
        (2048, 132, 0, 0),
        (5000, 114, 40, 9),
    ],
)
def test_every_pair_once_and_streams_balanced(
    pairs: int, grid: int, units: int, capacity: int
) -> None:
    seen, busiest = _owners(pairs, grid, units, capacity)
    assert seen == [1] * pairs
    f = ffn_split(pairs, grid, units, capacity)
    assert busiest == f.per_warp
    # never worse than streaming everything, and better whenever the idle CTAs can take up
    # the excess over a whole number of pairs per warp
    plain = -(-pairs // (grid * WARPS))
    assert f.per_warp <= plain
    idle = grid - units
    if plain > 1 and idle * capacity >= pairs - (plain - 1) * grid * WARPS:
        assert f.per_warp < plain


def test_real_shapes_preload_at_short_context() -> None:
    for name, pairs_expected in (("llama-3.2-1b", 3), ("qwen2.5-coder-1.5b", 3)):
        cfg = SHAPES[name]
        dims = kbuild.KernelDims.from_config(cfg)
        units = attn_units(300, 132, cfg.num_heads, cfg.num_kv_heads, dims.attn_chunk())
        f = ffn_split(cfg.intermediate_size, 132, units, dims.pre_pairs())
        assert f.per_warp == pairs_expected  # from 4 (Llama) and 5 (Qwen) without preload
        assert f.pre * 2 * cfg.hidden_size * 2 <= (132 - units) * 227 * 1024


def test_attention_units_follow_the_plan() -> None:
    assert attn_units(0, 132, 32, 8, 512) == 32
    assert attn_units(511, 132, 32, 8, 512) == 32
    assert attn_units(512, 132, 32, 8, 512) == 64
    assert attn_units(2048, 132, 32, 8, 512) == 8 * 16  # group units past 4 ranges
    assert attn_units(100, 132, 32, 8, 512, group_from=50) == 8 * 2
    assert attn_units(5, 20, 32, 8, 512) == 8  # more heads than CTAs: group units
