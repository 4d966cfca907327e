"""The text table of a bench result; ``python -m monokernel.bench.table RESULTS.json``.

The first line starts with ``device:``, the header with ``engine`` and every row with the
engine's name: scripts/gpu_check.sh greps for exactly those line starts. A turn cell
(``--turn-tokens``) shows its prompt as ``base+new``, e.g. ``16384+500``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from monokernel.bench.records import prompt_label, validate


def _engine_order(cells: list[dict[str, Any]]) -> dict[str, int]:
    order: dict[str, int] = {}
    for c in cells:
        order.setdefault(c["engine"], len(order))
    return order


def _device_line(doc: dict[str, Any]) -> str:
    env, model = doc["environment"], doc["model"]
    gpu = env.get("gpu") or {}
    extra = []
    if gpu.get("driver"):
        extra.append(f"driver {gpu['driver']}")
    if gpu.get("sm_clock_mhz"):
        extra.append(f"SM {gpu['sm_clock_mhz']:.0f} MHz")
    device = env["device"] + (f" ({', '.join(extra)})" if extra else "")
    bws = [r["copy_bw_GBps"] for r in doc["runs"] if r.get("copy_bw_GBps")]
    bw = f"copy bw {statistics.median(bws):.0f} GB/s" if bws else "copy bw not measured"
    weights = model["weight_bytes_per_token"] / 1e9
    return (
        f"device: {device} | model: {model['label']} | {bw} | "
        f"{weights:.3f} GB/token of weights + KV at the mean context"
    )


def _capped(c: dict[str, Any]) -> bool:
    return c.get("gen_tokens_run", c["gen_tokens"]) < c["gen_tokens"]


def _prompt(c: dict[str, Any]) -> str:
    """The prompt column: ``16384+500`` for a turn cell (base + new tokens, prefix reuse)."""
    return prompt_label(c["prompt_tokens"], c.get("turn_tokens", 0))


def _cell_order(c: dict[str, Any]) -> tuple[int, int, int]:
    return c["prompt_tokens"], c.get("turn_tokens", 0), c["gen_tokens"]


def _row(c: dict[str, Any]) -> str:
    head = f"{c['engine']:<11} {_prompt(c):>9} "
    gen = f"{c['gen_tokens']}*" if _capped(c) else str(c["gen_tokens"])
    head += f"{gen:>6}"
    if c["status"] != "ok":
        return f"{head}  error: {c['error']}"
    us = c["us_per_token"]
    spread = f"{us['p10']:.1f}-{us['p90']:.1f}"
    tok_s = c["tok_per_s"]["median"] if c.get("tok_per_s") else 0.0
    mbu = f"{c['mbu'] * 100:.1f}%" if c.get("mbu") is not None else "-"
    ceiling = f"{c['roofline_tok_s']:.0f}" if c.get("roofline_tok_s") else "-"
    ratio = f"{c['vs_torch']:.2f}x" if c.get("vs_torch") else "-"
    return (
        f"{head} {us['median']:>9.1f} {spread:>15} {tok_s:>8.1f} {c['ttft_ms']['median']:>9.2f} "
        f"{mbu:>6} {ceiling:>8} {ratio:>9}"
    )


def format_table(doc: dict[str, Any]) -> str:
    cells = doc["cells"]
    order = _engine_order(cells)
    rows = sorted(cells, key=lambda c: (*_cell_order(c), order[c["engine"]], c["run"]))
    lines = [
        _device_line(doc),
        f"{'engine':<11} {'prompt':>9} {'gen':>6} {'µs/token':>9} {'p10-p90':>15} "
        f"{'tok/s':>8} {'TTFT ms':>9} {'MBU':>6} {'ceiling':>8} {'vs torch':>9}",
        *(_row(c) for c in rows),
    ]
    caps = sorted({f"{c['engine']} {c['gen_tokens_run']}" for c in cells if _capped(c)})
    if caps:
        lines.append(f"(* timed over fewer tokens than the cell's gen: {', '.join(caps)})")
    for s in doc["skipped"]:
        who = f"{s['engine']} " if s.get("engine") else ""
        lines.append(f"note: skipped {who}prompt {_prompt(s)} gen {s['gen_tokens']}: {s['reason']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m monokernel.bench.table", description=__doc__)
    ap.add_argument("results", help="a bench JSON (--json of monokernel bench)")
    args = ap.parse_args(argv)
    with open(args.results) as f:
        print(format_table(validate(json.load(f))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
