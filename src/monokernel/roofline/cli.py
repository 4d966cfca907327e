"""`monokernel roofline`: the bandwidth ceiling on batch-1 decode speed, per model and GPU."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from monokernel.errors import MonokernelError
from monokernel.roofline.calc import (
    DTYPE_BITS,
    ModelProfile,
    Precision,
    Roofline,
    RooflineInputs,
    canonical_dtype,
    roofline,
)
from monokernel.roofline.gpus import GPUS, get_gpu
from monokernel.roofline.sources import PRESET_NAMES, get_preset, profile_from_ref


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="monokernel roofline",
        description=(
            "Bytes every decoded token must read (active weights + KV cache at --context) "
            "and the tokens/s ceiling that aggregate HBM bandwidth sets at batch 1."
        ),
    )
    p.add_argument("model", nargs="?", help="HF directory, config.json, .gguf file or hub id")
    p.add_argument(
        "--preset",
        action="append",
        default=[],
        help=f"built-in model (repeatable, or 'all'): {', '.join(PRESET_NAMES)}",
    )
    p.add_argument(
        "--gpu",
        action="append",
        default=[],
        help=f"GPU (repeatable or comma-separated; default h100): {', '.join(GPUS)}",
    )
    p.add_argument("--tp", type=int, default=1, help="GPUs the weights are split over")
    dtypes = ", ".join(DTYPE_BITS)
    p.add_argument("--dtype", help=f"all weights in this dtype (default: as released): {dtypes}")
    p.add_argument("--expert-dtype", help="MoE expert weights in this dtype (after --dtype)")
    p.add_argument("--kv-dtype", default="bf16", help="KV-cache dtype (default bf16)")
    p.add_argument("--context", type=int, default=0, help="tokens already in the KV cache")
    p.add_argument("--mbu", type=float, help="memory-bandwidth utilisation for an estimate")
    p.add_argument(
        "--bandwidth",
        choices=["datasheet", "measured"],
        default="datasheet",
        help="per-GPU bandwidth: vendor datasheet peak or our measured copy bandwidth",
    )
    p.add_argument("--measured", type=Path, help="JSON list of {model, gpu, tp, tok_s}")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--stage-profile",
        type=Path,
        help="a monokernel bench --profile --json file of MODEL at TP=1: project the "
        "per-token time at --tp from its stages and --allreduce-us instead",
    )
    p.add_argument(
        "--allreduce-us",
        type=float,
        help="one in-kernel all-reduce, µs (python -m monokernel.parallel.allreduce_bench)",
    )
    return p


def _profiles(args: argparse.Namespace) -> list[tuple[str, ModelProfile]]:
    """(reference as typed, profile) for every model asked for; all presets when none."""
    out: list[tuple[str, ModelProfile]] = []
    if args.model:
        out.append((args.model, profile_from_ref(args.model)))
    names = [n for p in args.preset for n in p.split(",") if n]
    if "all" in (n.lower() for n in names) or not (names or args.model):
        names = list(PRESET_NAMES)
    out += [(n, get_preset(n)) for n in names]
    return out


def _precision(args: argparse.Namespace, profile: ModelProfile) -> Precision | None:
    if args.dtype:
        base = Precision(canonical_dtype(args.dtype))
    elif args.expert_dtype:
        base = profile.native
    else:
        return None  # as released (or as stored, for GGUF)
    if args.expert_dtype:
        return Precision(base.weights, canonical_dtype(args.expert_dtype), base.head)
    return base


def _load_measured(path: Path | None) -> list[dict[str, Any]]:
    if path is None:
        return []
    data = json.loads(path.read_text())
    if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
        raise ValueError(f"{path}: expected a JSON list of {{model, gpu, tp, tok_s}} objects")
    for d in data:
        missing = {"model", "gpu", "tok_s"} - d.keys()
        if missing:
            raise ValueError(f"{path}: entry {d} lacks {sorted(missing)}")
    return data


def _measured_for(
    measured: list[dict[str, Any]], names: set[str], gpu: str, tp: int
) -> float | None:
    for d in measured:
        if (
            str(d["model"]).lower() in names
            and get_gpu(str(d["gpu"])).name == gpu
            and int(d.get("tp", 1)) == tp
        ):
            return float(d["tok_s"])
    return None


def _row_json(r: Roofline, measured: float | None) -> dict[str, Any]:
    inputs = asdict(r.inputs)
    inputs["precision"] = r.precision
    row: dict[str, Any] = {
        "model": r.model,
        "total_params": r.total_params,
        "active_params": r.active_params,
        "weight_bytes": round(r.weight_bytes),
        "kv_bytes": round(r.kv_bytes),
        "bytes_per_token": round(r.bytes_per_token),
        "bandwidth_bytes_per_s": r.bandwidth_bytes_per_s,
        "ceiling_tok_s": round(r.ceiling_tok_s, 2),
        "floor_us_per_token": round(r.floor_us, 3),
        "inputs": inputs,
    }
    if r.estimate_tok_s is not None:
        row["estimate_tok_s"] = round(r.estimate_tok_s, 2)
    if measured is not None:
        row["measured_tok_s"] = measured
        row["measured_fraction_of_ceiling"] = round(measured / r.ceiling_tok_s, 4)
    return row


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def _table(rows: list[tuple[Roofline, float | None]], args: argparse.Namespace) -> str:
    mbu = f"est. @ {args.mbu:.0%} MBU" if args.mbu is not None else None
    head = ["model", "active / total", "precision", "GB/token", "GPUs × bw", "ceiling tok/s"]
    head += ["floor µs"] + ([mbu] if mbu else [])
    show_measured = any(m is not None for _, m in rows)
    head += ["measured tok/s (of ceiling)"] if show_measured else []
    lines = [head]
    for r, m in rows:
        gb = f"{r.bytes_per_token / 1e9:.3f}"
        if r.kv_bytes:
            gb += f" ({r.kv_bytes / 1e9:.3f} KV)"
        bw = r.inputs.bandwidth_per_gpu / 1e12
        cells = [
            r.model,
            f"{_params(r.active_params)} / {_params(r.total_params)}",
            r.precision,
            gb,
            f"{r.inputs.tp}× {r.inputs.gpu} {bw:.2f} TB/s",
            f"{r.ceiling_tok_s:,.0f}",
            f"{r.floor_us:,.1f}",
        ]
        if mbu:
            cells.append(f"{r.estimate_tok_s:,.0f}")
        if show_measured:
            cells.append(f"{m:,.0f} ({m / r.ceiling_tok_s:.0%})" if m is not None else "—")
        lines.append(cells)
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    fmt = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in lines
    ]
    fmt.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    note = (
        f"context {args.context} tokens (KV {args.kv_dtype}); bandwidth: {args.bandwidth}"
        + (" (device-to-device copy, our runs)" if args.bandwidth == "measured" else "")
        + "; ceiling = GPUs × bw ÷ bytes/token (batch 1, TP all-reduces not counted)"
    )
    return "\n".join([*fmt, note])


def _tp_projection(args: argparse.Namespace) -> str:
    from monokernel.models.shapes import find_model
    from monokernel.roofline.tp_projection import format_projection, from_bench_json

    entry = find_model(args.model or "")
    if entry is None or entry.config is None:
        raise ValueError(
            f"--stage-profile needs MODEL to name a dense shape of the catalogue; got "
            f"{args.model!r}"
        )
    if args.tp > 1 and args.allreduce_us is None:
        raise ValueError("--stage-profile with --tp > 1 needs --allreduce-us (measured)")
    proj, _cell = from_bench_json(args.stage_profile, entry.config, args.tp, args.allreduce_us or 0)
    return format_projection(proj, entry.name)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.stage_profile is not None:
        try:
            print(_tp_projection(args))
        except (ValueError, OSError, KeyError) as e:
            print(f"monokernel roofline: error: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        gpus = [get_gpu(g) for arg in (args.gpu or ["h100"]) for g in arg.split(",") if g]
        measured = _load_measured(args.measured)
        kv_dtype = canonical_dtype(args.kv_dtype)
        rows: list[tuple[Roofline, float | None]] = []
        for ref, profile in _profiles(args):
            precision = _precision(args, profile)
            for gpu in gpus:
                inputs = RooflineInputs(
                    gpu=gpu.name,
                    bandwidth_per_gpu=gpu.bandwidth(args.bandwidth),
                    bandwidth_source=args.bandwidth,
                    tp=args.tp,
                    context=args.context,
                    kv_dtype=kv_dtype,
                    precision=precision,
                    mbu=args.mbu,
                )
                names = {ref.lower(), profile.name.lower()}
                rows.append(
                    (roofline(profile, inputs), _measured_for(measured, names, gpu.name, args.tp))
                )
    except (ValueError, OSError, MonokernelError) as e:
        print(f"monokernel roofline: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = [_row_json(r, m) for r, m in rows]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
    else:
        print(_table(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
