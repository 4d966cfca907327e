"""Build the kernel for several named shapes at once (nvcc runs in parallel), e.g. before a
test run: ``python -m monokernel.kernels.prebuild llama-3.2-1b odd``.

Both builds the backend loads (with and without group units) are made. ``--flags`` (once
per set, written with "=" since a set starts with "-": ``--flags= --flags=-DMK_FLOW_SLEEP=300``)
builds each shape again with those tuning defines, as MONOKERNEL_NVCC_FLAGS would at run
time: the cubins' cache keys do not depend on the machine, so a cache filled on a CPU
machine with the same nvcc can travel to the GPU machine (``MONOKERNEL_CACHE``) and save it
the compile time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from monokernel.bench.shapes import SHAPES
from monokernel.kernels.build import KernelDims, build


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("shapes", nargs="*", help=f"default: all of {', '.join(sorted(SHAPES))}")
    ap.add_argument("--flags", action="append", help="MONOKERNEL_NVCC_FLAGS (repeatable)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    unknown = [n for n in args.shapes if n not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(unknown)}; choose from {', '.join(sorted(SHAPES))}")
    names = args.shapes or sorted(SHAPES)
    os.environ.setdefault("MONOKERNEL_VERBOSE_BUILD", "1")
    dims = [KernelDims.from_config(SHAPES[n]) for n in names]
    jobs = [(n, dataclasses.replace(d, group_units=g)) for n, d in zip(names, dims, strict=True)
            for g in (True, False)]  # fmt: skip
    saved = os.environ.get("MONOKERNEL_NVCC_FLAGS")

    def one(job: tuple[str, KernelDims]) -> str:
        t0 = time.perf_counter()
        path = build(job[1])
        kind = "group units" if job[1].group_units else "head units only"
        return f"{job[0]} ({kind}): {path} ({time.perf_counter() - t0:.1f} s)"

    try:
        for flags in args.flags or [saved or ""]:
            os.environ["MONOKERNEL_NVCC_FLAGS"] = flags  # read by build(): one set at a time
            print(f"flags: {flags!r}")
            with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
                for line in pool.map(one, jobs):
                    print(line)
    finally:
        if saved is None:
            os.environ.pop("MONOKERNEL_NVCC_FLAGS", None)
        else:
            os.environ["MONOKERNEL_NVCC_FLAGS"] = saved
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
