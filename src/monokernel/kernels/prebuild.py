"""Build the kernel for several named shapes at once (nvcc runs in parallel), e.g. before a
test run: ``python -m monokernel.kernels.prebuild llama-3.2-1b odd``.

Both builds the backend loads (with and without group units) are made. ``--flags`` (once
per set, written with "=" since a set starts with "-": ``--flags= --flags=-DMK_D_PRE=1``)
builds each shape again with those tuning defines, as MONOKERNEL_NVCC_FLAGS would at run
time: the cubins' cache keys do not depend on the machine, so a cache filled on a CPU
machine with the same nvcc can travel to the GPU machine (``MONOKERNEL_CACHE``) and save it
the compile time.

``--from-log FILE`` builds what a run logged with MONOKERNEL_BUILD_LOG=FILE asked for
(every dimension, flag set and debug switch as it was): the GPU test stages of
scripts/gpu_check.sh and scripts/tp_check.sh log to OUTDIR/builds.jsonl, so the next call's
kernels can be compiled here first (``--from-log builds.jsonl``) and carried in the cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from monokernel import envs
from monokernel.errors import UnsupportedModelError
from monokernel.kernels.build import KernelDims, build, read_build_log
from monokernel.models.config import ModelConfig
from monokernel.models.shapes import SHAPES
from monokernel.weights.formats.int4 import DEFAULT_GROUP
from monokernel.weights.shard import check_tp, rank_config, shard_config


def _rank_dims(cfg: ModelConfig, tp: int, rank: int) -> KernelDims:
    """Rank ``rank``'s build of a request over ``tp`` GPUs (its heads, intermediate and
    vocabulary rows; the TP backend's kernel_dims), or the one-GPU build."""
    if tp == 1:
        return KernelDims.from_config(cfg)
    check_tp(cfg, tp)
    rc = rank_config(shard_config(cfg, rank, tp))
    return dataclasses.replace(KernelDims.from_config(rc), tp=tp, vocab_all=cfg.vocab_size)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("shapes", nargs="*", help=f"default: all of {', '.join(sorted(SHAPES))}")
    ap.add_argument("--flags", action="append", help="MONOKERNEL_NVCC_FLAGS (repeatable)")
    ap.add_argument(
        "--formats",
        default="bf16",
        help="comma-separated layer weight formats to build each shape for (e.g. "
        "bf16,fp8,int8,int4,int4:32; int4 is in groups of 128 columns unless :GROUP says); "
        "a shape whose rows are not whole loads in a format is skipped for it",
    )
    ap.add_argument(
        "--positions",
        type=int,
        default=1,
        help="positions a verify pass computes (1: the decode step's build; docs/speculative.md)",
    )
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="GPUs a request runs on: each rank's build of a tensor-parallel request",
    )
    ap.add_argument(
        "--from-log",
        type=Path,
        help="also build every request a MONOKERNEL_BUILD_LOG file holds (alone: only those)",
    )
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    unknown = [n for n in args.shapes if n not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(unknown)}; choose from {', '.join(sorted(SHAPES))}")
    logged: list[tuple[KernelDims, str, bool]] = []
    if args.from_log is not None:
        try:
            logged = read_build_log(args.from_log)
        except (OSError, ValueError) as e:
            ap.error(f"--from-log: {e}")
    names = args.shapes or ([] if logged else sorted(SHAPES))
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    jobs: list[tuple[str, KernelDims]] = []
    for n in names:
        for fmt in formats:
            name, _, group = fmt.partition(":")
            g = int(group or DEFAULT_GROUP) if name == "int4" else 0
            try:
                ranks = {  # one build where the ranks' shapes agree
                    dataclasses.replace(
                        _rank_dims(SHAPES[n], args.tp, r),
                        weight_format=name,
                        weight_group=g,
                        positions=args.positions,
                    )
                    for r in range(args.tp)
                }
                for d in ranks:
                    d.check_formats()
            except UnsupportedModelError as e:
                print(f"{n} {fmt}: skipped ({e})")
                continue
            label = n if fmt == "bf16" else f"{n} {fmt}"
            label += f" tp{args.tp}" if args.tp > 1 else ""
            jobs += [
                (label, dataclasses.replace(d, group_units=u)) for d in ranks for u in (True, False)
            ]

    def one(job: tuple[str, KernelDims], debug: bool | None) -> str:
        t0 = time.perf_counter()
        path = build(job[1], debug)
        kind = "group units" if job[1].group_units else "head units only"
        return f"{job[0]} ({kind}): {path} ({time.perf_counter() - t0:.1f} s)"

    # Verbose unless the caller said otherwise.
    verbose = {} if envs.is_set("MONOKERNEL_VERBOSE_BUILD") else {"MONOKERNEL_VERBOSE_BUILD": "1"}
    # build() reads the flags from the environment: one set at a time. The logged requests
    # go with their own flags and debug switch, and are not logged again.
    sets: dict[tuple[str, bool | None], list[tuple[str, KernelDims]]] = {}
    if jobs:
        for flags in args.flags or [envs.MONOKERNEL_NVCC_FLAGS]:
            sets.setdefault((flags, None), []).extend(jobs)  # debug: the setting's
    for dims, flags, debug in logged:
        label = f"logged {dims.hidden}x{dims.intermediate} {dims.weight_format} P{dims.positions}"
        sets.setdefault((flags, debug), []).append((label, dims))
    for (flags, debug), todo in sets.items():
        with envs.overridden(MONOKERNEL_NVCC_FLAGS=flags, MONOKERNEL_BUILD_LOG=None, **verbose):
            print(f"flags: {flags!r}" + (" (debug)" if debug else ""))
            with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
                for line in pool.map(one, todo, [debug] * len(todo)):
                    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
