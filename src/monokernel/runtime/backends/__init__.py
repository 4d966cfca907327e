"""Decode backends and the choice among them.

``reference`` and ``torch`` run anywhere (``torch`` decodes from 4- and 8-bit matrices on
the CPU: cpu_packed.py); ``monokernel`` needs a Hopper GPU. Their modules are imported only
when chosen, so a missing toolchain on one never breaks another.
"""

from __future__ import annotations

import gc
import importlib
from collections.abc import Callable, Mapping

import torch

from monokernel.errors import BackendUnavailableError, MonokernelError
from monokernel.models.config import ModelConfig
from monokernel.runtime.backends.base import Backend
from monokernel.weights.checkpoint_quant import Fp8Blocks
from monokernel.weights.group_quant import GroupQuant
from monokernel.weights.names import Weights

ENGINES: tuple[str, ...] = ("auto", "reference", "torch", "monokernel")
# Each engine's backend class, imported when chosen (bench reads the same table).
BACKEND_CLASSES: dict[str, tuple[str, str]] = {
    "reference": ("monokernel.runtime.backends.reference", "ReferenceBackend"),
    "torch": ("monokernel.runtime.backends.torch_compiled", "TorchBackend"),
    "monokernel": ("monokernel.runtime.backends.monokernel", "MonokernelBackend"),
}


def _available(name: str) -> bool:
    try:
        importlib.import_module(BACKEND_CLASSES[name][0])
    except ImportError:
        return False
    return True


def monokernel_status(device: torch.device) -> tuple[bool, str]:
    """Whether the monokernel can serve on ``device``, and why not."""
    if device.type != "cuda":
        return False, "the monokernel needs an NVIDIA GPU"
    if not _available("monokernel"):
        return False, "the monokernel engine is not part of this build yet"
    mod = importlib.import_module(BACKEND_CLASSES["monokernel"][0])
    ok, why = mod.monokernel_supported(device)
    return bool(ok), str(why)


def resolve_engine(name: str, device: torch.device) -> str:
    """The concrete engine for ``name``; ``auto`` picks the fastest one that can run."""
    if name not in ENGINES:
        raise BackendUnavailableError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
    if name == "auto":
        if device.type == "cuda" and monokernel_status(device)[0]:
            return "monokernel"
        return "torch" if _available("torch") else "reference"
    if name == "monokernel" and device.type != "cuda":
        raise BackendUnavailableError(
            "engine 'monokernel' needs an NVIDIA GPU; use --engine torch or reference"
        )
    if name == "monokernel":
        ok, why = monokernel_status(device)
        if not ok:
            raise BackendUnavailableError(f"engine 'monokernel' cannot run here: {why}")
    if not _available(name):
        raise BackendUnavailableError(f"engine {name!r} is not part of this build yet")
    return name


# What building the monokernel for a model raises when it cannot serve it: an unsupported
# shape (UnsupportedModelError), no nvcc or a failed build (BackendUnavailableError), a
# context that does not fit (InvalidRequestError), CUDA errors and out-of-memory
# (RuntimeError). `auto` falls back on these; anything else is a bug and propagates.
FALLBACK_ERRORS: tuple[type[BaseException], ...] = (MonokernelError, RuntimeError)
_REASON_CHARS = 200

# Called with (the engine that runs instead, why the monokernel could not); returns the
# context to build it for (the caller may plan a different one for the other engine).
OnFallback = Callable[[str, str], int]


def fallback_reason(error: BaseException) -> str:
    """One short line from ``error`` (an nvcc failure carries its whole log)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = text or type(error).__name__
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 1] + "…"


def fallback_engine() -> str:
    """What ``auto`` runs on a GPU where the monokernel cannot."""
    return "torch" if _available("torch") else "reference"


def release_device_memory(device: torch.device) -> None:
    """Hand what a half-built backend allocated back to the driver before another backend
    is built: its tensors are freed once the frames of the failed constructor are (they
    may sit in reference cycles, hence the collection), then torch's cache is emptied."""
    gc.collect()
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def construct_backend(
    name: str,
    cfg: ModelConfig,
    weights: Weights,
    max_seq_len: int,
    device: torch.device,
    owned: bool = False,
    quantize: str | None = None,
    groups: Mapping[str, GroupQuant] | None = None,
    fp8_blocks: Fp8Blocks | None = None,
    act_stats: Mapping[str, torch.Tensor] | None = None,
) -> Backend:
    """Engine ``name``'s backend; ``owned``, ``quantize``, ``groups``, ``fp8_blocks``,
    ``act_stats``: as in create_backend."""
    module, cls = BACKEND_CLASSES[name]
    backend_cls = getattr(importlib.import_module(module), cls)
    extra: dict[str, object] = {}
    if name == "monokernel":
        extra = {"consume_weights": True} if owned else {}
        if quantize is not None:
            extra["quantize"] = quantize
        if groups is not None:
            extra["groups"] = groups
        if fp8_blocks is not None:
            extra["fp8_blocks"] = fp8_blocks
        if act_stats is not None:
            extra["act_stats"] = act_stats
    elif quantize is not None and groups is None and fp8_blocks is None:
        # The other engines compute with the dequantised values the kernel multiplies by.
        from monokernel.weights.quantize import fake_quantize

        weights = fake_quantize(weights, quantize, consume=owned, stats=act_stats)
    if name == "torch" and device.type == "cpu":
        # What a CPU user runs: 4- and 8-bit matrices, ~3x the float32 step's speed
        # (cpu_packed.py), from a 4-bit checkpoint's own groups where it has them.
        # TorchBackend's own default stays the float32 step that the tests compare the
        # engines with.
        extra["cpu_packed"] = True
        if groups is not None and all(g.bits == 4 for g in groups.values()):
            extra["groups"] = groups
    backend: Backend = backend_cls(cfg, weights, max_seq_len, device, **extra)
    return backend


def create_backend(
    name: str,
    cfg: ModelConfig,
    weights: Weights,
    max_seq_len: int,
    device: torch.device,
    tp: int = 1,
    on_fallback: OnFallback | None = None,
    owned: bool = False,
    quantize: str | None = None,
    groups: Mapping[str, GroupQuant] | None = None,
    fp8_blocks: Fp8Blocks | None = None,
    act_stats: Mapping[str, torch.Tensor] | None = None,
) -> Backend:
    """Build the backend for engine ``name``. For ``auto`` a monokernel that cannot serve
    this model (see FALLBACK_ERRORS) gives way to ``fallback_engine()``; ``on_fallback``
    hears why and picks that engine's context. A named engine fails with its own error.
    ``owned``: the caller holds no other reference to ``weights``, so the monokernel repacks
    them in place (a model the GPU holds once but not twice). ``quantize``: the layers'
    matrices quantised at load (weights/quantize.py), on every engine. ``groups``: a 4- or
    8-bit checkpoint's own groups (Checkpoint.groups, with ``quantize`` "int4" or "int8",
    weights/quantize.py groups_method): the monokernel
    streams them as they are; the other engines compute with ``weights``, already their
    dequantised values. ``fp8_blocks``: an FP8 checkpoint's block scales (Checkpoint.
    fp8_blocks, with ``quantize`` "fp8"), likewise: the monokernel streams the checkpoint's
    own values with them where its layers (a rank's, at ``tp`` > 1) stream as tiles, else
    re-quantises each row (docs/cli.md). ``act_stats``: with ``quantize`` "int4" (and no
    ``groups``), each layer matrix's input statistics over the calibration text
    (runtime/calibration.py), which every engine's int4 search is weighted by."""
    resolved = resolve_engine(name, device)
    if tp > 1:
        # Only the monokernel splits a request over GPUs (docs/tensor-parallel.md).
        if resolved != "monokernel":
            raise BackendUnavailableError(
                f"--tp {tp} needs engine 'monokernel' (Hopper GPUs with nvcc); got {name!r}"
            )
        from monokernel.runtime.backends.monokernel.tp import MonokernelTPBackend

        return MonokernelTPBackend(
            cfg,
            weights,
            max_seq_len,
            device,
            tp,
            quantize,
            groups,
            fp8_blocks=fp8_blocks,
            act_stats=act_stats,
        )
    args = (
        resolved, cfg, weights, max_seq_len, device, owned, quantize, groups, fp8_blocks, act_stats
    )  # fmt: skip
    if name != "auto" or resolved != "monokernel":
        return construct_backend(*args)
    names = set(weights)
    try:
        return construct_backend(*args)
    except FALLBACK_ERRORS as e:
        if set(weights) != names:
            raise  # it took the weights apart (repack's `consume`): nothing left to fall back on
        reason = fallback_reason(e)
    # Outside the except block: the exception and its traceback (which holds the failed
    # constructor's frame and its tensors) are gone by now.
    release_device_memory(device)
    other = fallback_engine()
    if on_fallback is not None:
        max_seq_len = on_fallback(other, reason)
    return construct_backend(
        other,
        cfg,
        weights,
        max_seq_len,
        device,
        quantize=quantize,
        groups=groups,
        fp8_blocks=fp8_blocks,
        act_stats=act_stats,
    )
