"""Merge bench results of several processes into one document.

``python -m monokernel.bench.merge OUT.json A.json B.json ...``

scripts/bench_all.sh runs the sweep as a few processes (each under its own time limit, so a
long cell that hangs or runs out of memory costs only its part); this joins them. Every cell
keeps the bandwidth and torch ratio of its own process, so nothing is recomputed across runs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from monokernel.bench.records import validate

# Environment fields that must agree for the runs to be comparable; clocks may differ.
_SAME = ("device", "torch", "cuda", "transformers", "monokernel")


def merge_results(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    if not docs:
        raise ValueError("nothing to merge")
    for d in docs:
        validate(d)
    out = copy.deepcopy(docs[0])
    out["runs"], out["cells"], out["skipped"] = [], [], []
    mismatches: list[str] = []
    for d in docs:
        offset = len(out["runs"])
        out["runs"].extend(copy.deepcopy(d["runs"]))
        out["cells"].extend(c | {"run": c["run"] + offset} for c in d["cells"])
        out["skipped"].extend(s | {"run": s.get("run", 0) + offset} for s in d["skipped"])
        for key in _SAME:
            if d["environment"].get(key) != out["environment"].get(key):
                mismatches.append(f"{key}: {d['environment'].get(key)!r}")
        if d["model"]["label"] != out["model"]["label"]:
            mismatches.append(f"model: {d['model']['label']!r}")
    if mismatches:
        out["environment_mismatch"] = sorted(set(mismatches))
    return out


def load(paths: Sequence[str]) -> dict[str, Any]:
    docs = []
    for p in paths:
        with open(p) as f:
            docs.append(json.load(f))
    return merge_results(docs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m monokernel.bench.merge", description=__doc__)
    ap.add_argument("out", help="merged JSON to write")
    ap.add_argument("inputs", nargs="+", help="bench JSON files (missing ones are skipped)")
    args = ap.parse_args(argv)
    present = [p for p in args.inputs if os.path.exists(p)]
    for p in sorted(set(args.inputs) - set(present)):
        print(
            f"note: {p} does not exist (that part did not run or write); left out", file=sys.stderr
        )
    if not present:
        print("no results to merge", file=sys.stderr)
        return 1
    merged = load(present)
    with open(args.out, "w") as f:
        json.dump(merged, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
