"""Bad requests: each gets the right status and an OpenAI-shaped error naming the problem,
and the server keeps serving afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from monokernel.serve.testing_names import CHAT, COMPLETIONS, MAX_BODY_BYTES, MODEL_NAME

USER = [{"role": "user", "content": "hi"}]


def _p(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": 4} | fields


def _c(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": USER, "max_tokens": 4} | fields


def _chunked(data: bytes) -> Iterator[bytes]:
    # A generator body goes out chunked, with no Content-Length to refuse it early.
    for i in range(0, len(data), 8192):
        yield data[i : i + 8192]


# (id, method, path, json body or raw bytes, status, message fragment, param)
# fmt: off
CASES: list[tuple[str, str, str, Any, int, str, str | None]] = [
    ("context", "POST", COMPLETIONS, _p(max_tokens=250), 400,
     "the prompt (7 tokens) plus max_tokens (250) is 257 tokens, over the context limit of 256",
     "max_tokens"),
    ("context-chat", "POST", CHAT, _c(messages=[{"role": "user", "content": "word " * 300}]),
     400, "over the context limit of 256", "max_tokens"),
    ("prompt-fills-context", "POST", COMPLETIONS,
     {"prompt": "for i in range(10): " * 60}, 400, "leaves no room to generate", "prompt"),
    ("temperature", "POST", COMPLETIONS, _p(temperature=-0.5), 400,
     "temperature must be in [0, 2], got -0.5", "temperature"),
    ("top_p-zero", "POST", COMPLETIONS, _p(top_p=0), 400, "top_p must be in (0, 1]", "top_p"),
    ("top_p-big", "POST", CHAT, _c(top_p=1.5), 400, "top_p must be in (0, 1], got 1.5", "top_p"),
    ("top_k", "POST", COMPLETIONS, _p(top_k=-2), 400, "top_k must be an integer in [-1, 2^63)",
     "top_k"),
    ("max_tokens", "POST", COMPLETIONS, _p(max_tokens=0), 400,
     "max_tokens must be an integer >= 1, got 0", "max_tokens"),
    ("max_completion_tokens", "POST", CHAT, _c(max_completion_tokens=-3), 400,
     "max_completion_tokens must be an integer >= 1", "max_completion_tokens"),
    ("n", "POST", CHAT, _c(n=17), 400, "n must be in [1, 16] (choices), got 17", "n"),
    ("seed", "POST", COMPLETIONS, _p(seed=-1), 400, "seed must be an integer in [0, 2^64)", "seed"),
    ("stop-empty", "POST", COMPLETIONS, _p(stop=[""]), 400, "non-empty strings", "stop"),
    ("model", "POST", CHAT, _c(model="gpt-4"), 404, "the model 'gpt-4' does not exist", "model"),
    ("logprobs", "POST", CHAT, _c(logprobs=2), 400, "logprobs must be a boolean, got 2",
     "logprobs"),
    ("tools", "POST", CHAT, _c(tools=[{"type": "function"}]), 400,
     "tools[0].function is required", "tools[0].function"),
    ("penalty", "POST", COMPLETIONS, _p(presence_penalty=-3), 400,
     "presence_penalty must be in [-2, 2], got -3", "presence_penalty"),
    ("empty-prompt", "POST", COMPLETIONS, _p(prompt=""), 400, "the prompt is empty", "prompt"),
    ("two-prompts", "POST", COMPLETIONS, _p(prompt=["a", "b"]), 400, "holds 2 prompts",
     "prompt"),
    ("bad-token-id", "POST", COMPLETIONS, _p(prompt=[1, 99999]), 400,
     "prompt token ids must be in", "prompt"),
    ("no-messages", "POST", CHAT, _c(messages=[]), 400, "at least one message", "messages"),
    ("image-part", "POST", CHAT,
     _c(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, "only text parts are supported", "messages[0].content"),
    ("message-no-role", "POST", CHAT, _c(messages=[{"content": "hi"}]), 400,
     "messages.0.role is required", "messages.0.role"),
    ("wrong-type", "POST", COMPLETIONS, _p(temperature="hot"), 400,
     "temperature: Input should be a valid number", "temperature"),
    ("wrong-type-tokens", "POST", COMPLETIONS, _p(max_tokens="many"), 400,
     "max_tokens: Input should be a valid integer", "max_tokens"),
    ("missing-prompt", "POST", COMPLETIONS, {"model": MODEL_NAME}, 400, "prompt is required",
     "prompt"),
    ("malformed-json", "POST", CHAT, b'{"messages": [', 400, "not valid JSON", None),
    ("json-array", "POST", COMPLETIONS, b"[1, 2]", 400, "must be a JSON object", None),
    ("too-large", "POST", COMPLETIONS, _p(prompt="x" * (MAX_BODY_BYTES + 10)), 413,
     f"over the limit of {MAX_BODY_BYTES} bytes", None),
    ("too-large-chunked", "POST", CHAT, b"{" + b" " * (MAX_BODY_BYTES + 10) + b"}", 413,
     "over the limit", None),
    ("no-route", "POST", "/v1/embeddings", _p(), 404, "no route POST /v1/embeddings", None),
    ("wrong-method", "GET", COMPLETIONS, None, 405, "Method Not Allowed", None),
]
# fmt: on


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=30) as client:
        yield client


def test_bad_inputs_then_a_good_request(http: httpx.Client) -> None:
    failures: list[str] = []
    for name, method, path, body, status, fragment, param in CASES:
        if isinstance(body, bytes):
            content = _chunked(body) if name.endswith("chunked") else body
            r = http.request(method, path, content=content)
        else:
            r = http.request(method, path, json=body)
        try:
            error = r.json()["error"]
        except Exception:
            failures.append(f"{name}: {r.status_code} not an OpenAI error: {r.text[:200]}")
            continue
        problems = []
        if r.status_code != status:
            problems.append(f"status {r.status_code} != {status}")
        if fragment not in error["message"]:
            problems.append(f"message {error['message']!r} lacks {fragment!r}")
        if error.get("param") != param:
            problems.append(f"param {error.get('param')!r} != {param!r}")
        if set(error) != {"message", "type", "param", "code"}:
            problems.append(f"keys {sorted(error)}")
        if problems:
            failures.append(f"{name}: " + "; ".join(problems))
    assert not failures, "\n".join(failures)

    good = http.post(COMPLETIONS, json=_p(temperature=0))
    assert good.status_code == 200, good.text
    assert good.json()["choices"][0]["text"] is not None
    assert http.get("/health").status_code == 200
    metrics = http.get("/metrics").text
    assert 'monokernel_request_rejected_total{status="400"}' in metrics
    assert 'monokernel_request_rejected_total{status="413"}' in metrics


def test_queue_full_gets_503_retry_after(base_url: str, http: httpx.Client, slow: Any) -> None:
    """max_queue=1: one running, one waiting, the third is refused at once."""
    slow.delay_s = 0.02
    long = _p(max_tokens=200, ignore_eos=True, stream=True)
    with (
        httpx.Client(base_url=base_url, timeout=30) as a,
        httpx.Client(base_url=base_url, timeout=30) as b,
        a.stream("POST", COMPLETIONS, json=long) as running,
    ):
        lines = running.iter_lines()  # kept: dropping the iterator would close the stream
        next(lines)  # its first token: it holds the engine
        with b.stream("POST", COMPLETIONS, json=long) as waiting:
            assert waiting.status_code == 200  # the stream opens; tokens come after its turn
            _wait_for_metric(http, "monokernel_num_requests_waiting", 1)
            r = http.post(COMPLETIONS, json=_p())
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            assert "busy" in r.json()["error"]["message"]
            assert r.json()["error"]["code"] == "queue_full"
    # Both clients left: the queue drains and the next request runs.
    slow.delay_s = 0.0
    r = http.post(COMPLETIONS, json=_p())
    assert r.status_code == 200, r.text
    _wait_for_metric(http, "monokernel_num_requests_waiting", 0)


def _wait_for_metric(http: httpx.Client, name: str, value: float, timeout_s: float = 5) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        for line in http.get("/metrics").text.splitlines():
            if line.startswith(name + " ") and float(line.split()[1]) == value:
                return
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)
