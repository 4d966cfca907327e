"""Who is late in a layer: every CTA's global time at the ends of the stages of one layer
(GPU machine; a build with -DMK_SKEW=1, csrc/probes.cuh's skew()).

    PYTHONPATH=src python3 tools/stage_skew.py --shape qwen2.5-coder-1.5b \\
        --variant base= --variant dpre1=-DMK_D_PRE=1 [--quantize int4] [--json skew.json]

For the middle layer of one decode step, prints per point (kernels/layout.py SKEW_NAMES: each
stage's input loaded, each stage's output written, and three points inside a head unit) the
spread over the CTAs with an attention unit and over the others, in µs from the earliest
first point.
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
from monokernel.weights.quantize import QUANTIZE_METHODS
from monokernel.weights.random_weights import random_weights


def _skew(backend: MonokernelBackend, prompt: list[int], steps: int, step: int) -> list[list[int]]:
    """Each CTA's global times (ns; 0 where it never got there) at layout.SKEW_NAMES."""
    layers = backend.cfg.num_layers
    t = backend.timed_run(prompt, steps, step, skew=True)
    return [
        [t[layout.skew_slot(layers, cta, name)] for name in layout.SKEW_NAMES]
        for cta in range(backend.grid)
    ]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="qwen2.5-coder-1.5b")
    ap.add_argument("--variant", action="append", default=[], help="NAME=NVCC_FLAGS")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--step", type=int, default=128)
    ap.add_argument("--quantize", choices=QUANTIZE_METHODS, help="the layers' weight format")
    ap.add_argument("--json", dest="json_file", help="every CTA's times (ns), by variant")
    args = ap.parse_args(argv)
    cfg = SHAPES[args.shape]
    device = torch.device("cuda")
    weights = random_weights(cfg, device=device, seed=0)
    prompt = list(range(1, args.prompt_tokens + 1))
    raw: dict[str, list[list[int]]] = {}
    for v in args.variant or ["default="]:
        name, flags = v.split("=", 1)
        with envs.overridden(MONOKERNEL_NVCC_FLAGS=f"-DMK_SKEW=1 {flags}".strip()):
            b = MonokernelBackend(
                cfg,
                weights,
                args.prompt_tokens + args.step + 2,
                device,
                handoff_search=0,
                quantize=args.quantize,
            )
            dims = kbuild.KernelDims.from_config(cfg)  # flags may set the window and range
            chunk, head_range, merge_ns = (
                dims.built_attn_chunk(),
                dims.built_attn_range(),
                dims.merge_ranges(),
            )
        _skew(b, prompt, args.step + 1, args.step)  # warm-up
        rows = _skew(b, prompt, args.step + 1, args.step)
        raw[name] = rows
        pos = args.prompt_tokens + args.step
        units = attn_units(
            pos,
            b.grid,
            cfg.num_heads,
            cfg.num_kv_heads,
            chunk,
            head_range=head_range,
            merge_ns=merge_ns,
        )
        t0 = min(r[0] for r in rows)
        print(
            f"\n{args.shape} {name} ({flags or 'no flags'}): layer {cfg.num_layers // 2}, "
            f"position {pos}, {units} CTAs attend of {b.grid}; µs from the first "
            f"'{layout.SKEW_NAMES[0]}'"
        )
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
        b.close()
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(
                {
                    "shape": args.shape,
                    "quantize": args.quantize,
                    "points": list(layout.SKEW_NAMES),
                    "ctas": raw,
                },
                f,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
