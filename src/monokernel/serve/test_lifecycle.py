"""Disconnects, loading, API keys and the command line."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from monokernel.runtime.engine import Engine
from monokernel.serve.app import create_app
from monokernel.serve.settings import ServerSettings
from monokernel.serve.testing import (
    SlowBackend,
    free_port,
    live_server,
    serve_process,
    wait_serving,
)
from monokernel.serve.testing_names import MODEL_NAME

openai = pytest.importorskip("openai")


def _metric(base_url: str, name: str) -> float:
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


CANCELLED = 'monokernel_request_success_total{finished_reason="cancelled"}'


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_at_once(base_url: str, slow: SlowBackend, stream: bool) -> None:
    """An abandoned 200-token request (~5 s at 25 ms a token) must not delay the next."""
    slow.delay_s = 0.025
    cancelled_before = _metric(base_url, CANCELLED)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=30)
    long: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": "def f(x):",
        "max_tokens": 200,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    if stream:
        abandoned = client.completions.create(stream=True, **long)
        chunks = iter(abandoned)
        for _ in range(3):
            next(chunks)
        abandoned.close()
    else:
        impatient = client.with_options(timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(**long)
    start = time.perf_counter()
    follow = client.completions.create(
        model=MODEL_NAME, prompt="x =", max_tokens=3, temperature=0, stream=True
    )
    pieces = list(follow)
    ttft_s = time.perf_counter() - start
    timings = (pieces[-1].model_extra or {})["timings"]
    # Waiting out the abandoned request would take seconds; a cancel takes one token.
    assert ttft_s < 1.0, f"the next request waited {ttft_s:.2f} s"
    assert timings["queue_ms"] < 500
    assert _metric(base_url, CANCELLED) == cancelled_before + 1


def test_health_is_503_while_loading(engine: Engine) -> None:
    release = threading.Event()

    def load() -> Engine:
        release.wait(20)
        return engine

    with live_server(create_app(ServerSettings(MODEL_NAME), load)) as url:
        r = httpx.get(url + "/health")
        assert (r.status_code, r.json()["status"]) == (503, "loading")
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        assert r.headers["retry-after"] == "1"
        assert httpx.get(url + "/").status_code == 200  # the page is up before the model
        release.set()
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_load_failure_is_reported(tmp_path: Path) -> None:
    seen: list[BaseException] = []

    def load() -> Engine:
        raise FileNotFoundError("no such model: /nowhere")

    with live_server(create_app(ServerSettings("m"), load, seen.append)) as url:
        deadline = time.monotonic() + 10
        while not seen:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and "no such model" in r.json()["error"]
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and "failed to load" in r.json()["error"]["message"]


def test_api_key(engine: Engine) -> None:
    app = create_app(ServerSettings(MODEL_NAME, api_key="sekrit"), lambda: engine)
    with live_server(app) as url:
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
        missing = httpx.post(url + "/v1/completions", json=body)
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "invalid_api_key"
        assert "missing API key" in missing.json()["error"]["message"]
        assert httpx.get(url + "/v1/models").status_code == 401
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
            wrong.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
        right = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0)
        r = right.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
        assert r.usage is not None and r.usage.completion_tokens >= 1
        # The page and probes stay open.
        while httpx.get(url + "/health").status_code != 200:
            time.sleep(0.01)
        assert httpx.get(url + "/").status_code == 200
        assert httpx.get(url + "/metrics").status_code == 200


def test_cli_serves_a_model(tiny_model_dir: Path) -> None:
    port = free_port()
    proc = serve_process(
        str(tiny_model_dir),
        "--engine", "reference", "--device", "cpu", "--port", str(port),
        "--served-model-name", "tiny", "--max-queue", "2", "--log-level", "warning",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(proc, url)
        r = httpx.post(
            url + "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
        )
        assert r.status_code == 200, r.text
        assert httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"] == 256
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert re.search(rf"base_url http://127\.0\.0\.1:{port}/v1", err)


def test_cli_exits_when_the_model_cannot_load() -> None:
    proc = serve_process("/does/not/exist", "--port", str(free_port()), "--device", "cpu")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "could not load the model" in err and "/does/not/exist" in err


def test_backend_failure_is_reported_and_the_server_goes_on(
    base_url: str, slow: SlowBackend
) -> None:
    slow.fail_after = 2
    body = {"model": MODEL_NAME, "prompt": "x =", "max_tokens": 8, "temperature": 0}
    r = httpx.post(base_url + "/v1/completions", json=body)
    assert r.status_code == 500
    assert "injected backend failure" in r.json()["error"]["message"]
    with httpx.stream("POST", base_url + "/v1/completions", json=body | {"stream": True}) as s:
        lines = [ln for ln in s.iter_lines() if ln]
    assert "injected backend failure" in lines[-2] and lines[-1] == "data: [DONE]"
    slow.fail_after = None
    assert httpx.post(base_url + "/v1/completions", json=body).status_code == 200
