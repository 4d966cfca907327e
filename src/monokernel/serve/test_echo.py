"""A completion's ``echo``: the prompt written before the completion, whole or streamed
first; a token-id prompt decoded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from monokernel.runtime.engine import Engine
from monokernel.serve.app import create_app
from monokernel.serve.settings import ServerSettings
from monokernel.serve.testing import live_server, scripted_engine, wait_ready


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[tuple[Engine, httpx.Client]]:
    eng = scripted_engine(tiny_model_dir, "{{ messages[0]['content'] }}")
    with live_server(create_app(ServerSettings("tiny"), lambda: eng)) as url:
        wait_ready(url)
        yield eng, httpx.Client(base_url=url, timeout=30)


def _say(eng: Engine, text: str) -> None:
    ids = eng.tokenizer.hf(text, add_special_tokens=False)["input_ids"]
    eng.backend.script = [*ids, min(eng.eos_token_ids)]  # type: ignore[attr-defined]


def test_echo_writes_the_prompt_first(served: tuple[Engine, httpx.Client]) -> None:
    eng, http = served
    _say(eng, " world")
    body = {"model": "tiny", "prompt": "hello", "echo": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "hello world"
    r = http.post("/v1/completions", json=body | {"echo": False})
    assert r.json()["choices"][0]["text"] == " world"


def test_echo_streams_the_prompt_first(served: tuple[Engine, httpx.Client]) -> None:
    eng, http = served
    _say(eng, " world")
    body = {"model": "tiny", "prompt": "hello", "echo": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    texts = [json.loads(ln)["choices"][0]["text"] for ln in lines[:-1] if '"choices"' in ln]
    assert texts[0] == "hello" and "".join(texts) == "hello world"


def test_echo_of_token_ids_decodes_them(served: tuple[Engine, httpx.Client]) -> None:
    eng, http = served
    _say(eng, "!")
    ids = eng.tokenizer.encode("abc")
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": ids, "echo": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == eng.tokenizer.decode(ids) + "!"
