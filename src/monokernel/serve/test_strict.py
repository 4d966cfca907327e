"""Strict requests: no type coercion, bounded numbers, known roles, no field ignored,
bounded echoes, and the API key's scheme matched case-insensitively."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from monokernel.runtime.engine import Engine
from monokernel.serve.body import MAX_ECHO_CHARS
from monokernel.serve.settings import ServerSettings
from monokernel.serve.testing_names import CHAT, COMPLETIONS, MODEL_NAME

USER = [{"role": "user", "content": "hi"}]


def _p(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "x =", "max_tokens": 2} | fields


def _c(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": USER, "max_tokens": 2} | fields


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=30) as client:
        yield client


# (id, path, body (dict or raw JSON text), message fragment, param)
# fmt: off
REFUSED: list[tuple[str, str, Any, str, str | None]] = [
    ("max_tokens-str", COMPLETIONS, _p(max_tokens="5"), "valid integer", "max_tokens"),
    ("max_tokens-float", COMPLETIONS, _p(max_tokens=5.0), "valid integer", "max_tokens"),
    ("stream-str", COMPLETIONS, _p(stream="yes"), "valid boolean", "stream"),
    ("stream-int", CHAT, _c(stream=1), "valid boolean", "stream"),
    ("temperature-bool", COMPLETIONS, _p(temperature=True), "valid number", "temperature"),
    ("ignore_eos-str", COMPLETIONS, _p(ignore_eos="true"), "valid boolean", "ignore_eos"),
    ("include_usage-str", COMPLETIONS, _p(stream=True, stream_options={"include_usage": "yes"}),
     "valid boolean", "stream_options.include_usage"),
    ("content-int", CHAT, _c(messages=[{"role": "user", "content": 5}]), "", "messages.0.content"),
    ("temperature-high", COMPLETIONS, _p(temperature=2.5), "temperature must be in [0, 2]",
     "temperature"),
    ("temperature-inf", COMPLETIONS,
     '{"prompt": "x", "max_tokens": 2, "temperature": Infinity}', "got inf", "temperature"),
    ("temperature-nan", CHAT,
     '{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "got nan",
     "temperature"),
    ("top_p-nan", COMPLETIONS, '{"prompt": "x", "top_p": NaN}', "top_p must be in (0, 1]",
     "top_p"),
    ("seed-2^64", COMPLETIONS, _p(seed=2**64), "seed must be an integer in [0, 2^64)", "seed"),
    ("seed-huge", COMPLETIONS, _p(seed=10**90), "seed must be an integer in [0, 2^64)", "seed"),
    ("top_k-huge", COMPLETIONS, _p(top_k=2**70), "top_k must be an integer in [-1, 2^63)",
     "top_k"),
    ("max_tokens-digits", COMPLETIONS, '{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}",
     "not valid JSON", None),
    ("max_tokens-huge", COMPLETIONS, _p(max_tokens=10**40), "is over the context limit of 256",
     "max_tokens"),
    ("role", CHAT, _c(messages=[{"role": "wizard", "content": "hi"}]),
     "messages[0].role is 'wizard'; expected one of system, developer, user", "messages[0].role"),
    ("repetition_penalty", COMPLETIONS, _p(repetition_penalty=0),
     "repetition_penalty must be > 0", "repetition_penalty"),
    ("min_p", CHAT, _c(min_p=1.5), "min_p must be in [0, 1]", "min_p"),
    ("continue_final_message", CHAT, _c(continue_final_message=True),
     "continue_final_message=True is not supported", "continue_final_message"),
    ("continuous_usage_stats", COMPLETIONS,
     _p(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}),
     "stream_options.continuous_usage_stats=True is not supported",
     "stream_options.continuous_usage_stats"),
    ("stream_options-unknown", CHAT, _c(stream=True, stream_options={"foo": 1}),
     "unrecognized request argument supplied: stream_options.foo", "stream_options.foo"),
    ("stream_options-no-stream", COMPLETIONS, _p(stream_options={"include_usage": True}),
     "only allowed when stream is true", "stream_options"),
    ("min_tokens", COMPLETIONS, _p(min_tokens=3), "min_tokens=3", "min_tokens"),
    ("guided_whitespace_pattern", CHAT, _c(guided_whitespace_pattern=" "),
     "guided_whitespace_pattern=' ' is not supported", "guided_whitespace_pattern"),
    ("beam", COMPLETIONS, _p(use_beam_search=True), "use_beam_search=True", "use_beam_search"),
    ("chat-echo", CHAT, _c(echo=True), "echo=True is not supported", "echo"),
    ("no-generation-prompt", CHAT, _c(add_generation_prompt=False), "add_generation_prompt",
     "add_generation_prompt"),
    ("skip_special_tokens", COMPLETIONS, _p(skip_special_tokens=False), "skip_special_tokens",
     "skip_special_tokens"),
    ("reasoning_effort", CHAT, _c(reasoning_effort="high"), "reasoning_effort='high'",
     "reasoning_effort"),
    ("functions", CHAT, _c(functions=[{"name": "f"}]), "functions=", "functions"),
    ("unknown", COMPLETIONS, _p(frobnicate=1), "unrecognized request argument supplied: frobnicate",
     "frobnicate"),
    ("logprobs-completion", COMPLETIONS, _p(logprobs=25), "logprobs must be an integer in "
     "[0, 20], got 25", "logprobs"),
    ("top_logprobs", CHAT, _c(top_logprobs=3), "top_logprobs needs logprobs: true",
     "top_logprobs"),
    ("frequency_penalty", CHAT, _c(frequency_penalty=2.5), "frequency_penalty must be in [-2, 2]",
     "frequency_penalty"),
    ("logit_bias", COMPLETIONS, _p(logit_bias={"x": 1.0}), "logit_bias keys must be token ids",
     "logit_bias"),
    ("suffix", COMPLETIONS, _p(suffix="return x"), "needs a model with FIM tokens", "suffix"),
    ("best_of", COMPLETIONS, _p(best_of=3), "best_of=3", "best_of"),
]
# fmt: on


def test_refusals_name_the_field(http: httpx.Client) -> None:
    failures: list[str] = []
    for name, path, body, fragment, param in REFUSED:
        raw = body if isinstance(body, str) else json.dumps(body)
        r = http.post(path, content=raw)
        try:
            error = r.json()["error"]
        except Exception:
            failures.append(f"{name}: {r.status_code} not an OpenAI error: {r.text[:200]}")
            continue
        problems = []
        if r.status_code != 400:
            problems.append(f"status {r.status_code}")
        if fragment not in error["message"]:
            problems.append(f"message {error['message']!r} lacks {fragment!r}")
        if error["param"] != param:
            problems.append(f"param {error['param']!r} != {param!r}")
        if problems:
            failures.append(f"{name}: " + "; ".join(problems))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (COMPLETIONS, _p(temperature=2, seed=2**64 - 1)),
        (COMPLETIONS, _p(temperature=0, repetition_penalty=1.0, min_p=0, min_tokens=0)),
        (COMPLETIONS, _p(user="me", metadata={"k": "v"}, store=False, add_special_tokens=True)),
        (CHAT, _c(continue_final_message=False, add_generation_prompt=True, echo=False)),
        (CHAT, _c(messages=[{"role": "developer", "content": "be brief"}, *USER])),
        (CHAT, _c(stream=True, stream_options={"continuous_usage_stats": False})),
        (CHAT, _c(max_tokens=2, temperature=1)),  # an integer is a valid number
    ],
)
def test_neutral_values_are_accepted(http: httpx.Client, path: str, body: Any) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text[:300]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, _c(model="m" * 5000)),
        (COMPLETIONS, _p(temperature="h" * 5000)),
        (COMPLETIONS, _p(echo="e" * 5000)),
        (CHAT, _c(messages=[{"role": "r" * 5000, "content": "hi"}])),
        (COMPLETIONS, _p(logit_bias={str(i): 1.0 for i in range(2000)})),
        (COMPLETIONS, _p(**{"f" * 5000: 1})),
    ],
)
def test_echoed_values_are_truncated(http: httpx.Client, path: str, body: Any) -> None:
    r = http.post(path, json=body)
    assert r.status_code in (400, 404), r.text[:300]
    message = r.json()["error"]["message"]
    # The fixed text of the message plus at most one truncated echo.
    assert len(message) < 2 * MAX_ECHO_CHARS + 120, message
    assert "..." in message


def test_bearer_scheme_is_case_insensitive(engine: Engine) -> None:
    from monokernel.serve.app import create_app
    from monokernel.serve.testing import live_server, wait_ready

    app = create_app(ServerSettings(MODEL_NAME, api_key="sekrit"), lambda: engine)
    with live_server(app) as url:
        wait_ready(url)
        body = _p()
        for header, status in [
            ("Bearer sekrit", 200),
            ("bearer sekrit", 200),
            ("BEARER  sekrit", 200),
            ("Bearer Sekrit", 401),  # the key itself is case-sensitive
            ("Basic sekrit", 401),
            ("sekrit", 401),
            ("Bearer", 401),
        ]:
            r = httpx.post(url + COMPLETIONS, json=body, headers={"Authorization": header})
            assert r.status_code == status, (header, r.text[:200])
