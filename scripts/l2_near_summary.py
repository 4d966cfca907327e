"""Summarise scripts/l2_near_probe.cu's CSVs: which SMs share an L2 partition, which lines are
near which SMs, and what a far hit costs, idle and under load.

    python3 scripts/l2_near_summary.py IDLE.csv [LOADED.csv ...]

The idle run decides the grouping: the first principal component of the (SM x line) latency
matrix splits the SMs in two, and each line is near the group that reads it faster. Under
load the streaming adds variation over time (the SMs take turns), which a global component
would pick up instead, so the loaded runs reuse the idle grouping and compare near with far
lines within each SM.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np


def read(path: Path) -> tuple[np.ndarray, list[str], np.ndarray]:
    """SM ids [sms], column names [probes], cycles [sms, probes]."""
    with path.open() as f:
        rows = list(csv.reader(f))
    names = rows[0][1:]
    sms = np.array([int(r[0]) for r in rows[1:]])
    cycles = np.array([[float(v) for v in r[1:]] for r in rows[1:]])
    return sms, names, cycles


def grouping(cycles: np.ndarray, n_lines: int) -> tuple[np.ndarray, np.ndarray]:
    """(group of each SM row [sms] bool, line near group True [lines] bool)."""
    lat = cycles[:, :n_lines]
    u, _, _ = np.linalg.svd(lat - lat.mean(0), full_matrices=False)
    group = u[:, 0] > 0
    near_true = lat[group].mean(0) < lat[~group].mean(0)
    return group, near_true


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("idle", type=Path)
    ap.add_argument("loaded", type=Path, nargs="*")
    args = ap.parse_args()

    sms, names, cyc = read(args.idle)
    n_lines = sum(n.startswith("line") for n in names)
    group, near_true = grouping(cyc, n_lines)
    by_sm = dict(zip(sms.tolist(), group.tolist(), strict=True))
    print(f"SM groups: {group.sum()} / {(~group).sum()} SMs")
    print("  " + " ".join(str(s) for s in sorted(sms[group].tolist())))
    print(f"lines near the first group: {near_true.sum()} of {n_lines}; first 64 (1 = near it):")
    print("  " + "".join("1" if v else "0" for v in near_true[:64]))
    idx = np.arange(n_lines)
    lines = int(2 ** np.floor(np.log2(n_lines)))
    flips = [k for k in range(1, lines) if (near_true[:lines] != near_true[idx[:lines] ^ k]).all()]
    bits = sorted({k.bit_length() - 1 + 7 for k in flips if k & (k - 1) == 0})
    print(f"address bits whose toggle moves every line to the other partition: {bits}")

    print(f"{'run':<28} {'near':>6} {'far':>6} {'far-near p10/p50/p90':>22}  (cycles a hit)")
    for path in [args.idle, *args.loaded]:
        s, _, c = read(path)
        g = np.array([by_sm[x] for x in s.tolist()])
        lat = c[:, :n_lines]
        is_near = g[:, None] == near_true[None, :]
        near = np.array([lat[i][is_near[i]].mean() for i in range(len(s))])
        far = np.array([lat[i][~is_near[i]].mean() for i in range(len(s))])
        d = far - near
        p10, p50, p90 = np.percentile(d, [10, 50, 90])
        print(
            f"{path.name:<28} {near.mean():6.0f} {far.mean():6.0f} {p10:8.0f} {p50:6.0f} {p90:6.0f}"
        )


if __name__ == "__main__":
    main()
