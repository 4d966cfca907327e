"""Bounded work before admission: malformed or nested bodies get a 400 in OpenAI's shape,
prompts that cannot fit are refused before they are tokenised, and refused bodies are
not kept."""

from __future__ import annotations

import gc
import json
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from monokernel.runtime.engine import Engine
from monokernel.serve.body import MAX_JSON_DEPTH
from monokernel.serve.params import longest_token_chars, prompt_char_limit
from monokernel.serve.settings import ServerSettings
from monokernel.serve.testing_names import CHAT, COMPLETIONS, MODEL_NAME

BIG_BODY_LIMIT = 16 * 1024 * 1024


@pytest.fixture(scope="module")
def big_url(engine: Engine) -> Iterator[str]:
    """A server with the default 16 MiB body limit, so huge bodies reach the routes."""
    from monokernel.serve.app import create_app
    from monokernel.serve.testing import live_server, wait_ready

    settings = ServerSettings(MODEL_NAME, max_body_bytes=BIG_BODY_LIMIT)
    with live_server(create_app(settings, lambda: engine)) as url:
        wait_ready(url)
        yield url


def _post(url: str, path: str, body: bytes | dict[str, Any]) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=raw, timeout=60)


def _openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert len(error["message"]) < 600, "an error must not echo the body"
    return dict(error)


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth - 1):
        value = [value]
    return value


def test_nested_json_is_a_400(big_url: str) -> None:
    deep = b'{"prompt": "hi", "max_tokens": 2, "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    cases: list[tuple[str, bytes | dict[str, Any]]] = [
        # Past Python's recursion limit: json itself gives up.
        (COMPLETIONS, deep),
        # Within it, but deep enough to hurt what walks the value later.
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "x": _nested(MAX_JSON_DEPTH + 5)}),
        (CHAT, {"messages": [{"role": "user", "content": "hi", "x": _nested(900)}]}),
    ]
    for path, body in cases:
        error = _openai_error(_post(big_url, path, body), 400)
        assert f"nests deeper than {MAX_JSON_DEPTH} levels" in error["message"]
    ok = {"prompt": "hi", "max_tokens": 2, "metadata": {"x": _nested(MAX_JSON_DEPTH - 3)}}
    assert _post(big_url, COMPLETIONS, ok).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "fragment", "param"),
    [
        (COMPLETIONS, b"\xff\xfe\x00", "not valid JSON", None),
        (COMPLETIONS, b"", "not valid JSON", None),
        (COMPLETIONS, b"null", "must be a JSON object", None),
        (COMPLETIONS, b'"a string"', "must be a JSON object", None),
        (
            COMPLETIONS,
            b'{"prompt": "a\\ud800b", "max_tokens": 2}',
            "could not be tokenised",
            "prompt",
        ),
        (
            CHAT,
            b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
            "refused these messages",
            "messages",
        ),
        (COMPLETIONS, {"prompt": {"a": 1}, "max_tokens": 2}, "prompt:", "prompt"),
        (CHAT, {"messages": [["user", "hi"]]}, "messages.0", "messages.0"),
    ],
)
def test_malformed_bodies_are_400(
    big_url: str, path: str, body: bytes | dict[str, Any], fragment: str, param: str | None
) -> None:
    error = _openai_error(_post(big_url, path, body), 400)
    assert fragment in error["message"]
    assert error["param"] == param


def test_prompt_that_cannot_fit_is_refused_before_tokenising(big_url: str) -> None:
    # Tokenising 15 MB with the tiny model's 320-token vocabulary takes tens of seconds;
    # the character bound answers in the time it takes to parse the JSON.
    limit = httpx.get(big_url + "/v1/models").json()["data"][0]["max_model_len"]
    huge = "def f(x): return x " * 780_000  # ~15 MB
    for path, body, param in [
        (COMPLETIONS, {"prompt": huge, "max_tokens": 2}, "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": huge}]}, "messages"),
    ]:
        start = time.perf_counter()
        error = _openai_error(_post(big_url, path, body), 400)
        elapsed = time.perf_counter() - start
        assert "refused before tokenising" in error["message"]
        assert f"the context of {limit} tokens" in error["message"]
        assert (error["param"], error["code"]) == (param, "context_length_exceeded")
        assert elapsed < 8.0, f"refusing took {elapsed:.1f} s"
    # Token ids too: more than the context is refused without checking each id.
    error = _openai_error(_post(big_url, COMPLETIONS, {"prompt": [1] * 100_000}), 400)
    assert "leaves no room to generate" in error["message"]


def test_char_bound_never_refuses_a_prompt_that_fits(engine: Engine, big_url: str) -> None:
    longest = longest_token_chars(engine)
    assert prompt_char_limit(engine) >= engine.max_model_len * longest
    # The longest piece of this vocabulary, repeated up to the context: many characters
    # per token, and it still fits.
    vocab = engine.tokenizer.hf.get_vocab()
    piece = max(vocab, key=len)
    assert len(piece) == longest
    prompt = piece * (engine.max_model_len - 8)
    r = _post(big_url, COMPLETIONS, {"prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text[:300]


def test_refused_bodies_are_not_kept(big_url: str) -> None:
    """With the cyclic GC off, whatever a refusal leaves in a reference cycle stays; none
    of the ~4 MB bodies may."""
    prompt = "x" * 4_000_000
    bodies = [
        (COMPLETIONS, json.dumps({"prompt": prompt, "max_tokens": 2}).encode()),
        (COMPLETIONS, json.dumps({"prompt": "hi", "temperature": prompt}).encode()),
        (
            COMPLETIONS,
            json.dumps({"prompt": "hi", "max_tokens": 2, "seed": -1, "x": prompt}).encode(),
        ),
        (CHAT, json.dumps({"messages": [{"role": "user", "content": prompt}]}).encode()),
        (COMPLETIONS, json.dumps({"prompt": "a\ud800" + prompt[:3000]}).encode()),
    ]
    with httpx.Client(base_url=big_url, timeout=60) as client:
        client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 1})  # warm the paths
        gc.collect()
        gc.disable()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(3):
                for path, raw in bodies:
                    r = client.post(path, content=raw)
                    assert r.status_code == 400, r.text[:200]
                    del r
            kept = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
            gc.enable()
    # 15 refusals of ~4 MB each: a leak of even one body shows.
    assert kept < 3_000_000, f"{kept / 1e6:.1f} MB still held after the refusals"
