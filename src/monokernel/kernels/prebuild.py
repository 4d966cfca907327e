"""Build the kernel for several named shapes at once (nvcc runs in parallel), e.g. before a
test run: ``python -m monokernel.kernels.prebuild llama-3.2-1b odd``."""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from monokernel.bench.shapes import SHAPES
from monokernel.kernels.build import KernelDims, build


def main(argv: list[str]) -> int:
    names = argv or sorted(SHAPES)
    os.environ.setdefault("MONOKERNEL_VERBOSE_BUILD", "1")

    def one(name: str) -> str:
        t0 = time.perf_counter()
        path = build(KernelDims.from_config(SHAPES[name]))
        return f"{name}: {path} ({time.perf_counter() - t0:.1f} s)"

    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        for line in pool.map(one, names):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
