"""Reasoning models (issue 37, item 3): ``<think>…</think>`` split into
``reasoning_content`` (chat) and thinking blocks (Messages), tool calls parsed only after
the reasoning, and ``chat_template_kwargs`` reaching the template; on loopback servers
whose backend replays a scripted output through a Qwen3-like template."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from monokernel.serve.reasoning import OPEN, ReasoningSplitter
from monokernel.serve.testing import Served, refused_as
from monokernel.serve.testing_names import CHAT, MODEL_NAME
from monokernel.serve.testing_tools import (
    QWEN3_TEMPLATE,
    QWEN3_THINKING_TEMPLATE,
    QWEN25_TEMPLATE,
    WEATHER_TOOL,
)

USER = [{"role": "user", "content": "Weather in Paris?"}]
W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
THOUGHT = "<think>\nThe user wants the weather.\nI should call a tool.\n</think>\n\n"


@pytest.fixture(scope="module")
def qwen3(served_factory: Callable[..., Served]) -> Served:
    return served_factory(QWEN3_TEMPLATE)


@pytest.fixture(scope="module")
def thinking(served_factory: Callable[..., Served]) -> Served:
    return served_factory(QWEN3_THINKING_TEMPLATE)


def _c(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": USER, "max_tokens": 300} | fields


def _ok(served: Served, body: dict[str, Any], path: str = CHAT) -> dict[str, Any]:
    r = served.post(body, path)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _stream(served: Served, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with served.http.stream("POST", CHAT, json=body | {"stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: ") :])
                assert "error" not in chunk, chunk
                chunks.append(chunk)
    return chunks


# ---- the splitter ------------------------------------------------------------------------


def _split(text: str, start: str, step: int) -> tuple[str, str]:
    s = ReasoningSplitter.opening(start)
    pieces = [p for i in range(0, len(text), step) for p in s.feed(text[i : i + step])]
    pieces += s.finish()
    reasoning = "".join(t for k, t in pieces if k == "reasoning")
    return reasoning, "".join(t for k, t in pieces if k == "content")


@pytest.mark.parametrize(
    ("text", "start", "reasoning", "content"),
    [
        ("<think>\nhmm\n</think>\n\nHi!", "maybe", "hmm", "Hi!"),
        ("  <think>a  b</think>Hi", "maybe", "a  b", "Hi"),
        ("hmm, no markers\n", "maybe", "", "hmm, no markers\n"),
        ("<thin", "maybe", "", "<thin"),  # a reply cut inside a would-be marker is text
        ("\nhmm\n</think>\n\nHi!", OPEN, "hmm", "Hi!"),  # the prompt opened the reasoning
        ("still thinking </thi", OPEN, "still thinking </thi", ""),  # cut by max_tokens
        ("a</think>b<think>c</think>", "maybe", "", "a</think>b<think>c</think>"),
        ("<think></think>\n\n", "maybe", "", ""),
    ],
)
def test_splitter(text: str, start: str, reasoning: str, content: str) -> None:
    # Fed whole and a character at a time, the pieces must add up to the same split:
    # a marker cut between two pieces is held back, never leaked.
    for step in (len(text) or 1, 1, 3):
        assert _split(text, start, step) == (reasoning, content), step


def test_partial_marker_is_held_back() -> None:
    s = ReasoningSplitter.opening("maybe")
    assert s.feed("<thi") == []
    assert s.feed("nk>ab</th") == [("reasoning", "ab")]
    assert s.feed("ink>\n") == []
    assert s.feed("ok") == [("content", "ok")]


# ---- chat completions --------------------------------------------------------------------


def test_chat_reasoning_content(qwen3: Served) -> None:
    qwen3.say(THOUGHT + "It is sunny.")
    body = _ok(qwen3, _c())
    message = body["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": "It is sunny.",
        "reasoning_content": "The user wants the weather.\nI should call a tool.",
    }
    assert body["choices"][0]["finish_reason"] == "stop"


def test_chat_reasoning_streamed(qwen3: Served) -> None:
    qwen3.say(THOUGHT + "It is sunny.")
    chunks = _stream(qwen3, _c())
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert reasoning == "The user wants the weather.\nI should call a tool."
    assert content == "It is sunny."
    assert sum("reasoning_content" in d for d in deltas) > 1  # streamed in pieces
    # No piece of a marker leaks into either field.
    assert all("<" not in d.get("reasoning_content", "") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_openai_client_reasoning(qwen3: Served) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=qwen3.url + "/v1", api_key="x", max_retries=0)
    qwen3.say(THOUGHT + "Sunny.")
    reply = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=300)
    msg = reply.choices[0].message
    assert msg.content == "Sunny."
    assert (msg.model_extra or {})["reasoning_content"].startswith("The user wants")


def test_reasoning_opened_by_the_prompt(thinking: Served) -> None:
    """The template wrote "<think>\\n": the reply holds only the end of the reasoning."""
    thinking.say("The user wants the weather.\n</think>\n\nSunny.")
    message = _ok(thinking, _c())["choices"][0]["message"]
    assert message["reasoning_content"] == "The user wants the weather."
    assert message["content"] == "Sunny."
    thinking.say("The user wants the weather.\n</think>\n\nSunny.")
    deltas = [c["choices"][0]["delta"] for c in _stream(thinking, _c()) if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (
        "The user wants the weather."
    )
    assert "".join(d.get("content") or "" for d in deltas) == "Sunny."


def test_reasoning_then_tool_call(qwen3: Served) -> None:
    # A call the model writes while thinking is not made; the one after the reasoning is.
    reply = (
        f"<think>\nMaybe <tool_call>{W}</tool_call>?\n</think>\n\n<tool_call>\n{W}\n</tool_call>"
    )
    qwen3.say(reply)
    body = _ok(qwen3, _c(tools=[WEATHER_TOOL]))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None
    assert message["reasoning_content"] == f"Maybe <tool_call>{W}</tool_call>?"
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    qwen3.say(reply)
    chunks = _stream(qwen3, _c(tools=[WEATHER_TOOL]))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [tc["function"].get("name") for tc in calls if "id" in tc] == ["get_weather"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_reasoning_back_in_history(qwen3: Served) -> None:
    """An assistant turn's reasoning_content reaches the template (Qwen3 writes it back for
    the turns after the last user message)."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather"}}
    call["function"]["arguments"] = '{"city": "Paris"}'
    turn: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
    result = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    counts = []
    for extra in ({}, {"reasoning_content": "I should call get_weather."}):
        qwen3.say("ok")
        body = _c(messages=[*USER, turn | extra, result], tools=[WEATHER_TOOL])
        counts.append(_ok(qwen3, body)["usage"]["prompt_tokens"])
    assert counts[1] > counts[0]
    bad = _c(messages=[*USER, {"role": "assistant", "content": "x", "reasoning_content": 1}])
    r = qwen3.post(bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].reasoning_content"


def test_enable_thinking_false_reaches_the_template(qwen3: Served) -> None:
    qwen3.say("<think>x</think>y")
    on = _ok(qwen3, _c())
    qwen3.say("<think>x</think>y")
    off = _ok(qwen3, _c(chat_template_kwargs={"enable_thinking": False}))
    # The template wrote an empty "<think>\n\n</think>\n\n" into the prompt.
    assert off["usage"]["prompt_tokens"] > on["usage"]["prompt_tokens"]
    assert on["choices"][0]["message"] == {
        "role": "assistant",
        "content": "y",
        "reasoning_content": "x",
    }
    # The prompt closed the reasoning, so the reply is all answer, read as the model wrote it.
    assert off["choices"][0]["message"] == {"role": "assistant", "content": "<think>x</think>y"}
    qwen3.say("hi")
    with_tools = _ok(qwen3, _c(tools=[WEATHER_TOOL], chat_template_kwargs={"enable_thinking": 0}))
    assert with_tools["choices"][0]["message"]["content"] == "hi"


def test_plain_template_is_not_split(served_factory: Callable[..., Served]) -> None:
    qwen25 = served_factory(QWEN25_TEMPLATE)
    qwen25.say("<think>x</think>y")
    message = _ok(qwen25, _c())["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "<think>x</think>y"}


# (id, path, body, param, message fragment)
# fmt: off
REFUSED: list[tuple[str, str, dict[str, Any], str, str]] = [
    ("not-object", CHAT, _c(chat_template_kwargs=["enable_thinking"]), "chat_template_kwargs",
     "must be an object"),
    ("nested", CHAT, _c(chat_template_kwargs={"enable_thinking": {"a": 1}}),
     "chat_template_kwargs.enable_thinking", "must be a string, number, boolean or null"),
    ("list", CHAT, _c(chat_template_kwargs={"x": [1]}), "chat_template_kwargs.x",
     "must be a string"),
    ("reserved", CHAT, _c(chat_template_kwargs={"tools": "x"}), "chat_template_kwargs.tools",
     "set by the server"),
    ("name", CHAT, _c(chat_template_kwargs={"a-b": 1}), "chat_template_kwargs.a-b",
     "identifiers"),
    ("completions", "/v1/completions",
     {"model": MODEL_NAME, "prompt": "x", "chat_template_kwargs": {"enable_thinking": False}},
     "chat_template_kwargs", "not supported"),
]
# fmt: on


def test_chat_template_kwargs_refusals(qwen3: Served) -> None:
    failures = []
    for name, path, body, param, fragment in REFUSED:
        r = qwen3.post(body, path)
        if not refused_as(r, param, fragment):
            failures.append(f"{name}: {r.status_code} {r.text}")
    assert not failures, "\n".join(failures)


# ---- the Anthropic Messages API ----------------------------------------------------------


def _anthropic(served: Served) -> Any:
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0, timeout=30)


TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": WEATHER_TOOL["function"]["parameters"],  # type: ignore[index]
}


def test_messages_thinking_blocks(qwen3: Served) -> None:
    client = _anthropic(qwen3)
    reply = f"{THOUGHT}Let me look.\n<tool_call>\n{W}\n</tool_call>"
    qwen3.say(reply)
    msg = client.messages.create(model=MODEL_NAME, max_tokens=300, messages=USER, tools=[TOOL])
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[0].thinking == "The user wants the weather.\nI should call a tool."
    assert msg.content[0].signature == ""
    assert msg.content[1].text == "Let me look."
    assert msg.stop_reason == "tool_use"
    qwen3.say(reply)
    with client.messages.stream(
        model=MODEL_NAME, max_tokens=300, messages=USER, tools=[TOOL]
    ) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert "thinking_delta" in kinds
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [
        b.model_dump(exclude={"id"}) for b in msg.content
    ]
    # The thinking block goes back with the reply, and reaches the template.
    history = [
        *USER,
        {"role": "assistant", "content": msg.content},  # as agents send a reply back
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": msg.content[2].id, "content": "ok"}],
        },
    ]
    without = [*history]
    without[1] = {"role": "assistant", "content": msg.content[1:]}
    n_with = client.messages.count_tokens(model=MODEL_NAME, messages=history, tools=[TOOL])
    n_without = client.messages.count_tokens(model=MODEL_NAME, messages=without, tools=[TOOL])
    assert n_with.input_tokens > n_without.input_tokens
    qwen3.say("Sunny.")
    final = client.messages.create(model=MODEL_NAME, max_tokens=300, messages=history, tools=[TOOL])
    assert [b.type for b in final.content] == ["text"] and final.stop_reason == "end_turn"


def test_messages_thinking_disabled(qwen3: Served) -> None:
    client = _anthropic(qwen3)
    counts = [
        client.messages.count_tokens(model=MODEL_NAME, messages=USER, **extra).input_tokens
        for extra in ({}, {"thinking": {"type": "disabled"}})
    ]
    assert counts[1] > counts[0]  # enable_thinking false: the empty reasoning block
