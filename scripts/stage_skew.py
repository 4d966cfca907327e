"""Who is late in a layer: every CTA's global time at the ends of the stages of one layer
(GPU machine; a build with -DMK_SKEW=1, decode.cu's skew()).

    PYTHONPATH=src python3 scripts/stage_skew.py --shape qwen2.5-coder-1.5b \
        --variant base= --variant late=-DMK_FLOW=0 --variant inside=-DMK_SKEW_B=1

For the middle layer of one decode step, prints per point (each stage's input loaded, each
stage's output written) the spread over the CTAs with an attention unit and over the others,
in µs from the earliest "A input".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from monokernel.bench.shapes import SHAPES, random_weights
from monokernel.kernels import build as kbuild
from monokernel.kernels.plan import attn_units
from monokernel.runtime.backends.monokernel import MonokernelBackend

POINTS = (
    "A input",
    "A done",
    "B done",
    "C input",
    "C done",
    "D input",
    "D done",
    "E input",
    "E done",
    "B qkv+win",  # head units only: q, k, v and the K/V window in shared memory
    "B scores",
    "B softmax",
)
SLOTS = 12  # MK_SKEW_POINTS in csrc/probes.cuh
# With -DMK_SKEW_B=1 slots 3-8 hold points inside a head unit instead (csrc/probes.cuh skew_b,
# attention.cuh): where an attention unit's time goes.
POINTS_B = (
    *POINTS[:3],
    "B appended",  # the new position's K/V written to the cache
    "B scored",  # this thread's score passes done (before the CTA barrier)
    "B P.V loop",  # this thread's P·V weights and products done
    "B exp-sums",  # after the barrier, the P·V groups' exp-sums added
    "B stored",  # the range's partial output stored (reader merge)
    "B barrier",  # the unit's last CTA barrier passed
    *POINTS[9:],
)


def _skew(backend: MonokernelBackend, prompt: list[int], steps: int, step: int) -> list[list[int]]:
    L, grid = backend.cfg.num_layers, backend.grid
    t = backend.timed_run(prompt, steps, step, extra=SLOTS * grid)[10 * L + 8 :]
    return [t[SLOTS * c : SLOTS * c + len(POINTS)] for c in range(grid)]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="qwen2.5-coder-1.5b")
    ap.add_argument("--variant", action="append", default=[], help="NAME=NVCC_FLAGS")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--step", type=int, default=128)
    args = ap.parse_args(argv)
    cfg = SHAPES[args.shape]
    device = torch.device("cuda")
    weights = random_weights(cfg, device=device, seed=0)
    prompt = list(range(1, args.prompt_tokens + 1))
    for v in args.variant or ["default="]:
        name, flags = v.split("=", 1)
        os.environ["MONOKERNEL_NVCC_FLAGS"] = f"-DMK_SKEW=1 {flags}".strip()
        b = MonokernelBackend(
            cfg, weights, args.prompt_tokens + args.step + 2, device, handoff_search=0
        )
        _skew(b, prompt, args.step + 1, args.step)  # warm-up
        rows = _skew(b, prompt, args.step + 1, args.step)
        pos = args.prompt_tokens + args.step
        dims = kbuild.KernelDims.from_config(cfg)  # flags may set the window and range
        units = attn_units(
            pos,
            b.grid,
            cfg.num_heads,
            cfg.num_kv_heads,
            dims.built_attn_chunk(),
            head_range=dims.built_attn_range(),
            merge_ns=dims.merge_ranges(),
        )
        t0 = min(r[0] for r in rows)
        print(
            f"\n{args.shape} {name} ({flags or 'no flags'}): layer {cfg.num_layers // 2}, "
            f"position {pos}, {units} CTAs attend of {b.grid}; µs from the first 'A input'"
        )
        print(f"{'point':<11} {'attend min/med/max':>24} {'idle min/med/max':>24}")
        for k, point in enumerate(POINTS_B if "MK_SKEW_B" in flags else POINTS):
            cells = []
            for group in (rows[:units], rows[units:]):
                us = [(r[k] - t0) / 1e3 for r in group if r[k]]  # 0: the CTA never got there
                if not us:
                    cells.append(f"{'-':>24}")
                    continue
                cells.append(f"{min(us):>7.2f} {statistics.median(us):>7.2f} {max(us):>7.2f}  ")
            print(f"{point:<11} {cells[0]} {cells[1]}")
        b.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
