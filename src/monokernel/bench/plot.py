"""Figures of a bench result (PNG); ``python -m monokernel.bench.plot RESULTS.json --out DIR``.

- ``decode_vs_prompt.png``: decode tokens/s against prompt length per engine (median, p10-p90
  bars), with the bandwidth-bound ceiling at each context from the same run's copy bandwidth;
- ``ttft_vs_prompt.png``: time to first token against prompt length (log-log);
- ``ratio_vs_torch.png``: each engine's decode speed over the torch engine's, per cell (turn
  cells of ``--turn-tokens`` too, labelled ``p16384+500``; they stay out of the sweeps);
- ``decode_vs_gen.png``: decode tokens/s against tokens generated (sustained decode), when
  the result holds a gen sweep.

matplotlib is imported only here, and only when a figure is drawn (``pip install
'monokernel[bench]'``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from monokernel.bench.records import prompt_label, validate

# One colour per engine in every figure, so a figure without torch does not recolour the rest.
COLORS = {"monokernel": "C0", "torch": "C1", "hf": "C2", "reference": "C3", "endpoint": "C4"}


def _ok(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in doc["cells"] if c["status"] == "ok"]


def _engines(cells: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(c["engine"] for c in cells))


def _title(doc: dict[str, Any], what: str) -> str:
    return f"{what}\n{doc['model']['label']} on {doc['environment']['device']}"


def _sweep_axis(cells: list[dict[str, Any]], vary: str, fixed: str) -> int | None:
    """The value of ``fixed`` at which ``vary`` takes the most values (at least two)."""
    seen: dict[int, set[int]] = defaultdict(set)
    for c in cells:
        seen[c[fixed]].add(c[vary])
    best = sorted(seen.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    return best[0][0] if best and len(best[0][1]) >= 2 else None


def _series(
    cells: list[dict[str, Any]], engine: str, x: str, metric: str
) -> tuple[list[int], list[float], list[float], list[float]]:
    pts = sorted(
        ((c[x], c[metric]) for c in cells if c["engine"] == engine and c.get(metric)),
        key=lambda p: p[0],
    )
    xs = [p[0] for p in pts]
    med = [p[1]["median"] for p in pts]
    lo = [p[1]["median"] - p[1]["p10"] for p in pts]
    hi = [p[1]["p90"] - p[1]["median"] for p in pts]
    return xs, med, [max(v, 0.0) for v in lo], [max(v, 0.0) for v in hi]


def _ceiling(cells: list[dict[str, Any]], x: str) -> tuple[list[int], list[float]]:
    """The roofline per x from uncapped cells (a capped cell's mean context differs)."""
    by_x: dict[int, list[float]] = defaultdict(list)
    for c in cells:
        if c.get("roofline_tok_s") and c["gen_tokens_run"] == c["gen_tokens"]:
            by_x[c[x]].append(c["roofline_tok_s"])
    xs = sorted(by_x)
    return xs, [statistics.median(by_x[v]) for v in xs]


def _log2_x(ax: Any, cells: list[dict[str, Any]], x: str) -> None:
    """Log-2 x axis labelled with the swept values themselves (128, 512, ...), not 2^7."""
    ticks = sorted({c[x] for c in cells})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()


def _engine_lines(ax: Any, cells: list[dict[str, Any]], x: str, metric: str) -> None:
    """One line per engine: the median of ``metric`` against ``x``, p10-p90 as error bars."""
    for engine in _engines(cells):
        xs, med, lo, hi = _series(cells, engine, x, metric)
        if xs:
            ax.errorbar(
                xs,
                med,
                yerr=[lo, hi],
                marker="o",
                capsize=3,
                label=engine,
                color=COLORS.get(engine),
            )


def _speed_figure(
    plt: Any, doc: dict[str, Any], cells: list[dict[str, Any]], x: str, label: str, what: str
) -> Any:
    fig, ax = plt.subplots(figsize=(8, 5))
    _engine_lines(ax, cells, x, "tok_per_s")
    cx, cy = _ceiling(cells, x)
    if cx:
        ax.plot(cx, cy, "k--", label="bandwidth bound (measured copy bw)")
    _log2_x(ax, cells, x)
    ax.set_xlabel(label)
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(_title(doc, what))
    fig.tight_layout()
    return fig


def _ttft_figure(plt: Any, doc: dict[str, Any], cells: list[dict[str, Any]]) -> Any:
    fig, ax = plt.subplots(figsize=(8, 5))
    _engine_lines(ax, cells, "prompt_tokens", "ttft_ms")
    _log2_x(ax, cells, "prompt_tokens")
    ax.set_yscale("log")  # TTFT spans milliseconds to seconds over the sweep
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(_title(doc, "Time to first token vs prompt length"))
    fig.tight_layout()
    return fig


def _cell_key(c: dict[str, Any]) -> tuple[int, int, int]:
    return c["prompt_tokens"], c.get("turn_tokens", 0), c["gen_tokens"]


def _ratio_figure(plt: Any, doc: dict[str, Any], cells: list[dict[str, Any]]) -> Any | None:
    rated = [c for c in cells if c.get("vs_torch") and c["engine"] != "torch"]
    if not rated:
        return None
    keys = sorted({_cell_key(c) for c in rated})
    engines = _engines(rated)
    width = 0.8 / len(engines)
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(keys)), 5))
    for i, engine in enumerate(engines):
        vals = {_cell_key(c): c["vs_torch"] for c in rated if c["engine"] == engine}
        xs = [k for k in range(len(keys)) if keys[k] in vals]
        bars = ax.bar([k + (i - (len(engines) - 1) / 2) * width for k in xs],
                      [vals[keys[k]] for k in xs], width, label=engine,
                      color=COLORS.get(engine))  # fmt: skip
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="k", linestyle="--", linewidth=1, label="torch = 1")
    ax.set_xticks(range(len(keys)), [f"p{prompt_label(p, t)}\ng{g}" for p, t, g in keys])
    ax.set_xlabel("cell (prompt tokens, generated tokens)")
    ax.set_ylabel("decode speed / torch engine's (same run)")
    ax.legend()
    ax.set_title(_title(doc, "Decode speed relative to the torch engine"))
    fig.tight_layout()
    return fig


def draw(doc: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write every figure the result has data for; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a GPU box
    import matplotlib.pyplot as plt

    validate(doc)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cells = _ok(doc)
    # A turn cell's TTFT is a prefix-reuse TTFT at another context: no point of the sweeps.
    fresh = [c for c in cells if not c.get("turn_tokens")]
    figures: dict[str, Any] = {}
    gen = _sweep_axis(fresh, "prompt_tokens", "gen_tokens")
    if gen is not None:
        at_gen = [c for c in fresh if c["gen_tokens"] == gen]
        figures["decode_vs_prompt.png"] = _speed_figure(
            plt, doc, at_gen, "prompt_tokens", "prompt tokens",
            f"Decode speed vs prompt length ({gen} tokens generated)",
        )  # fmt: skip
        figures["ttft_vs_prompt.png"] = _ttft_figure(plt, doc, at_gen)
    prompt = _sweep_axis(fresh, "gen_tokens", "prompt_tokens")
    if prompt is not None:
        at_prompt = [c for c in fresh if c["prompt_tokens"] == prompt]
        figures["decode_vs_gen.png"] = _speed_figure(
            plt, doc, at_prompt, "gen_tokens", "tokens generated",
            f"Sustained decode speed vs tokens generated (prompt {prompt})",
        )  # fmt: skip
    ratio = _ratio_figure(plt, doc, cells)
    if ratio is not None:
        figures["ratio_vs_torch.png"] = ratio
    paths = []
    for name, fig in figures.items():
        path = out / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m monokernel.bench.plot", description=__doc__)
    ap.add_argument("results", nargs="+", help="bench JSON file(s); several are merged")
    ap.add_argument("--out", required=True, help="directory for the PNG files")
    args = ap.parse_args(argv)
    from monokernel.bench.merge import load

    try:
        paths = draw(load(args.results), args.out)
    except ImportError:
        print("plots need matplotlib: pip install 'monokernel[bench]'", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    if not paths:
        print("no figure: the result holds no sweep and no torch ratio", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
