"""``logprobs`` on both OpenAI endpoints (reference engine, tiny model): chat's content
entries and completions' four lists, streamed and not, agreeing with each other and with
the text; each bad value, each combination that cannot be honoured and each engine that
cannot compute them refused with a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from monokernel.runtime.engine import Engine
from monokernel.serve.testing_names import CHAT, COMPLETIONS, MODEL_NAME
from monokernel.serve.testing_structured import as_speculative

USER = [{"role": "user", "content": "hi"}]


def _body(path: str, extra: dict[str, Any]) -> dict[str, Any]:
    base = {"messages": USER} if path == CHAT else {"prompt": "x ="}
    return {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0} | base | extra


def _post(served_reference: tuple[Engine, str], path: str, extra: dict[str, Any]) -> httpx.Response:
    return httpx.post(served_reference[1] + path, json=_body(path, extra), timeout=60)


def _stream(served_reference: tuple[Engine, str], path: str, extra: dict[str, Any]) -> list[dict]:
    body = _body(path, extra | {"stream": True})
    chunks = []
    with httpx.stream("POST", served_reference[1] + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_chat_logprobs(served_reference: tuple[Engine, str]) -> None:
    r = _post(served_reference, CHAT, {"logprobs": True, "top_logprobs": 3})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"] == 8
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    for e in content:
        assert e["logprob"] <= 0 and e["bytes"] == list(e["token"].encode())
        assert len(e["top_logprobs"]) == 3
        values = [t["logprob"] for t in e["top_logprobs"]]
        assert values == sorted(values, reverse=True)
        assert e["logprob"] == values[0]  # greedy: the chosen token is the likeliest
    # Streamed: one chunk a token, the same entries.
    streamed = [
        e
        for c in _stream(served_reference, CHAT, {"logprobs": True, "top_logprobs": 3})
        for ch in c["choices"]
        if ch.get("logprobs")
        for e in ch["logprobs"]["content"]
    ]
    assert streamed == content
    # logprobs without top_logprobs: the chosen token's alone.
    r = _post(served_reference, CHAT, {"logprobs": True})
    assert all(e["top_logprobs"] == [] for e in r.json()["choices"][0]["logprobs"]["content"])
    # Off by default.
    assert _post(served_reference, CHAT, {}).json()["choices"][0]["logprobs"] is None


def test_completion_logprobs(served_reference: tuple[Engine, str]) -> None:
    r = _post(served_reference, COMPLETIONS, {"logprobs": 2, "temperature": 0.7, "seed": 5})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    lp = choice["logprobs"]
    n = len(lp["tokens"])
    assert n == 8 and all(len(lp[k]) == n for k in ("token_logprobs", "top_logprobs"))
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    assert all(len(top) <= 2 and all(v <= 0 for v in top.values()) for top in lp["top_logprobs"])
    parts = [
        ch["logprobs"]
        for c in _stream(
            served_reference, COMPLETIONS, {"logprobs": 2, "temperature": 0.7, "seed": 5}
        )
        for ch in c["choices"]
        if ch.get("logprobs")
    ]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert [x for p in parts for x in p[key]] == lp[key], key


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        (CHAT, {"logprobs": "yes"}, "logprobs"),
        (CHAT, {"logprobs": 2}, "logprobs"),
        (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (CHAT, {"top_logprobs": 2}, "top_logprobs"),
        (COMPLETIONS, {"logprobs": 21}, "logprobs"),
        (COMPLETIONS, {"logprobs": True}, "logprobs"),
        (COMPLETIONS, {"logprobs": 1, "top_logprobs": 1}, "top_logprobs"),
        (COMPLETIONS, {"logprobs": 1, "echo": True}, "echo"),
    ],
)
def test_bad_values_are_refused(
    served_reference: tuple[Engine, str], path: str, extra: dict[str, Any], param: str
) -> None:
    r = _post(served_reference, path, extra)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_logprobs_under_speculation_are_those_without(
    served_reference: tuple[Engine, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server with --speculative decodes a request for logprobs without drafts: the same
    reply, logprobs included."""
    body = {"logprobs": True, "top_logprobs": 2, "temperature": 0}
    want = _post(served_reference, CHAT, body)
    as_speculative(monkeypatch, served_reference[0])
    r = _post(served_reference, CHAT, body)
    assert r.status_code == want.status_code == 200, r.text
    assert r.json()["choices"] == want.json()["choices"]
