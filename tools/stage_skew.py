"""Who is late in a layer: every CTA's global time at the ends of the stages of one layer
(GPU machine; a build with -DMK_SKEW=1, csrc/probes.cuh's skew()).

    PYTHONPATH=src python3 tools/stage_skew.py --shape qwen2.5-coder-1.5b \\
        --variant base= --variant dpre1=-DMK_D_PRE=1 [--quantize int4] [--json skew.json] \\
        [--tp 2]

For the middle layer of one decode step, prints per point (kernels/layout.py SKEW_NAMES: each
stage's input loaded, each stage's output written, and three points inside a head unit) the
spread over the CTAs with an attention unit and over the others, in µs from the earliest
first point. With ``--tp N`` every rank of a tensor-parallel request is shown apart, each
from its own first point (the GPUs' global timers are not aligned).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from monokernel import envs
from monokernel.kernels import build as kbuild
from monokernel.kernels import layout
from monokernel.kernels.plan import attn_units
from monokernel.models.shapes import SHAPES
from monokernel.runtime.backends.monokernel import MonokernelBackend
from monokernel.runtime.backends.monokernel.tp import MonokernelTPBackend
from monokernel.weights.quantize import QUANTIZE_METHODS
from monokernel.weights.random_weights import random_weights


def _skew_rows(t: list[int], layers: int, grid: int) -> list[list[int]]:
    """Each CTA's global times (ns; 0 where it never got there) at layout.SKEW_NAMES, from
    one GPU's timing slots ``t``."""
    return [
        [t[layout.skew_slot(layers, cta, name)] for name in layout.SKEW_NAMES]
        for cta in range(grid)
    ]


def _timed(
    b: MonokernelBackend | MonokernelTPBackend, tp: int, prompt: list[int], step: int
) -> list[list[int]]:
    """Each GPU's timing slots of step ``step`` of a greedy run (a list per rank)."""
    t = b.timed_run(prompt, step + 1, step, skew=True)
    return t if tp > 1 else [t]


def _print(rows: list[list[int]], units: int, title: str) -> None:
    t0 = min(r[0] for r in rows)
    print(f"\n{title}; µs from the first '{layout.SKEW_NAMES[0]}'")
    print(f"{'point':<20} {'attend min/med/max':>24} {'idle min/med/max':>24}")
    for k, point in enumerate(layout.SKEW_NAMES):
        cells = []
        for group in (rows[:units], rows[units:]):
            us = [(r[k] - t0) / 1e3 for r in group if r[k]]  # 0: the CTA never got there
            if not us:
                cells.append(f"{'-':>24}")
                continue
            cells.append(f"{min(us):>7.2f} {statistics.median(us):>7.2f} {max(us):>7.2f}  ")
        print(f"{point:<20} {cells[0]} {cells[1]}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="qwen2.5-coder-1.5b")
    ap.add_argument("--variant", action="append", default=[], help="NAME=NVCC_FLAGS")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--step", type=int, default=128)
    ap.add_argument("--quantize", choices=QUANTIZE_METHODS, help="the layers' weight format")
    ap.add_argument("--tp", type=int, default=1, help="GPUs a request runs on (each rank apart)")
    ap.add_argument("--json", dest="json_file", help="every CTA's times (ns), by variant")
    args = ap.parse_args(argv)
    cfg = SHAPES[args.shape]
    device = torch.device("cuda")
    # --tp shards from the host, as the engine does (drawn on the GPU, kept on the host).
    store = "cpu" if args.tp > 1 else None
    weights = random_weights(cfg, device=device, seed=0, store=store)
    prompt = list(range(1, args.prompt_tokens + 1))
    raw: dict[str, list[list[list[int]]]] = {}
    max_len = args.prompt_tokens + args.step + 2
    pos = args.prompt_tokens + args.step
    for v in args.variant or ["default="]:
        name, flags = v.split("=", 1)
        with envs.overridden(MONOKERNEL_NVCC_FLAGS=f"-DMK_SKEW=1 {flags}".strip()):
            if args.tp > 1:
                b = MonokernelTPBackend(cfg, weights, max_len, device, args.tp, args.quantize)
                ranks = [(rk.cfg, rk.kernel.grid) for rk in b.ranks]
            else:
                b = MonokernelBackend(
                    cfg, weights, max_len, device, handoff_search=0, quantize=args.quantize
                )
                ranks = [(cfg, b.grid)]
            # Each rank's attention plan (the flags may set the window and range).
            plans = []
            for rcfg, _ in ranks:
                dims = kbuild.KernelDims.from_config(rcfg)
                plan = (
                    dims.built_attn_chunk(),
                    dims.built_attn_range(),
                    dims.merge_ranges(),
                    dims.built_attn_min_range(),
                )
                plans.append(plan)
        _timed(b, args.tp, prompt, args.step)  # warm-up
        per_rank = [
            _skew_rows(t, rcfg.num_layers, grid)
            for t, (rcfg, grid) in zip(_timed(b, args.tp, prompt, args.step), ranks, strict=True)
        ]
        raw[name] = per_rank
        for r, (rows, (rcfg, grid), plan) in enumerate(zip(per_rank, ranks, plans, strict=True)):
            chunk, head_range, merge_ns, min_range = plan
            units = attn_units(
                pos,
                grid,
                rcfg.num_heads,
                rcfg.num_kv_heads,
                chunk,
                head_range=head_range,
                merge_ns=merge_ns,
                min_range=min_range,
            )
            rank = f", rank {r} of {args.tp}" if args.tp > 1 else ""
            _print(
                rows,
                units,
                f"{args.shape} {name} ({flags or 'no flags'}{rank}): layer "
                f"{cfg.num_layers // 2}, position {pos}, {units} CTAs attend of {grid}",
            )
        b.close()
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(
                {
                    "shape": args.shape,
                    "quantize": args.quantize,
                    "tp": args.tp,
                    "points": list(layout.SKEW_NAMES),
                    "ctas": raw,  # by variant, then rank, then CTA
                },
                f,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
