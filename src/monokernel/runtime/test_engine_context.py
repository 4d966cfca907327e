"""The Engine's side of long context: refusals before any backend work, the prefix-reuse
switch reaching the backend, and the memory plan counting the weights as the monokernel will
hold them, planned before they reach the device."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from monokernel import Engine, EngineConfig, SamplingParams
from monokernel.errors import InvalidRequestError
from monokernel.models.config import ModelConfig
from monokernel.runtime import engine as engine_mod
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.memory_plan import ContextPlan, LayerPacking
from monokernel.testing.tiny_models import make_tiny_model_dir
from monokernel.weights.loader import Checkpoint


class _RecordingBackend:
    """Counts every call; generates token 5 forever."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.reuse: list[bool] = []

    def stream(self, request: DecodeRequest, cancel: CancelToken) -> Iterator[int]:
        self.calls.append("stream")
        while True:
            yield 5

    def set_prefix_reuse(self, enabled: bool) -> None:
        self.reuse.append(enabled)

    def close(self) -> None:
        self.calls.append("close")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir("qwen2", tmp_path_factory.mktemp("ctx") / "tiny")


def _engine(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, **config: object
) -> tuple[Engine, _RecordingBackend]:
    backend = _RecordingBackend()
    monkeypatch.setattr(engine_mod, "create_backend", lambda *a, **k: backend)
    cfg = EngineConfig(engine="reference", device="cpu", max_model_len=64, **config)  # type: ignore[arg-type]
    return Engine(model_dir, cfg), backend


def test_over_the_context_is_refused_before_the_backend_runs(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng, backend = _engine(model_dir, monkeypatch)
    long_prompt = list(range(10, 70))  # 60 ids
    with pytest.raises(InvalidRequestError, match=r"60 tokens.*max_tokens \(5\).*limit of 64"):
        eng.generate("x", SamplingParams(max_tokens=5), prompt_ids=long_prompt)
    with pytest.raises(InvalidRequestError, match="limit of 64"):
        eng.generate("x", SamplingParams(max_tokens=1), prompt_ids=list(range(64)))
    assert backend.calls == []
    # At the limit exactly it runs.
    out = list(eng.generate("x", SamplingParams(max_tokens=4), prompt_ids=long_prompt))
    assert backend.calls == ["stream"] and len(out) == 5


@pytest.mark.parametrize(("setting", "seen"), [(None, []), (False, [False]), (True, [True])])
def test_prefix_reuse_setting_reaches_the_backend(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, setting: bool | None, seen: list[bool]
) -> None:
    _, backend = _engine(model_dir, monkeypatch, prefix_reuse=setting)
    assert backend.reuse == seen  # None leaves the backend's own default


# --------------------------------------------------------------------------- the weights' plan


class _Stop(Exception):
    """Raised where the weights would go to the device: the end of these tests."""


def _planned(
    monkeypatch: pytest.MonkeyPatch, mark: Callable[[Checkpoint], Checkpoint] | None = None
) -> tuple[list[str], list[LayerPacking]]:
    """The Engine's steps up to its cast of the weights to the device, a monokernel on this
    CPU: the loader's start and end, each plan (and the layer packing it counted), the cast.
    ``mark``: changes the checkpoint the loader hands back."""
    events: list[str] = []
    layers: list[LayerPacking] = []
    real_load = engine_mod.load_checkpoint

    def load(*args: Any, **kwargs: Any) -> Checkpoint:
        events.append("load")
        ckpt = real_load(*args, **kwargs)
        events.append("loaded")
        return mark(ckpt) if mark is not None else ckpt

    def plan(
        cfg: ModelConfig, free: int | None, weights: int, engine: str, *rest: Any
    ) -> ContextPlan:
        events.append(f"plan {engine}")
        layers.append(rest[-1].layers)
        return ContextPlan(64, "context: 64 tokens")

    def cast(*args: Any) -> None:
        events.append("cast")
        raise _Stop

    monkeypatch.setattr(engine_mod, "resolve_engine", lambda name, device: name)
    monkeypatch.setattr(engine_mod, "load_checkpoint", load)
    monkeypatch.setattr(engine_mod, "plan_context", plan)
    monkeypatch.setattr(engine_mod, "cast_weights", cast)
    monkeypatch.setattr(engine_mod.Tokenizer, "load", lambda *a, **k: None)
    return events, layers


def test_a_gguf_of_groups_is_planned_packed_once_read_and_before_its_cast(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No plan in the loader's hook, on the bf16 count a GGUF's layers never take; one once
    its own groups are known, counting them as the monokernel packs them."""
    pytest.importorskip("gguf")
    from monokernel.weights.loader import load_checkpoint
    from monokernel.weights.quantize import groups_plan
    from monokernel.weights.test_gguf_loader import QT, k_quant_gguf

    path = k_quant_gguf(tmp_path / "m.gguf", (QT.Q4_K, QT.Q6_K))  # a Q4_K_M
    ckpt = load_checkpoint(path, progress=False)
    assert ckpt.quantization == "int8" and ckpt.groups is not None
    plan, _ = groups_plan(ckpt.config, ckpt.groups)
    events, layers = _planned(monkeypatch)
    with pytest.raises(_Stop):
        Engine(path, EngineConfig(engine="monokernel", device="cpu", progress=False))
    assert events == ["load", "loaded", "plan monokernel", "cast"]
    assert layers == [LayerPacking("int8", plan, groups_on_device=False)]
    # --quantize of another method re-quantises the dense values: counted as such.
    events, layers = _planned(monkeypatch)
    config = EngineConfig(engine="monokernel", device="cpu", progress=False, quantize="fp8")
    with pytest.raises(_Stop):
        Engine(path, config)
    assert layers == [LayerPacking("fp8")]


def test_safetensors_are_planned_before_they_are_read_and_again_where_the_checkpoint_differs(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events, layers = _planned(monkeypatch)
    config = EngineConfig(engine="monokernel", device="cpu", progress=False, quantize="int8")
    with pytest.raises(_Stop):
        Engine(model_dir, config)
    assert events == ["load", "plan monokernel", "loaded", "cast"]
    assert layers == [LayerPacking("int8")]
    # A checkpoint that turns out FP8 runs fp8: planned again in that format, on the free
    # bytes measured before it loaded; the torch engine holds it dense either way.
    fp8 = functools.partial(dataclasses.replace, quantization="fp8")
    events, layers = _planned(monkeypatch, fp8)
    with pytest.raises(_Stop):
        Engine(model_dir, EngineConfig(engine="monokernel", device="cpu", progress=False))
    assert events == ["load", "plan monokernel", "loaded", "plan monokernel", "cast"]
    assert layers == [LayerPacking(), LayerPacking("fp8")]
    events, layers = _planned(monkeypatch, fp8)
    with pytest.raises(_Stop):
        Engine(model_dir, EngineConfig(engine="torch", device="cpu", progress=False))
    assert events == ["load", "plan torch", "loaded", "cast"]


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_block_scales_are_planned_as_blocks_where_they_stream(tp: int) -> None:
    """An FP8 checkpoint's 128 x 128 block scales, which the backend streams as they are
    where the layers stream as fp8 tiles (blocks_stream; at --tp, tp_blocks_stream): the plan
    counts them as blocks, as the backend's check does; elsewhere a scale a row."""
    from types import SimpleNamespace

    from monokernel.models.shapes import SHAPES
    from monokernel.weights.checkpoint_quant import Fp8Blocks

    blocks = Fp8Blocks(128, 128, {})
    engine = SimpleNamespace(engine_name="monokernel", config=SimpleNamespace(tp=tp))
    big, small = SHAPES["llama-3.1-8b"], SHAPES["qwen2.5-coder-1.5b"]
    packing = Engine._layer_packing(engine, big, "fp8", None, blocks)  # type: ignore[arg-type]
    assert packing == LayerPacking("fp8", fp8_block=128)
    # Where the layers are rows, not tiles, the scales are re-made one a row.
    assert Engine._layer_packing(engine, small, "fp8", None, blocks) == LayerPacking("fp8")  # type: ignore[arg-type]
    assert Engine._layer_packing(engine, big, "fp8", None, None) == LayerPacking("fp8")  # type: ignore[arg-type]
