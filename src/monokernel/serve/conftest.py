"""Fixtures of the server tests: one tiny model and engine, shared live servers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from monokernel.runtime.engine import Engine, EngineConfig
from monokernel.serve.settings import ServerSettings
from monokernel.serve.testing_names import MAX_BODY_BYTES, MODEL_NAME
from monokernel.testing.tiny_models import make_tiny_model_dir

if TYPE_CHECKING:
    from monokernel.serve.testing import Served, SlowBackend

try:
    import fastapi  # noqa: F401
    import uvicorn  # noqa: F401
except ModuleNotFoundError:
    # Without the server extras there is nothing to test here (pip install '.[serve]').
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir("llama3", tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="session")
def engine(tiny_model_dir: Path) -> Engine:
    from monokernel.serve.testing import SlowBackend

    eng = Engine(tiny_model_dir, EngineConfig(engine="reference", device="cpu", progress=False))
    eng.backend = SlowBackend(eng.backend)
    return eng


@pytest.fixture
def slow(engine: Engine) -> Iterator[SlowBackend]:
    """The engine's backend; set ``delay_s`` in a test, reset afterwards."""
    from monokernel.serve.testing import SlowBackend

    backend = engine.backend
    assert isinstance(backend, SlowBackend)
    yield backend
    backend.delay_s = 0.0
    backend.fail_after = None


@pytest.fixture(scope="session")
def base_url(engine: Engine) -> Iterator[str]:
    """The shared server: queue of 1 (so tests can fill it), 64 KiB body limit."""
    from monokernel.serve.app import create_app
    from monokernel.serve.testing import live_server, wait_ready

    settings = ServerSettings(MODEL_NAME, max_queue=1, max_body_bytes=MAX_BODY_BYTES)
    with live_server(create_app(settings, lambda: engine)) as url:
        wait_ready(url)
        yield url


@pytest.fixture(scope="module")
def served_factory(tiny_model_dir: Path) -> Iterator[Callable[..., Served]]:
    """Makes live servers on scripted engines: ``make(template, special=None, **settings)``
    (settings as ServerSettings takes them, api_key say); all stop with the module."""
    from monokernel.serve.app import create_app
    from monokernel.serve.testing import Served, live_server, scripted_engine, wait_ready

    stack: list[Any] = []

    def make(template: str, special: str | None = None, **settings: Any) -> Served:
        eng = scripted_engine(tiny_model_dir, template, special)
        ctx = live_server(create_app(ServerSettings(MODEL_NAME, **settings), lambda: eng))
        url = ctx.__enter__()
        stack.append(ctx)
        wait_ready(url)
        return Served(eng, url)

    yield make
    for ctx in reversed(stack):
        ctx.__exit__(None, None, None)


@pytest.fixture(scope="module")
def served_reference(tiny_model_dir: Path) -> Iterator[tuple[Engine, str]]:
    """The reference engine on the tiny model as it is (no test backend in between), on
    loopback with the default settings."""
    from monokernel.serve.app import create_app
    from monokernel.serve.testing import live_server, wait_ready

    eng = Engine(tiny_model_dir, EngineConfig(engine="reference", device="cpu", progress=False))
    with live_server(create_app(ServerSettings(MODEL_NAME), lambda: eng)) as url:
        wait_ready(url)
        yield eng, url
