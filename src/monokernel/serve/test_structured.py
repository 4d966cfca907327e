"""Structured output through the server (serve/structured.py) on loopback, with the
reference engine on the tiny random-weight model: the grammar makes even random weights
write valid JSON and well-formed tool calls, so the checks are exact."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")

from monokernel.runtime.engine import Engine  # noqa: E402
from monokernel.serve.testing import refused_as  # noqa: E402
from monokernel.serve.testing_names import CHAT, COMPLETIONS, MODEL_NAME  # noqa: E402
from monokernel.serve.testing_structured import (  # noqa: E402
    SCHEMA,
    USER,
    as_speculative,
    matches_schema,
    structured_server,
)
from monokernel.serve.testing_tools import MISTRAL_V03_TEMPLATE  # noqa: E402
from monokernel.testing.tiny_models import make_tiny_model_dir  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": SCHEMA, "strict": True},
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[tuple[Engine, str]]:
    with structured_server(tiny_model_dir) as got:
        yield got


@pytest.fixture(scope="module")
def client(served: tuple[Engine, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="x", max_retries=0, timeout=60)


def _post(served: tuple[Engine, str], body: dict[str, Any], path: str = CHAT) -> httpx.Response:
    return httpx.post(served[1] + path, json={"model": MODEL_NAME} | body, timeout=60)


JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True},
}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema(client: openai.OpenAI, temperature: float, stream: bool) -> None:
    args: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": USER,
        "max_tokens": 80,
        "temperature": temperature,
        "seed": 1,
        "response_format": JSON_SCHEMA_FORMAT,
    }
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **args))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        r = client.chat.completions.create(**args)
        text, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
    assert finish == "stop"
    assert matches_schema(json.loads(text)), text


def test_json_object(client: openai.OpenAI) -> None:
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL_NAME,
            messages=USER,
            max_tokens=150,
            temperature=0.7,
            seed=seed,
            response_format={"type": "json_object"},
        )
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


@pytest.mark.parametrize(
    "extra",
    [
        {"guided_json": SCHEMA},
        {"guided_json": json.dumps(SCHEMA)},
        {"structured_outputs": {"json": SCHEMA}},
        {"response_format": JSON_SCHEMA_FORMAT},
    ],
    ids=["guided_json", "guided_json-str", "structured_outputs", "response_format"],
)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_vllm_fields_and_completions(
    served: tuple[Engine, str], extra: dict[str, Any], path: str
) -> None:
    prompt = {"messages": USER} if path == CHAT else {"prompt": "Weather?"}
    r = _post(served, prompt | {"max_tokens": 80, "temperature": 0} | extra, path)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if path == CHAT else choice["text"]
    assert matches_schema(json.loads(text)), text


def test_choice_and_regex(served: tuple[Engine, str]) -> None:
    r = _post(served, {"messages": USER, "structured_outputs": {"choice": ["yes", "no"]}})
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")
    r = _post(served, {"prompt": "id:", "guided_regex": "[A-Z]{2}[0-9]{3}"}, COMPLETIONS)
    text = r.json()["choices"][0]["text"]
    assert len(text) == 5 and text[:2].isupper() and text[2:].isdigit(), text


def _calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_call(client: openai.OpenAI, stream: bool, choice: str) -> None:
    tool_choice: Any = "required"
    if choice == "named":
        tool_choice = {"type": "function", "function": {"name": "get_time"}}
    args: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": USER,
        "max_tokens": 120,
        "temperature": 0,
        "tools": [WEATHER, CLOCK],
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
    }
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **args))
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        parts: dict[int, list[str]] = {}
        names: dict[int, str] = {}
        for c in chunks:
            for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                if d.function and d.function.name:
                    names[d.index] = d.function.name
                parts.setdefault(d.index, []).append((d.function and d.function.arguments) or "")
        calls = [(names[i], json.loads("".join(parts[i]))) for i in sorted(parts)]
    else:
        r = client.chat.completions.create(**args)
        finish, calls = r.choices[0].finish_reason, _calls(r.choices[0].message)
    assert finish == "tool_calls"
    assert len(calls) == 1
    name, arguments = calls[0]
    if choice == "named":
        assert name == "get_time" and arguments in ({"zone": "UTC"}, {"zone": "CET"})
    else:
        assert name in ("get_weather", "get_time")
        assert matches_schema(arguments) if name == "get_weather" else set(arguments) == {"zone"}


def test_required_with_parallel_calls_parses_every_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=150,
        temperature=0.8,
        seed=4,
        tools=[WEATHER],
        tool_choice="required",
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = _calls(choice.message)
    assert calls and all(n == "get_weather" and matches_schema(a) for n, a in calls)


# (id, body, message fragment, param)
REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "bad-format",
        {"response_format": {"type": "yaml"}},
        "response_format.type must be one of",
        "response_format.type",
    ),
    (
        "no-schema-name",
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        "name is required",
        "response_format.json_schema.name",
    ),
    (
        "unknown-format",
        {"guided_json": {"type": "string", "format": "bogus"}},
        "Unknown format: bogus",
        "guided_json",
    ),
    (
        "two-constraints",
        {"guided_json": SCHEMA, "response_format": {"type": "json_object"}},
        "one output constraint per request",
        "guided_json",
    ),
    (
        "format-and-forced-call",
        {"response_format": {"type": "json_object"}, "tools": [WEATHER], "tool_choice": "required"},
        "cannot be combined with tool_choice",
        "response_format",
    ),
    (
        "structured-two-keys",
        {"structured_outputs": {"json": SCHEMA, "regex": "a"}},
        "exactly one of",
        "structured_outputs",
    ),
    (
        "strict-auto",
        {"tools": [WEATHER]},
        "enforced only when the call is forced",
        "tools[0].function.strict",
    ),
]


def test_refusals_name_the_field(served: tuple[Engine, str]) -> None:
    failures = []
    for name, body, fragment, param in REFUSED:
        r = _post(served, {"messages": USER, "max_tokens": 8} | body)
        if not refused_as(r, param, fragment):
            failures.append(f"{name}: {r.status_code} {r.text}")
    assert not failures, "\n".join(failures)


def test_constrained_requests_under_speculation_decode_as_without(
    served: tuple[Engine, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server with --speculative runs constrained requests without drafts: the same reply
    as a server without it, nothing drafted."""
    bodies = (
        {"response_format": {"type": "json_object"}},
        {"guided_json": SCHEMA},
        {"tools": [CLOCK], "tool_choice": "required"},
    )
    base = {"messages": USER, "max_tokens": 8, "temperature": 0}
    plain = [_post(served, base | b) for b in bodies]
    as_speculative(monkeypatch, served[0])
    for body, want in zip(bodies, plain, strict=True):
        r = _post(served, base | body)
        assert r.status_code == want.status_code == 200, r.text
        assert r.json()["choices"] == want.json()["choices"]
        assert served[0].backend.speculation.drafted == 0


def test_missing_llguidance_is_a_clear_400(
    served: tuple[Engine, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "llguidance", None)
    r = _post(served, {"messages": USER, "response_format": {"type": "json_object"}})
    assert r.status_code == 400, r.text
    assert 'pip install "monokernel[structured]"' in r.json()["error"]["message"]


def test_mistral_forced_calls(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Mistral's [TOOL_CALLS] format under tool_choice required and named, from random
    weights: the grammar starts with the marker's own special token, and the reply parses
    back as calls."""
    model = make_tiny_model_dir(
        "llama3",
        tmp_path_factory.mktemp("mistral") / "m",
        sizes={"max_position_embeddings": 1024},  # the template writes the tools out
        extra_specials=("[TOOL_CALLS]",),
    )
    # One call a reply: random weights would go on adding calls to the array until the
    # budget ran out.
    base = {"messages": USER, "tools": [CLOCK], "max_tokens": 120, "parallel_tool_calls": False}
    named = {"type": "function", "function": {"name": "get_time"}}
    with structured_server(model, MISTRAL_V03_TEMPLATE) as served:
        for choice, temperature in (("required", 0.0), ("required", 0.9), (named, 0.0)):
            r = _post(served, base | {"tool_choice": choice, "temperature": temperature})
            assert r.status_code == 200, r.text
            (out,) = r.json()["choices"]
            assert out["finish_reason"] == "tool_calls", out
            calls = out["message"]["tool_calls"]
            (call,) = calls
            assert call["function"]["name"] == "get_time"
            assert json.loads(call["function"]["arguments"]) in ({"zone": "UTC"}, {"zone": "CET"})


def test_responses_api_forced_call(served: tuple[Engine, str]) -> None:
    tool = {"type": "function", "name": "get_time"} | {
        "parameters": CLOCK["function"]["parameters"]
    }
    body = {"input": "Time?", "max_output_tokens": 100, "temperature": 0, "tools": [tool]}
    r = _post(served, body | {"tool_choice": "required"}, "/v1/responses")
    assert r.status_code == 200, r.text
    (item,) = r.json()["output"]
    assert item["type"] == "function_call" and item["name"] == "get_time"
    assert json.loads(item["arguments"]) in ({"zone": "UTC"}, {"zone": "CET"})
