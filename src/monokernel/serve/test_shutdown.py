"""Shutdown: on SIGTERM new requests get 503, running streams get the grace period, then
every open stream ends with an error event and [DONE] and every queued request with a 503.

In-process servers run on a thread, where signals cannot be delivered: these tests call
``handle_exit``, which is what uvicorn's SIGTERM handler calls; the CLI test sends a real
SIGTERM to ``monokernel serve``.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from monokernel.runtime.engine import Engine
from monokernel.serve.settings import ServerSettings
from monokernel.serve.testing import (
    SlowBackend,
    free_port,
    serve_process,
    serving,
    wait_ready,
    wait_serving,
)
from monokernel.serve.testing_names import COMPLETIONS, MODEL_NAME


def _body(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "prompt": "x =",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def _events(lines: list[str]) -> list[Any]:
    return [ln[6:] if ln == "data: [DONE]" else json.loads(ln[6:]) for ln in lines if ln]


def _wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_running_stream_finishes_within_the_grace_period(engine: Engine, slow: SlowBackend) -> None:
    from monokernel.serve.app import create_app

    slow.delay_s = 0.02  # 40 tokens: ~0.8 s, well inside the 10 s grace
    app = create_app(ServerSettings(MODEL_NAME, shutdown_timeout_s=10), lambda: engine)
    with serving(app) as (url, server), httpx.Client(base_url=url, timeout=30) as client:
        wait_ready(url)
        with client.stream("POST", COMPLETIONS, json=_body(40, True)) as s:
            lines = s.iter_lines()
            first = next(lines)
            server.handle_exit(signal.SIGTERM, None)
            _wait(lambda: app.state.monokernel.draining, 5, "the drain never started")
            # Not admitted any more, in OpenAI's shape; /health says so for balancers.
            with httpx.Client(base_url=url, timeout=10) as other:
                refused = other.post(COMPLETIONS, json=_body(2, False))
                health = other.get("/health")
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "shutting_down"
            assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
            assert health.status_code == 503
            events = _events([first, *lines])
        assert events[-1] == "[DONE]"
        finals = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
        assert finals and finals[-1]["choices"][0]["finish_reason"] == "length"
        assert not any("error" in e for e in events[:-1])
        _wait(lambda: server.should_exit, 5, "the server did not stop after the drain")


def test_after_the_grace_streams_end_in_band_and_queued_requests_get_503(
    engine: Engine, slow: SlowBackend
) -> None:
    from monokernel.serve.app import create_app

    slow.delay_s = 0.05  # 200 tokens: ~10 s, far past the 0.5 s grace
    settings = ServerSettings(MODEL_NAME, max_queue=4, shutdown_timeout_s=0.5)
    app = create_app(settings, lambda: engine)
    state = app.state.monokernel
    queued_reply: list[httpx.Response] = []
    with serving(app) as (url, server):
        wait_ready(url)
        with (
            httpx.Client(base_url=url, timeout=30) as a,
            httpx.Client(base_url=url, timeout=30) as b,
            a.stream("POST", COMPLETIONS, json=_body(200, True)) as running,
        ):
            running_lines = running.iter_lines()
            first = next(running_lines)  # it holds the engine
            with b.stream("POST", COMPLETIONS, json=_body(200, True)) as waiting:
                waiting_lines = waiting.iter_lines()

                def post_queued() -> None:
                    queued_reply.append(httpx.post(url + COMPLETIONS, json=_body(5, False)))

                poster = threading.Thread(target=post_queued)
                poster.start()
                _wait(lambda: state.scheduler.waiting == 2, 5, "the requests never queued")
                start = time.monotonic()
                server.handle_exit(signal.SIGTERM, None)
                running_events = _events([first, *running_lines])
                waiting_events = _events(list(waiting_lines))
                poster.join(timeout=10)
                took = time.monotonic() - start
    assert took < 6, f"the drain took {took:.1f} s with a 0.5 s grace"
    for events in (running_events, waiting_events):
        assert events[-1] == "[DONE]", events[-3:]
        error = events[-2]["error"]
        assert error["code"] == "shutting_down" and error["type"] == "server_error"
        assert "--shutdown-timeout" in error["message"]
    assert "still running" in running_events[-2]["error"]["message"]
    assert "still queued" in waiting_events[-2]["error"]["message"]
    assert queued_reply, "the queued request got no answer"
    r = queued_reply[0]
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "shutting_down"
    assert not state.generations


def test_cli_sigterm_drains_and_exits_zero(tiny_model_dir: Path) -> None:
    port = free_port()
    proc = serve_process(
        str(tiny_model_dir), "--engine", "reference", "--device", "cpu", "--port", str(port),
        "--served-model-name", MODEL_NAME, "--shutdown-timeout", "5", "--log-level", "info",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(proc, url)
        with httpx.stream("POST", url + COMPLETIONS, json=_body(200, True), timeout=30) as s:
            lines = s.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            events = _events([first, *lines])
        # Finished within the grace, or ended by it: either way a final event and [DONE].
        assert events[-1] == "[DONE]"
        assert "error" in events[-2] or events[-2]["choices"][0]["finish_reason"] == "length"
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "shutting down: refusing new requests" in err
