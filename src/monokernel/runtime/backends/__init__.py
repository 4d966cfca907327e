"""Decode backends and the choice among them.

``reference`` runs anywhere; ``torch`` and ``monokernel`` need an NVIDIA GPU (monokernel: a
Hopper one). Their modules are imported only when chosen, so a missing toolchain on one
never breaks another.
"""

from __future__ import annotations

import importlib

import torch

from monokernel.errors import BackendUnavailableError
from monokernel.models.config import ModelConfig
from monokernel.runtime.backends.base import Backend
from monokernel.weights.names import Weights

ENGINES: tuple[str, ...] = ("auto", "reference", "torch", "monokernel")
_CLASSES: dict[str, tuple[str, str]] = {
    "reference": ("monokernel.runtime.backends.reference", "ReferenceBackend"),
    "torch": ("monokernel.runtime.backends.torch_compiled", "TorchBackend"),
    "monokernel": ("monokernel.runtime.backends.monokernel", "MonokernelBackend"),
}


def _available(name: str) -> bool:
    try:
        importlib.import_module(_CLASSES[name][0])
    except ImportError:
        return False
    return True


def monokernel_status(device: torch.device) -> tuple[bool, str]:
    """Whether the monokernel can serve on ``device``, and why not."""
    if device.type != "cuda":
        return False, "the monokernel needs an NVIDIA GPU"
    if not _available("monokernel"):
        return False, "the monokernel engine is not part of this build yet"
    mod = importlib.import_module(_CLASSES["monokernel"][0])
    ok, why = mod.monokernel_supported(device)
    return bool(ok), str(why)


def resolve_engine(name: str, device: torch.device) -> str:
    """The concrete engine for ``name``; ``auto`` picks the fastest one that can run."""
    if name not in ENGINES:
        raise BackendUnavailableError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
    if name == "auto":
        if device.type != "cuda":
            return "reference"
        if monokernel_status(device)[0]:
            return "monokernel"
        return "torch" if _available("torch") else "reference"
    if name in ("torch", "monokernel") and device.type != "cuda":
        raise BackendUnavailableError(
            f"engine {name!r} needs an NVIDIA GPU; use --engine reference"
        )
    if name == "monokernel":
        ok, why = monokernel_status(device)
        if not ok:
            raise BackendUnavailableError(f"engine 'monokernel' cannot run here: {why}")
    if not _available(name):
        raise BackendUnavailableError(f"engine {name!r} is not part of this build yet")
    return name


def create_backend(
    name: str,
    cfg: ModelConfig,
    weights: Weights,
    max_seq_len: int,
    device: torch.device,
    tp: int = 1,
) -> Backend:
    if tp > 1:
        # Only the monokernel splits a request over GPUs (docs/tensor-parallel.md).
        if resolve_engine(name, device) != "monokernel":
            raise BackendUnavailableError(
                f"--tp {tp} needs engine 'monokernel' (Hopper GPUs with nvcc); got {name!r}"
            )
        from monokernel.runtime.backends.monokernel.tp import MonokernelTPBackend

        return MonokernelTPBackend(cfg, weights, max_seq_len, device, tp)
    module, cls = _CLASSES[resolve_engine(name, device)]
    backend_cls = getattr(importlib.import_module(module), cls)
    return backend_cls(cfg, weights, max_seq_len, device)
