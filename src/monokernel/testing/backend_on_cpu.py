"""The monokernel backend built on the CPU up to its KV cache, for tests of its load: the
kernel build, the device check and the device's free memory are stood in for, and the build
stops where the backend hands its repacked weights to the cache (``Repacked``). Its checks,
its bf16 copy of the weights and its repack run as they do on a GPU."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch

from monokernel.runtime import kv_memory
from monokernel.runtime.backends.monokernel import backend


class Repacked(Exception):
    """Raised where the backend hands its repacked weights (``packed``) to the KV cache."""

    def __init__(self, packed: Any) -> None:
        super().__init__("repacked")
        self.packed = packed


def stop_at_the_cache(monkeypatch: pytest.MonkeyPatch) -> dict[str, kv_memory.LoadPhases]:
    """Stand-ins for a GPU until the repack is done; returns what the backend's memory check
    counted, under ``"phases"`` (kv_memory.check_load_fits's), once it has run."""
    seen: dict[str, kv_memory.LoadPhases] = {}
    real_check = kv_memory.check_load_fits

    def check_load_fits(*args: Any, **kwargs: Any) -> kv_memory.LoadPhases:
        seen["phases"] = real_check(*args, **kwargs)
        return seen["phases"]

    def stop(cfg: Any, packed: Any, *args: Any) -> None:
        raise Repacked(packed)

    monkeypatch.setattr(backend, "monokernel_supported", lambda device: (True, ""))
    monkeypatch.setattr(backend.kbuild, "build", lambda dims: None)
    monkeypatch.setattr(kv_memory, "free_device_bytes", lambda device: 1 << 40)
    monkeypatch.setattr(kv_memory, "check_load_fits", check_load_fits)
    monkeypatch.setattr(backend, "KVStore", stop)
    return seen


def repacked_on_cpu(
    cfg: Any, weights: Any, quantize: str | None, groups: Mapping[str, Any] | None
) -> Any:
    """What the monokernel backend repacks ``weights`` (and a checkpoint's own ``groups``)
    into on the CPU, consuming the weights as the engine's own (64 positions, no snapshots);
    stop_at_the_cache must be in place."""
    with pytest.raises(Repacked) as stopped:
        backend.MonokernelBackend(
            cfg,
            weights,
            64,
            torch.device("cpu"),
            snapshot_bytes=0,
            consume_weights=True,
            quantize=quantize,
            groups=groups,
        )
    return stopped.value.packed
