"""Per-token time at TP=N projected from one GPU's measured stage profile.

The monokernel's stages (docs/architecture.md): A the QKV projection, B attention, C the O
projection, D gate/up, E the down projection, F the LM head, S sampling. At TP=N each GPU
streams 1/N of every stage's bytes, but the latency a stage pays besides its bytes (the
hand-off that starts it, its ramp, the dependent round trips of attention) does not shrink:
that is the per-layer fixed cost that keeps TP=2 from 2x. So, per stage, from a TP=1 profile
(``monokernel bench --profile``: µs a token, work + wait, summed over layers) and the copy
bandwidth of the same run::

    fixed = max(0, measured - bytes / bw)
    at TP=N: fixed + bytes / (N * bw)

plus the all-reduces the TP build adds, none hidden: two a layer (after C and after E) and
one for the LM head's token exchange, each at ``allreduce_us`` (``python -m
monokernel.parallel.allreduce_bench`` measures it). A projection, not a measurement: it
ignores that a stage whose bytes shrink may hide less of its fixed cost, and that the
exchanges may overlap the next stage's loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from monokernel.models.config import ModelConfig

STAGES = ("A", "B", "C", "D", "E", "F", "S")


def stage_bytes(cfg: ModelConfig, context: float, dtype_bytes: int = 2) -> dict[str, float]:
    """Bytes each stage streams for one token at one GPU (TP=1), summed over the layers;
    ``context``: positions attention reads (the mean over the timed steps)."""
    h, q, kv, i, n = (
        cfg.hidden_size,
        cfg.q_size,
        cfg.kv_size,
        cfg.intermediate_size,
        cfg.num_layers,
    )
    return {
        "A": n * (q + 2 * kv) * h * dtype_bytes,
        "B": n * 2 * kv * context * dtype_bytes,
        "C": n * h * q * dtype_bytes,
        "D": n * 2 * i * h * dtype_bytes,
        "E": n * h * i * dtype_bytes,
        "F": cfg.vocab_size * h * dtype_bytes,
        "S": 0.0,
    }


@dataclass(frozen=True, slots=True)
class StageProjection:
    stage: str
    measured_us: float  # TP=1, work + wait
    bytes: float  # TP=1
    fixed_us: float
    projected_us: float  # at TP=N, without the all-reduces


@dataclass(frozen=True, slots=True)
class Projection:
    tp: int
    stages: tuple[StageProjection, ...]
    allreduces: int
    allreduce_us: float

    @property
    def measured_tp1_us(self) -> float:
        return sum(s.measured_us for s in self.stages)

    @property
    def collective_us(self) -> float:
        return self.allreduces * self.allreduce_us if self.tp > 1 else 0.0

    @property
    def total_us(self) -> float:
        return sum(s.projected_us for s in self.stages) + self.collective_us

    @property
    def speedup(self) -> float:
        return self.measured_tp1_us / self.total_us


def project(
    cfg: ModelConfig,
    profile_us: dict[str, float],
    bandwidth: float,
    tp: int,
    allreduce_us: float,
    context: float,
) -> Projection:
    """``profile_us``: stage marks as ``bench --profile`` records them ("A.work", "A.wait",
    ...); ``bandwidth``: bytes/s of one GPU (the run's copy bandwidth)."""
    if tp < 1:
        raise ValueError(f"tp must be at least 1; got {tp}")
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive; got {bandwidth}")
    missing = [s for s in STAGES if f"{s}.work" not in profile_us]
    if missing:
        raise ValueError(f"the stage profile lacks {', '.join(missing)} (bench --profile's marks)")
    sizes = stage_bytes(cfg, context)
    out = []
    for s in STAGES:
        measured = profile_us[f"{s}.work"] + profile_us.get(f"{s}.wait", 0.0)
        stream = sizes[s] / bandwidth * 1e6
        fixed = max(0.0, measured - stream)
        out.append(StageProjection(s, measured, sizes[s], fixed, fixed + stream / tp))
    return Projection(tp, tuple(out), 2 * cfg.num_layers + 1, allreduce_us)


def from_bench_json(
    path: Path, cfg: ModelConfig, tp: int, allreduce_us: float
) -> tuple[Projection, dict[str, Any]]:
    """The projection from a ``monokernel bench --profile --json`` file's first monokernel
    cell with a stage profile, and that cell."""
    doc = json.loads(Path(path).read_text())
    bw = (doc.get("runs") or [{}])[0].get("copy_bw_GBps")
    if not bw:
        raise ValueError(f"{path}: no copy bandwidth (a GPU run of monokernel bench)")
    for cell in doc.get("cells", []):
        prof = cell.get("stage_profile_us")
        if cell.get("engine") == "monokernel" and prof:
            context = cell["prompt_tokens"] + cell["gen_tokens"] / 2
            return project(cfg, prof, bw * 1e9, tp, allreduce_us, context), cell
    raise ValueError(f"{path}: no monokernel cell with a stage profile (run bench --profile)")


def format_projection(p: Projection, label: str) -> str:
    lines = [
        f"{label}: TP=1 measured {p.measured_tp1_us:,.1f} µs/token -> TP={p.tp} projected "
        f"{p.total_us:,.1f} µs/token ({p.speedup:.2f}x), of which {p.collective_us:,.1f} µs "
        f"all-reduces ({p.allreduces} at {p.allreduce_us:.2f} µs, none hidden)",
        "| stage | TP=1 µs | MB | fixed µs | TP=N µs |",
        "|---|---|---|---|---|",
    ]
    for s in p.stages:
        lines.append(
            f"| {s.stage} | {s.measured_us:,.1f} | {s.bytes / 1e6:,.1f} | {s.fixed_us:,.1f} "
            f"| {s.projected_us:,.1f} |"
        )
    return "\n".join(lines)
