"""The endpoint client against a tiny fake OpenAI-compatible server (stdlib, SSE)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from monokernel.bench.endpoint import EndpointError, EndpointRunner, prompt_text


class _FakeOpenAI(BaseHTTPRequestHandler):
    """/v1/models lists one model; /v1/completions streams one text chunk per token (a
    role-less empty chunk first, like some servers), then usage and [DONE]."""

    bodies: ClassVar[list[dict[str, Any]]] = []

    def log_message(self, *args: Any) -> None:  # keep pytest output clean
        pass

    def do_GET(self) -> None:
        if self.path != "/v1/models":
            self.send_error(404)
            return
        payload = json.dumps({"data": [{"id": "fake-model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        if body["model"] != "fake-model":
            payload = json.dumps({"error": {"message": "unknown model"}}).encode()
            self.send_response(404)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the stream ends when the connection closes

        def event(obj: Any) -> None:
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

        event({"choices": [{"index": 0, "text": ""}]})
        for i in range(body["max_tokens"]):
            event({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]})
        n_prompt = len(body["prompt"]) if isinstance(body["prompt"], list) else 0
        event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        usage = {"prompt_tokens": n_prompt, "completion_tokens": body["max_tokens"]}
        event({"choices": [], "usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture()
def server() -> Iterator[str]:
    _FakeOpenAI.bodies = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("transport", ["httpx", "urllib"])
def test_streams_and_times_at_the_client(server: str, transport: str) -> None:
    if transport == "httpx":
        pytest.importorskip("httpx")
    runner = EndpointRunner(server + "/v1/", transport=transport)  # model from /v1/models
    assert runner.model == "fake-model"
    timing = runner.run([11, 12, 13], 5)
    runner.close()
    assert timing.tokens == 5
    assert timing.ttft_s > 0 and timing.decode_s_per_token >= 0
    (body,) = _FakeOpenAI.bodies
    assert body["prompt"] == [11, 12, 13] and body["max_tokens"] == 5
    assert body["stream"] is True and body["temperature"] == 0.0 and body["ignore_eos"] is True
    assert runner.info["endpoint_prompt_tokens"] == 3


def test_text_prompt(server: str) -> None:
    runner = EndpointRunner(server, model="fake-model", prompt_mode="text", transport="urllib")
    runner.run([0, 1, 2], 2)
    assert _FakeOpenAI.bodies[-1]["prompt"] == prompt_text([0, 1, 2])
    assert prompt_text([0, 1, 2]).count(" ") == 3  # one word per token id


@pytest.mark.parametrize("transport", ["httpx", "urllib"])
def test_errors_name_the_status(server: str, transport: str) -> None:
    if transport == "httpx":
        pytest.importorskip("httpx")
    runner = EndpointRunner(server, model="other", transport=transport)
    with pytest.raises(EndpointError, match="404"):
        runner.run([1], 2)
    runner.close()


def test_unreachable_server() -> None:
    with pytest.raises(EndpointError, match="could not reach"):
        EndpointRunner("http://127.0.0.1:9", transport="urllib")  # discard port: refused


def test_endpoint_in_a_sweep_needs_no_weights(server: str) -> None:
    import torch

    from monokernel.bench.engines import EngineOptions
    from monokernel.bench.sweep import SweepConfig, run_benchmark
    from monokernel.models.shapes import SHAPES

    options = EngineOptions(endpoint_url=server, endpoint_transport="urllib")
    config = SweepConfig(("endpoint",), (4, 8), (3,), repeats=2, options=options)
    doc = run_benchmark(
        SHAPES["smollm2-135m"], None, "fake", config, torch.device("cpu"), {}, log=lambda _: None
    )
    assert [c["status"] for c in doc["cells"]] == ["ok", "ok"]
    assert all(c["endpoint_model"] == "fake-model" for c in doc["cells"])
    # One warm-up and two timed requests per cell, each with a fresh prompt.
    prompts = [tuple(b["prompt"]) for b in _FakeOpenAI.bodies]
    assert len(prompts) == 6 and len(set(prompts)) == 6


def test_endpoint_turns_send_the_base_then_base_plus_new_ids(server: str) -> None:
    import torch

    from monokernel.bench.engines import EngineOptions
    from monokernel.bench.sweep import SweepConfig, run_benchmark
    from monokernel.models.shapes import SHAPES

    options = EngineOptions(endpoint_url=server, endpoint_transport="urllib")
    config = SweepConfig(("endpoint",), (6,), (3,), repeats=2, options=options, turn_tokens=4)
    doc = run_benchmark(
        SHAPES["smollm2-135m"], None, "fake", config, torch.device("cpu"), {}, log=lambda _: None
    )
    (cell,) = doc["cells"]
    assert cell["status"] == "ok" and cell["request_prompt_tokens"] == 10
    base, warm_turn, again0, turn1, again, turn2 = (b["prompt"] for b in _FakeOpenAI.bodies)
    # the warm-up, one untimed turn, and the base re-run before every later turn
    assert len(base) == 6 and again0 == again == base and len(warm_turn) == 10
    assert turn1[:6] == base == turn2[:6] and len(turn1) == len(turn2) == 10
    assert turn1[6:] != turn2[6:]
    assert cell["endpoint_prompt_tokens"] == 10  # the server's usage, from the last turn
