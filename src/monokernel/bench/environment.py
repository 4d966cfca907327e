"""What a benchmark ran on: GPU, driver, clocks and library versions (no host name).

Clocks matter at batch 1: a GPU idling at a low SM clock or capped by power/thermals moves
µs/token by more than most kernel changes, so every result records what nvidia-smi (or, if
it is missing, torch) read during the run.
"""

from __future__ import annotations

import importlib.metadata
import platform
import shutil
import subprocess
from typing import Any

import torch

_SMI_FIELDS = (
    "name",
    "driver_version",
    "clocks.sm",
    "clocks.max.sm",
    "clocks.mem",
    "clocks.max.mem",
    "power.limit",
    "pstate",
)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _number(text: str) -> float | str | None:
    text = text.strip()
    if not text or text.startswith("[") or text in ("N/A", "[N/A]"):
        return None
    try:
        return float(text)
    except ValueError:
        return text


def nvidia_smi(gpu_id: str = "0") -> dict[str, Any] | None:
    """One GPU's name, driver and current/max clocks from nvidia-smi; None without it.
    ``gpu_id``: an nvidia-smi index or a ``GPU-<uuid>``."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    cmd = [exe, f"--id={gpu_id}", f"--query-gpu={','.join(_SMI_FIELDS)}"]
    cmd.append("--format=csv,noheader,nounits")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=15, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    parts = [p.strip() for p in out.strip().splitlines()[0].split(",")] if out.strip() else []
    if len(parts) != len(_SMI_FIELDS):
        return None
    raw = dict(zip(_SMI_FIELDS, parts, strict=True))
    return {
        "name": raw["name"],
        "driver": raw["driver_version"],
        "sm_clock_mhz": _number(raw["clocks.sm"]),
        "max_sm_clock_mhz": _number(raw["clocks.max.sm"]),
        "mem_clock_mhz": _number(raw["clocks.mem"]),
        "max_mem_clock_mhz": _number(raw["clocks.max.mem"]),
        "power_limit_w": _number(raw["power.limit"]),
        "pstate": raw["pstate"],
        "clock_source": "nvidia-smi",
    }


def _torch_clock(device: torch.device) -> float | None:
    try:  # torch reads it through NVML (pynvml), which may be absent
        return float(torch.cuda.clock_rate(device))
    except Exception:
        return None


def _smi_id(props: Any, index: int) -> str:
    # CUDA numbers GPUs fastest first, nvidia-smi by PCI bus: the UUID names the same card.
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid:
        return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    return str(index)


def gpu_info(device: torch.device) -> dict[str, Any] | None:
    """Read now: call it while the GPU is busy (after the copy-bandwidth test), not idle."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    info: dict[str, Any] = {
        "name": torch.cuda.get_device_name(index),
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
    }
    smi = nvidia_smi(_smi_id(props, index)) or nvidia_smi(str(index))
    if smi is not None:
        info |= {k: v for k, v in smi.items() if k != "name"}
    else:
        info |= {"driver": None, "sm_clock_mhz": _torch_clock(device), "clock_source": "torch"}
    return info


def software() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.machine()}",  # no node name: results get shared
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": _version("transformers"),
        "monokernel": _version("monokernel") or _monokernel_version(),
    }


def _monokernel_version() -> str:
    import monokernel

    return monokernel.__version__


def environment(device: torch.device) -> dict[str, Any]:
    gpu = gpu_info(device)
    return {
        "device": gpu["name"] if gpu else str(device),
        "gpu": gpu,
        **software(),
    }
