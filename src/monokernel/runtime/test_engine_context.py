"""The Engine's side of long context: refusals before any backend work, the prefix-reuse
switch reaching the backend."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from monokernel import Engine, EngineConfig, SamplingParams
from monokernel.errors import InvalidRequestError
from monokernel.runtime import engine as engine_mod
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.testing.tiny_models import make_tiny_model_dir


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
