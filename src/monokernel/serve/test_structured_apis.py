"""Structured output through the Anthropic Messages and OpenAI Responses APIs on loopback,
with the reference engine on the tiny random-weight model (as test_structured.py does for
chat): Anthropic's ``tool_choice`` ``any``/``tool`` and the Responses API's ``text.format``
and ``strict`` tools take the chat route's constrained decoding, so even random weights
write a valid call or valid JSON and the checks are exact; what still cannot run is
refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("llguidance")

from monokernel.runtime.engine import Engine
from monokernel.serve.anthropic_protocol import MessagesRequest, to_chat
from monokernel.serve.body import validate
from monokernel.serve.testing import refused_as
from monokernel.serve.testing_names import MODEL_NAME
from monokernel.serve.testing_structured import (
    SCHEMA,
    USER,
    ZONE,
    as_speculative,
    matches_schema,
    structured_server,
)

MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
A_TOOLS = [
    {"name": "get_weather", "input_schema": SCHEMA},
    {"name": "get_time", "description": "The time.", "input_schema": ZONE},
]
R_WEATHER = {"type": "function", "name": "get_weather", "parameters": SCHEMA, "strict": True}
R_CLOCK = {"type": "function", "name": "get_time", "parameters": ZONE, "strict": False}


def _valid(name: str, value: Any) -> bool:
    if name == "get_weather":
        return matches_schema(value)
    return name == "get_time" and value in ({"zone": "UTC"}, {"zone": "CET"})


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[tuple[Engine, str]]:
    with structured_server(tiny_model_dir) as got:
        yield got


def _post(served: tuple[Engine, str], path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(served[1] + path, json={"model": MODEL_NAME} | body, timeout=60)


def _sse(r: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    assert r.status_code == 200, r.text
    events = []
    for chunk in r.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


# ---- Anthropic Messages ------------------------------------------------------------------


def _streamed_message(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The message the events build (as the anthropic client accumulates it)."""
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == [
        "message_delta",
        "message_stop",
    ]
    message = events[0][1]["message"]
    partial: dict[int, list[str]] = {}
    for name, data in events:
        if name == "content_block_start":
            assert data["index"] == len(message["content"])
            message["content"].append(dict(data["content_block"]))
        elif name == "content_block_delta":
            block, delta = message["content"][data["index"]], data["delta"]
            if delta["type"] == "input_json_delta":
                partial.setdefault(data["index"], []).append(delta["partial_json"])
            else:
                block["text"] += delta["text"]
        elif name == "content_block_stop" and data["index"] in partial:
            message["content"][data["index"]]["input"] = json.loads("".join(partial[data["index"]]))
        elif name == "message_delta":
            message |= data["delta"]
    return message


def _m(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "max_tokens": 120, "messages": USER, "tools": A_TOOLS} | fields


def _anthropic(served: tuple[Engine, str], stream: bool, **fields: Any) -> dict[str, Any]:
    body = {"max_tokens": 120, "messages": USER, "tools": A_TOOLS, "stream": stream} | fields
    r = _post(served, MESSAGES, body)
    if stream:
        return _streamed_message(_sse(r))
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["any", "tool"])
def test_anthropic_forced_tool_use(served: tuple[Engine, str], stream: bool, kind: str) -> None:
    choice: dict[str, Any] = {"type": "any", "disable_parallel_tool_use": True}
    if kind == "tool":
        choice = {"type": "tool", "name": "get_time"}
    m = _anthropic(served, stream, temperature=0, tool_choice=choice)
    assert m["stop_reason"] == "tool_use", m
    (block,) = m["content"]
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_"), m
    assert _valid(block["name"], block["input"]), block
    if kind == "tool":
        assert block["name"] == "get_time"


def test_anthropic_any_with_parallel_calls(served: tuple[Engine, str]) -> None:
    """Without disable_parallel_tool_use, one or more calls, each valid: the random model
    may go on calling until max_tokens cuts the last call (which stays text)."""
    chat = to_chat(validate(_m(tool_choice={"type": "any"}), MessagesRequest))
    assert (chat.tool_choice, chat.parallel_tool_calls) == ("required", True)
    one = {"type": "any", "disable_parallel_tool_use": True}
    chat = to_chat(validate(_m(tool_choice=one), MessagesRequest))
    assert (chat.tool_choice, chat.parallel_tool_calls) == ("required", False)
    for temperature in (0.0, 1.0):
        m = _anthropic(served, False, temperature=temperature, tool_choice={"type": "any"})
        calls = [b for b in m["content"] if b["type"] == "tool_use"]
        assert calls and all(_valid(b["name"], b["input"]) for b in calls), m
        if m["stop_reason"] == "tool_use":
            assert len(calls) == len(m["content"]), m
        else:
            assert m["stop_reason"] == "max_tokens", m
            assert m["content"][-1]["text"].startswith("<tool_call>"), m


def test_anthropic_auto_and_none_still_run(served: tuple[Engine, str]) -> None:
    for choice in (
        {"type": "auto"},
        {"type": "none"},
        {"type": "auto", "disable_parallel_tool_use": True},
    ):
        m = _anthropic(served, False, max_tokens=8, temperature=0, tool_choice=choice)
        assert m["stop_reason"] in ("end_turn", "max_tokens", "tool_use"), m
        if choice["type"] == "none":
            assert all(b["type"] == "text" for b in m["content"]), m


def test_anthropic_sdk_forced_tool_use(served: tuple[Engine, str]) -> None:
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=served[1], api_key="x", max_retries=0, timeout=60)
    args: dict[str, Any] = {
        "model": MODEL_NAME,
        "max_tokens": 120,
        "messages": USER,
        "tools": A_TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "extra_body": {"temperature": 0},  # not every client version takes it by name
    }
    m = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        streamed = stream.get_final_message()
    for message in (m, streamed):
        assert message.stop_reason == "tool_use"
        (block,) = message.content
        assert block.type == "tool_use" and block.name == "get_weather"
        assert matches_schema(block.input), block.input
    # count_tokens renders a forced choice exactly as /v1/messages does.
    r = _post(served, MESSAGES + "/count_tokens", {k: args[k] for k in ("messages", "tools")})
    forced = _post(
        served,
        MESSAGES + "/count_tokens",
        {k: args[k] for k in ("messages", "tools", "tool_choice")},
    )
    assert r.status_code == forced.status_code == 200, forced.text
    assert r.json() == forced.json()


def test_anthropic_forced_calls_under_speculation_decode_as_without(
    served: tuple[Engine, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bodies = [
        {"max_tokens": 8, "temperature": 0, "messages": USER, "tools": A_TOOLS}
        | {"tool_choice": choice}
        for choice in ({"type": "any"}, {"type": "tool", "name": "get_time"})
    ]
    plain = [_post(served, MESSAGES, b) for b in bodies]
    as_speculative(monkeypatch, served[0])
    for body, want in zip(bodies, plain, strict=True):
        r = _post(served, MESSAGES, body)
        assert r.status_code == want.status_code == 200, r.text
        assert r.json()["content"] == want.json()["content"]


# ---- OpenAI Responses --------------------------------------------------------------------

JSON_SCHEMA_FORMAT = {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}


def _response(served: tuple[Engine, str], stream: bool, **fields: Any) -> dict[str, Any]:
    body = {"input": "Weather?", "max_output_tokens": 80, "stream": stream} | fields
    r = _post(served, RESPONSES, body)
    if not stream:
        assert r.status_code == 200, r.text
        return dict(r.json())
    events = _sse(r)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert events[-1][0] == "response.completed", events[-1]
    final = dict(events[-1][1]["response"])
    # The deltas add up to the final output.
    text = "".join(d["delta"] for name, d in events if name == "response.output_text.delta")
    assert text == "".join(
        p["text"] for i in final["output"] if i["type"] == "message" for p in i["content"]
    )
    return final


def _output_text(response: dict[str, Any]) -> str:
    (item,) = response["output"]
    assert item["type"] == "message", item
    return str(item["content"][0]["text"])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("stream", [False, True])
def test_responses_json_schema(
    served: tuple[Engine, str], stream: bool, temperature: float
) -> None:
    r = _response(served, stream, temperature=temperature, text={"format": JSON_SCHEMA_FORMAT})
    assert r["status"] == "completed", r
    assert matches_schema(json.loads(_output_text(r))), r
    assert r["text"] == {"format": JSON_SCHEMA_FORMAT | {"description": None}}


def test_responses_json_object(served: tuple[Engine, str]) -> None:
    # Greedy: the Responses API takes no seed, and a sampled object on the tiny random model
    # sometimes outran 150 tokens (status "incomplete": 1 run in 3 of the serve suite).
    r = _response(
        served,
        False,
        max_output_tokens=150,
        temperature=0,
        text={"format": {"type": "json_object"}},
    )
    assert r["status"] == "completed", r
    assert isinstance(json.loads(_output_text(r)), dict)
    assert r["text"] == {"format": {"type": "json_object"}}
    # text.format text asks for nothing.
    plain = _response(served, False, max_output_tokens=4, text={"format": {"type": "text"}})
    assert plain["text"] == {"format": {"type": "text"}}


def test_responses_sdk_json_schema(served: tuple[Engine, str]) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served[1] + "/v1", api_key="x", max_retries=0, timeout=60)
    r = client.responses.create(
        model=MODEL_NAME,
        input="Weather?",
        max_output_tokens=80,
        temperature=0,
        text={"format": JSON_SCHEMA_FORMAT},  # type: ignore[typeddict-item]
    )
    assert matches_schema(json.loads(r.output_text)), r.output_text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_responses_strict_forced_call(
    served: tuple[Engine, str], stream: bool, choice: str
) -> None:
    tool_choice: Any = "required"
    if choice == "named":
        tool_choice = {"type": "function", "name": "get_weather"}
    r = _response(
        served,
        stream,
        max_output_tokens=120,
        temperature=0,
        tools=[R_WEATHER, R_CLOCK],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
    )
    (item,) = r["output"]
    assert item["type"] == "function_call", item
    assert _valid(item["name"], json.loads(item["arguments"])), item
    if choice == "named":
        assert item["name"] == "get_weather"
    assert [t["strict"] for t in r["tools"]] == [True, False]


# (id, body, param, message fragment)
# fmt: off
R_REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    ("strict-auto", {"tools": [R_WEATHER]}, "tools[0].strict",
     "tools[0].strict=True is enforced only when the call is forced"),
    ("strict-none", {"tools": [R_WEATHER], "tool_choice": "none"}, "tools[0].strict",
     "enforced only when the call is forced"),
    ("schema-keyword", {"text": {"format": JSON_SCHEMA_FORMAT | {
        "schema": {"type": "string", "format": "bogus"}}}}, "text.format",
     "Unknown format: bogus"),
    ("schema-not-object", {"text": {"format": JSON_SCHEMA_FORMAT | {"schema": [1]}}},
     "text.format.schema", "text.format.schema must be a JSON Schema object"),
    ("strict-not-bool", {"text": {"format": JSON_SCHEMA_FORMAT | {"strict": "yes"}}},
     "text.format.strict", "text.format.strict must be a boolean"),
    ("format-and-forced-call", {"text": {"format": {"type": "json_object"}}, "tools": [R_CLOCK],
     "tool_choice": "required"}, "text.format", "text.format cannot be combined with tool_choice"),
    ("format-not-object", {"text": {"format": "json_object"}}, "text.format.type",
     "must be one of"),
    ("tool-params", {"tools": [R_CLOCK | {"parameters": {"type": "array"}}]},
     "tools[0].parameters", "tools[0].parameters must be a JSON Schema object"),
]
# fmt: on


def test_responses_refusals_name_the_field(served: tuple[Engine, str]) -> None:
    failures = []
    for name, body, param, fragment in R_REFUSED:
        r = _post(served, RESPONSES, {"input": "Hi", "max_output_tokens": 8} | body)
        if not refused_as(r, param, fragment):
            failures.append(f"{name}: {r.status_code} {r.text}")
    assert not failures, "\n".join(failures)


def test_responses_constrained_requests_under_speculation_decode_as_without(
    served: tuple[Engine, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bodies = [
        {"input": "Hi", "max_output_tokens": 8, "temperature": 0} | body
        for body in (
            {"text": {"format": {"type": "json_object"}}},
            {"text": {"format": JSON_SCHEMA_FORMAT}},
            {"tools": [R_WEATHER], "tool_choice": "required"},
        )
    ]
    plain = [_post(served, RESPONSES, b) for b in bodies]
    as_speculative(monkeypatch, served[0])
    for body, want in zip(bodies, plain, strict=True):
        r = _post(served, RESPONSES, body)
        assert r.status_code == want.status_code == 200, r.text
        assert _items(r.json()["output"]) == _items(want.json()["output"])


def _items(output: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """A Responses output without its random ids."""
    return [(o["type"], o.get("content"), o.get("name"), o.get("arguments")) for o in output]
