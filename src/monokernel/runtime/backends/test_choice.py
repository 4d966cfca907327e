"""`--engine auto` falls back to torch where the monokernel cannot serve the model; a named
engine fails with its own error. The backend classes are stand-ins that record what they
were built with, so the choice logic runs on the CPU."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections.abc import Iterator
from typing import ClassVar

import pytest
import torch

from monokernel.errors import BackendUnavailableError, UnsupportedModelError
from monokernel.models.shapes import DENSE_SHAPES
from monokernel.runtime import backends
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.weights.random_weights import random_weights

CFG = DENSE_SHAPES["odd"]
GPU = torch.device("cuda")  # only named: nothing is allocated on it
_alive: list[weakref.ref[object]] = []


class _Built:
    name = "built"

    def __init__(self, cfg: object, weights: object, max_seq_len: int, device: object) -> None:
        self.max_seq_len = max_seq_len

    def stream(self, request: DecodeRequest, cancel: CancelToken) -> Iterator[int]:
        yield 0

    def close(self) -> None:
        pass


class FakeTorch(_Built):
    name = "torch"

    def __init__(self, cfg: object, weights: object, max_seq_len: int, device: object) -> None:
        super().__init__(cfg, weights, max_seq_len, device)
        # What the failed monokernel allocated is gone before this one allocates.
        self.saw_leftovers = any(ref() is not None for ref in _alive)


class FakeMonokernel(_Built):
    name = "monokernel"
    error: BaseException | None = None

    def __init__(self, cfg: object, weights: object, max_seq_len: int, device: object) -> None:
        super().__init__(cfg, weights, max_seq_len, device)
        self.buffer = torch.zeros(1024)
        self.me = self  # a cycle, as a half-built backend's parts often make
        _alive.append(weakref.ref(self.buffer))
        if isinstance(weights, dict) and "consume" in weights:
            weights.pop("consume")  # as repack(consume=True) pops each layer it packed
        if self.error is not None:
            # A fresh exception, as a real failure's: the class attribute must not keep its
            # traceback (and with it this half-built object) alive.
            raise type(self.error)(*self.error.args)


@pytest.fixture(autouse=True)
def fakes(monkeypatch: pytest.MonkeyPatch) -> None:
    _alive.clear()
    gc.collect()
    monkeypatch.setattr(backends, "monokernel_status", lambda device: (True, ""))
    monkeypatch.setattr(backends, "_available", lambda name: True)
    monkeypatch.setitem(backends.BACKEND_CLASSES, "monokernel", (__name__, "FakeMonokernel"))
    monkeypatch.setitem(backends.BACKEND_CLASSES, "torch", (__name__, "FakeTorch"))


def _fail_with(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    monkeypatch.setattr(FakeMonokernel, "error", error)


NVCC_LOG = "nvcc failed building decode (nvcc -O3 ...):\n" + "error: x\n" * 500


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (UnsupportedModelError("head_dim 104 is not supported by the kernel"), "head_dim 104"),
        (BackendUnavailableError(NVCC_LOG), "nvcc failed building decode (nvcc -O3 ...):"),
        (RuntimeError("CUDA error: no kernel image is available"), "CUDA error: no kernel image"),
    ],
)
def test_auto_falls_back_to_torch_naming_why(
    monkeypatch: pytest.MonkeyPatch, error: BaseException, reason: str
) -> None:
    _fail_with(monkeypatch, error)
    heard: list[tuple[str, str]] = []

    def on_fallback(engine: str, why: str) -> int:
        heard.append((engine, why))
        return 8192  # the other engine's own context

    backend = backends.create_backend("auto", CFG, {}, 65536, GPU, on_fallback=on_fallback)
    assert isinstance(backend, FakeTorch) and backend.max_seq_len == 8192
    [(engine, why)] = heard
    assert engine == "torch" and why.startswith(reason)
    assert "\n" not in why and len(why) <= 200  # one line, not the whole nvcc log
    assert not backend.saw_leftovers


def test_a_named_monokernel_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_with(monkeypatch, UnsupportedModelError("head_dim 104 is not supported"))
    with pytest.raises(UnsupportedModelError, match="head_dim 104"):
        backends.create_backend("monokernel", CFG, {}, 4096, GPU, on_fallback=lambda e, w: 1)


def test_a_bug_is_not_hidden_by_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_with(monkeypatch, TypeError("a programming error"))
    with pytest.raises(TypeError):
        backends.create_backend("auto", CFG, {}, 4096, GPU)


def test_auto_keeps_a_monokernel_that_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    heard: list[str] = []
    backend = backends.create_backend(
        "auto", CFG, {}, 4096, GPU, on_fallback=lambda e, w: heard.append(w) or 1
    )
    assert isinstance(backend, FakeMonokernel) and backend.max_seq_len == 4096
    assert heard == []


def test_without_a_hook_the_fallback_keeps_the_context(monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_with(monkeypatch, BackendUnavailableError("nvcc was not found"))
    backend = backends.create_backend("auto", CFG, {}, 4096, GPU)
    assert isinstance(backend, FakeTorch) and backend.max_seq_len == 4096


def test_fallback_reason_is_one_short_line() -> None:
    assert backends.fallback_reason(RuntimeError("")) == "RuntimeError"
    long = backends.fallback_reason(RuntimeError("x" * 500))
    assert len(long) == 200 and long.endswith("…")


def test_no_fallback_once_the_monokernel_took_the_weights_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fail_with(monkeypatch, BackendUnavailableError("nvcc failed"))
    weights = {"consume": torch.zeros(1), "embed": torch.zeros(1)}
    with pytest.raises(BackendUnavailableError, match="nvcc failed"):
        backends.create_backend("auto", CFG, weights, 4096, GPU)  # type: ignore[arg-type]


class Recording(_Built):
    """Records its weights and keyword arguments (quantize, groups)."""

    got: ClassVar[dict[str, object]] = {}

    def __init__(
        self, cfg: object, weights: object, max_seq_len: int, device: object, **kw: object
    ) -> None:
        super().__init__(cfg, weights, max_seq_len, device)
        Recording.got = {"weights": weights, **kw}


SMALL = dataclasses.replace(
    CFG, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16
)


@pytest.mark.parametrize("engine", ["monokernel", "torch"])
def test_a_checkpoints_4bit_groups_reach_only_the_monokernel(
    monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """A 4-bit checkpoint's groups (Checkpoint.groups) are the monokernel's to stream; the
    other engines compute with the weights as loaded, already the groups' values, which
    --quantize int4 would otherwise round again."""
    monkeypatch.setitem(backends.BACKEND_CLASSES, engine, (__name__, "Recording"))
    weights = random_weights(SMALL, seed=1)
    groups = {"layers.0.wq": object()}
    backends.create_backend(engine, SMALL, weights, 64, GPU, quantize="int4", groups=groups)
    if engine == "monokernel":
        assert Recording.got["groups"] is groups and Recording.got["quantize"] == "int4"
    else:
        assert Recording.got["weights"] is weights and "groups" not in Recording.got
    backends.create_backend(engine, SMALL, weights, 64, GPU, quantize="int4")
    if engine == "torch":  # --quantize int4 on a bf16 checkpoint: the dequantised values
        got = Recording.got["weights"]
        assert isinstance(got, dict) and not torch.equal(got["layers.0.wq"], weights["layers.0.wq"])
