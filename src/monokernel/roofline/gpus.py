"""HBM bandwidth per GPU: the vendor datasheet figure, and ours where we measured one."""

from __future__ import annotations

from dataclasses import dataclass

TB = 1e12


@dataclass(frozen=True, slots=True)
class GPU:
    name: str
    description: str
    datasheet_bw: float  # bytes/s, vendor datasheet peak HBM bandwidth
    measured_bw: float | None = None  # bytes/s, copy bandwidth measured on our machines

    def bandwidth(self, source: str) -> float:
        if source == "datasheet":
            return self.datasheet_bw
        if source == "measured":
            if self.measured_bw is None:
                have = ", ".join(g.name for g in GPUS.values() if g.measured_bw)
                raise ValueError(
                    f"no measured bandwidth for {self.name}; measured: {have} "
                    "(use --bandwidth datasheet)"
                )
            return self.measured_bw
        raise ValueError(f"bandwidth source must be datasheet or measured, got {source!r}")


# Measured figures are device-to-device copy bandwidth (read + write counted) from
# docs/DESIGN: the practical ceiling a streaming kernel can reach, below the datasheet peak.
GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU("h100", "NVIDIA H100 SXM 80GB (HBM3)", 3.35 * TB, 2.96 * TB),
        GPU("h200", "NVIDIA H200 SXM 141GB (HBM3e)", 4.8 * TB, 4.16 * TB),
        GPU("b200", "NVIDIA B200 (HBM3e)", 8.0 * TB),
        GPU("mi300x", "AMD Instinct MI300X (HBM3)", 5.3 * TB),
        GPU("a100-80g", "NVIDIA A100 SXM 80GB (HBM2e)", 2.039 * TB),
        GPU("l40s", "NVIDIA L40S (GDDR6)", 0.864 * TB),
    )
}
GPU_ALIASES: dict[str, str] = {"h100-sxm": "h100", "a100": "a100-80g", "mi300": "mi300x"}


def get_gpu(name: str) -> GPU:
    key = GPU_ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return GPUS[key]
