"""``n`` > 1 on both OpenAI endpoints (reference engine, tiny model): n choices, each with
its index and a seed of its own, streamed (choice after choice) and not, with usage over
all of them; greedy choices are alike."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from monokernel.runtime.engine import Engine
from monokernel.serve.testing_names import CHAT, COMPLETIONS, MODEL_NAME

USER = [{"role": "user", "content": "hi"}]


def _body(path: str, extra: dict[str, Any]) -> dict[str, Any]:
    base = {"messages": USER} if path == CHAT else {"prompt": "x ="}
    return {"model": MODEL_NAME, "max_tokens": 6} | base | extra


def _texts(path: str, body: dict[str, Any]) -> list[str]:
    return [c["message"]["content"] if path == CHAT else c["text"] for c in body["choices"]]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_n_choices(served_reference: tuple[Engine, str], path: str) -> None:
    url = served_reference[1] + path
    r = httpx.post(url, json=_body(path, {"n": 3, "temperature": 1.0, "seed": 11}), timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    texts = _texts(path, body)
    assert len(set(texts)) > 1  # a seed of their own
    assert body["usage"]["completion_tokens"] == 18
    # Choice 0 is the request with n = 1 and the same seed; choice 1 the one with seed + 1.
    for i in (0, 1):
        one = httpx.post(url, json=_body(path, {"temperature": 1.0, "seed": 11 + i}), timeout=60)
        assert _texts(path, one.json()) == [texts[i]]
    # Streamed: the same texts, choice after choice, one usage at the end.
    parts: dict[int, str] = {0: "", 1: "", 2: ""}
    finishes, usage = {}, None
    stream = _body(path, {"n": 3, "temperature": 1.0, "seed": 11, "stream": True})
    stream["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", url, json=stream, timeout=60) as s:
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                piece = (c.get("delta") or {}).get("content") if path == CHAT else c["text"]
                parts[c["index"]] += piece or ""
                if c.get("finish_reason"):
                    finishes[c["index"]] = c["finish_reason"]
    assert [parts[i] for i in range(3)] == texts
    assert set(finishes) == {0, 1, 2} and usage["completion_tokens"] == 18


def test_greedy_choices_are_alike(served_reference: tuple[Engine, str]) -> None:
    r = httpx.post(
        served_reference[1] + CHAT, json=_body(CHAT, {"n": 2, "temperature": 0}), timeout=60
    )
    a, b = _texts(CHAT, r.json())
    assert a == b
