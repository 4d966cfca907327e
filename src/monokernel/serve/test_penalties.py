"""Penalties, min_p and logit_bias on the server: accepted on both OpenAI endpoints, each
bad value and each engine that cannot apply them refused with a 400 naming the field."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from monokernel.runtime.engine import Engine
from monokernel.serve.testing_names import CHAT, COMPLETIONS, MODEL_NAME
from monokernel.serve.testing_structured import as_speculative

USER = [{"role": "user", "content": "hi"}]
ALL = {
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.3,
    "min_p": 0.05,
    "logit_bias": {"5": -100, "7": 2.5},
}


def _post(served_reference: tuple[Engine, str], path: str, body: dict[str, Any]) -> httpx.Response:
    body = ({"messages": USER} if path == CHAT else {"prompt": "x ="}) | body
    return httpx.post(
        served_reference[1] + path, json={"model": MODEL_NAME, "max_tokens": 4} | body, timeout=60
    )


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("temperature", [0, 0.8])
def test_fields_are_accepted(
    served_reference: tuple[Engine, str], path: str, temperature: float
) -> None:
    r = _post(served_reference, path, ALL | {"temperature": temperature, "seed": 1})
    assert r.status_code == 200, r.text


def test_logit_bias_forces_a_token(served_reference: tuple[Engine, str]) -> None:
    eng = served_reference[0]
    token = 40
    r = _post(
        served_reference,
        COMPLETIONS,
        {
            "prompt": [3, 1, 4],
            "temperature": 0,
            "logit_bias": {str(token): 100},
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == eng.tokenizer.hf.decode([token] * 4)


def test_same_tokens_as_the_engine(served_reference: tuple[Engine, str]) -> None:
    """The server maps the fields onto SamplingParams as a direct engine call would."""
    from monokernel.runtime.sampling import SamplingParams

    eng = served_reference[0]
    fields = {"frequency_penalty": 1.5, "repetition_penalty": 1.2, "min_p": 0.1}
    r = _post(
        served_reference,
        COMPLETIONS,
        {"prompt": [3, 1, 4], "temperature": 0.9, "seed": 4, "ignore_eos": True, "max_tokens": 8}
        | fields
        | {"logit_bias": {"9": 3}},
    )
    assert r.status_code == 200, r.text
    params = SamplingParams(
        max_tokens=8, temperature=0.9, seed=4, ignore_eos=True, logit_bias={9: 3.0}, **fields
    )
    want = "".join(e.text for e in eng.generate("", params, prompt_ids=[3, 1, 4]))
    assert r.json()["choices"][0]["text"] == want


# (field, value, message fragment)
REFUSED = [
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2], got 2.5"),
    ("frequency_penalty", -2.01, "frequency_penalty must be in [-2, 2]"),
    ("frequency_penalty", "1", "valid number"),
    ("repetition_penalty", 0, "repetition_penalty must be > 0"),
    ("repetition_penalty", -1.0, "repetition_penalty must be > 0"),
    ("min_p", 1.5, "min_p must be in [0, 1]"),
    ("min_p", True, "valid number"),
    ("logit_bias", {"5": 101}, "logit_bias values must be in [-100, 100]"),
    ("logit_bias", {"-1": 1}, "logit_bias keys must be token ids"),
    ("logit_bias", {"abc": 1}, "logit_bias keys must be token ids"),
    ("logit_bias", {"99999999": 1}, "token ids must be in [0, "),
    ("logit_bias", {"5": "1"}, "valid number"),
    ("logit_bias", [5], "valid dictionary"),
]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_bad_values_are_refused(served_reference: tuple[Engine, str], path: str) -> None:
    failures = []
    for field, value, fragment in REFUSED:
        r = _post(served_reference, path, {field: value})
        error = r.json().get("error", {})
        if r.status_code != 400 or fragment not in error.get("message", ""):
            failures.append(f"{field}={value!r}: {r.status_code} {r.text}")
        elif not str(error.get("param")).startswith(field):
            failures.append(f"{field}={value!r}: param {error.get('param')!r}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_neutral_values_are_accepted(served_reference: tuple[Engine, str], path: str) -> None:
    body = {
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1,
        "min_p": 0,
        "logit_bias": {},
    }
    assert _post(served_reference, path, body).status_code == 200


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_every_engine_takes_them(
    served_reference: tuple[Engine, str], path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The monokernel applies them in its loop, under --tp too: the server's check passes
    them through (this server runs the reference engine under the monokernel's name)."""
    engine = served_reference[0]
    monkeypatch.setattr(engine, "engine_name", "monokernel")
    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, tp=2))
    for field, value in ALL.items():
        r = _post(served_reference, path, {field: value})
        assert r.status_code == 200, (field, r.text)


def test_under_speculation_penalties_decode_as_without(
    served_reference: tuple[Engine, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server with --speculative decodes a request with logit processing without
    drafts: the same reply as without it."""
    bodies = [{field: value, "temperature": 0} for field, value in ALL.items()]
    want = [_post(served_reference, CHAT, b) for b in bodies]
    as_speculative(monkeypatch, served_reference[0])
    for body, w in zip(bodies, want, strict=True):
        r = _post(served_reference, CHAT, body)
        assert r.status_code == w.status_code == 200, (body, r.text)
        assert r.json()["choices"] == w.json()["choices"]
