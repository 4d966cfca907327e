"""An engine that fails for good (a GPU kernel that faulted, or stalled and would not stop):
its request gets a 503 naming why, /health turns 503 "failed", new requests are refused, and
the server drains and stops with exit status 70 for a supervisor to restart it. The failing
backend is scripted here; the GPU tests inject a real stall into the monokernel."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from monokernel.errors import EngineFailedError
from monokernel.runtime.backends.base import Backend, CancelToken, DecodeRequest
from monokernel.runtime.engine import Engine, EngineConfig
from monokernel.serve.server import EXIT_FAILED
from monokernel.serve.settings import ServerSettings
from monokernel.serve.testing import serving, wait_ready
from monokernel.serve.testing_names import COMPLETIONS, MODEL_NAME


class FailingBackend:
    """A backend whose next request fails the way a stalled monokernel does: the error, and
    ``failure`` set for good."""

    def __init__(self, inner: Backend) -> None:
        self.inner, self.name = inner, inner.name
        self.failure: str | None = None

    def stream(self, request: DecodeRequest, cancel: CancelToken) -> Iterator[int]:
        self.failure = "the monokernel produced no token for 30 s (injected)"
        raise EngineFailedError(self.failure)
        yield 0  # a generator, as every backend's stream is

    def close(self) -> None:
        self.inner.close()


def test_a_failed_engine_answers_503_turns_unhealthy_and_stops_the_server(
    tiny_model_dir: Path,
) -> None:
    from monokernel.serve.app import create_app

    engine = Engine(tiny_model_dir, EngineConfig(engine="reference", device="cpu", progress=False))
    engine.backend = FailingBackend(engine.backend)  # type: ignore[assignment]
    app = create_app(ServerSettings(MODEL_NAME), lambda: engine)
    with serving(app) as (url, server):
        wait_ready(url)
        body = {"model": MODEL_NAME, "prompt": "x =", "max_tokens": 4, "temperature": 0}
        r = httpx.post(url + COMPLETIONS, json=body, timeout=30)
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "engine_failed" and "produced no token" in error["message"]
        # Until the drain closes the listener, /health says why and requests are refused.
        deadline = time.monotonic() + 10
        while not server.should_exit:
            assert time.monotonic() < deadline, "the server did not stop after the failure"
            try:
                health = httpx.get(url + "/health", timeout=5)
                assert health.status_code == 503 and health.json()["status"] == "failed"
                again = httpx.post(url + COMPLETIONS, json=body, timeout=5)
                assert again.status_code == 503 and again.json()["error"]["code"] in (
                    "engine_failed",
                    "shutting_down",
                )
            except httpx.TransportError:
                break  # already closed
            time.sleep(0.05)
        assert app.state.monokernel.exit_status == EXIT_FAILED
