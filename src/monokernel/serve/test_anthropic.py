"""The Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) on loopback
servers whose backend replays a scripted model output: raw HTTP for the wire format (the
event sequence, the error shape), and the official ``anthropic`` client as agents use it
(skipped where it is not installed)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from monokernel.serve.anthropic_protocol import (
    MessagesRequest,
    template_call_id,
    to_chat,
)
from monokernel.serve.testing import Served
from monokernel.serve.testing_names import MAX_BODY_BYTES, MODEL_NAME
from monokernel.serve.testing_tools import (
    MISTRAL_V03_TEMPLATE,
    QWEN25_TEMPLATE,
    TIME_TOOL,
    WEATHER_TOOL,
)

MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
USER = [{"role": "user", "content": "Weather in Paris?"}]


def _anthropic_tool(openai_tool: dict[str, Any]) -> dict[str, Any]:
    fn = openai_tool["function"]
    tool = {"name": fn["name"], "input_schema": fn["parameters"]}
    return tool | ({"description": fn["description"]} if "description" in fn else {})


TOOLS = [_anthropic_tool(WEATHER_TOOL), _anthropic_tool(TIME_TOOL)]
W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
T = '{"name": "get_time", "arguments": {}}'
ONE_CALL = f"<tool_call>\n{W}\n</tool_call>"
TWO_CALLS = f"Let me check.\n<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>"


def _m(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "max_tokens": 200, "messages": USER, "tools": TOOLS} | fields


@pytest.fixture(scope="module")
def qwen(served_factory: Callable[..., Served]) -> Served:
    return served_factory(QWEN25_TEMPLATE)


def _sdk() -> Any:
    return pytest.importorskip("anthropic")


def _client(url: str, api_key: str = "unused") -> Any:
    return _sdk().Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=30)


def _events(served: Served, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The SSE events of a streamed request, as (event name, data)."""
    events: list[tuple[str, dict[str, Any]]] = []
    with served.http.stream("POST", MESSAGES, json=body | {"stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert name == data["type"], (name, data)
                events.append((name, data))
    return events


def _assemble(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The message a client builds from the events, checking their order on the way:
    message_start, ping, then each block start, deltas, stop, then message_delta and
    message_stop."""
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"], names
    assert names[-2:] == ["message_delta", "message_stop"], names
    message = dict(events[0][1]["message"])
    assert message["content"] == [] and message["stop_reason"] is None
    content: list[dict[str, Any]] = []
    open_block: dict[str, Any] | None = None
    partial = ""
    for name, data in events[2:-2]:
        if name == "content_block_start":
            assert open_block is None and data["index"] == len(content)
            open_block = dict(data["content_block"])
            partial = ""
        elif name == "content_block_delta":
            assert open_block is not None and data["index"] == len(content)
            delta = data["delta"]
            if delta["type"] == "text_delta":
                assert open_block["type"] == "text"
                open_block["text"] += delta["text"]
            else:
                assert delta["type"] == "input_json_delta" and open_block["type"] == "tool_use"
                partial += delta["partial_json"]
        elif name == "content_block_stop":
            assert open_block is not None and data["index"] == len(content)
            if open_block["type"] == "tool_use":
                open_block["input"] = json.loads(partial)
            content.append(open_block)
            open_block = None
        else:
            assert name == "ping", name
    assert open_block is None
    final = events[-2][1]
    message |= final["delta"] | {"content": content, "usage": final["usage"]}
    return message


def _without_ids(message: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if k != "id"}
    out["content"] = [{k: v for k, v in b.items() if k != "id"} for b in message["content"]]
    return out


def _error(r: httpx.Response, status: int, kind: str) -> str:
    """Anthropic's error shape, exactly; returns the message."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    return str(body["error"]["message"])


# ---- replies -----------------------------------------------------------------------------


def test_text_reply(qwen: Served) -> None:
    qwen.say("Bonjour.")
    r = qwen.post(_m(tools=None, system="Be brief."), MESSAGES)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("msg_")
    assert {k: body[k] for k in ("type", "role", "model", "stop_reason", "stop_sequence")} == {
        "type": "message",
        "role": "assistant",
        "model": MODEL_NAME,
        "stop_reason": "end_turn",
        "stop_sequence": None,
    }
    assert body["content"] == [{"type": "text", "text": "Bonjour."}]
    usage = body["usage"]
    # The reference engine has no prefix cache: nothing is read from one.
    assert usage["cache_read_input_tokens"] == 0 and usage["cache_creation_input_tokens"] == 0
    assert usage["output_tokens"] > 0
    count = qwen.post(_m(tools=None, system="Be brief.", max_tokens=None), COUNT)
    # count_tokens takes no max_tokens: refused as any unknown field is
    assert "max_tokens" in _error(count, 400, "invalid_request_error")
    body = {"model": MODEL_NAME, "messages": USER, "system": "Be brief."}
    assert qwen.post(body, COUNT).json() == {"input_tokens": usage["input_tokens"]}


def test_tool_use_round_trip(qwen: Served) -> None:
    """tool_use, then the tool_result turn and the answer, with the official client."""
    client = _client(qwen.url)
    qwen.say(TWO_CALLS)
    r = client.messages.create(model=MODEL_NAME, max_tokens=200, messages=USER, tools=TOOLS)
    assert r.stop_reason == "tool_use"
    assert [b.type for b in r.content] == ["text", "tool_use", "tool_use"]
    assert r.content[0].text == "Let me check."
    weather, clock = r.content[1], r.content[2]
    assert weather.id.startswith("toolu_") and weather.id != clock.id
    assert (weather.name, weather.input) == ("get_weather", {"city": "Paris"})
    assert (clock.name, clock.input) == ("get_time", {})

    history = [
        *USER,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": weather.id, "content": "sunny, 21 C"},
                {
                    "type": "tool_result",
                    "tool_use_id": clock.id,
                    "content": [{"type": "text", "text": "12:00"}],
                },
            ],
        },
    ]
    qwen.say("It is sunny in Paris.")
    answer = client.messages.create(model=MODEL_NAME, max_tokens=200, messages=history, tools=TOOLS)
    assert answer.stop_reason == "end_turn"
    assert [(b.type, b.text) for b in answer.content] == [("text", "It is sunny in Paris.")]
    # The history took the chat route's path through the template: the same prompt as
    # the OpenAI history of the same turns (the Qwen template prints no call ids).
    openai_history = [
        *USER,
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": n, "arguments": a}}
                for n, a in (("get_weather", '{"city": "Paris"}'), ("get_time", "{}"))
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "sunny, 21 C"},
        {"role": "tool", "tool_call_id": "a", "content": "12:00"},
    ]
    qwen.say("x")
    chat = qwen.post(
        {"model": MODEL_NAME, "messages": openai_history, "tools": [WEATHER_TOOL, TIME_TOOL]}
    )
    assert answer.usage.input_tokens == chat.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "output",
    [
        "Paris is sunny, 21 \u00b0C.",
        TWO_CALLS,
        ONE_CALL,
        f"{ONE_CALL}\nand then some text",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call> sorry',
        "Paris is sunny. <tool_",
        "",
    ],
)
def test_stream_adds_up_to_the_whole_reply(qwen: Served, output: str) -> None:
    qwen.say(output)
    whole = qwen.post(_m(), MESSAGES).json()
    qwen.say(output)
    events = _events(qwen, _m())
    streamed = _assemble(events)
    assert _without_ids(streamed) == _without_ids(whole)
    start = events[0][1]["message"]
    assert start["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    for name, data in events:
        if name == "content_block_start" and data["content_block"]["type"] == "tool_use":
            assert data["content_block"]["id"].startswith("toolu_")
            assert data["content_block"]["input"] == {}


def test_sdk_stream(qwen: Served) -> None:
    client = _client(qwen.url)
    qwen.say(TWO_CALLS)
    whole = client.messages.create(model=MODEL_NAME, max_tokens=200, messages=USER, tools=TOOLS)
    qwen.say(TWO_CALLS)
    with client.messages.stream(
        model=MODEL_NAME, max_tokens=200, messages=USER, tools=TOOLS
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Let me check."
    assert _without_ids(final.model_dump()) == _without_ids(whole.model_dump())


def test_stop_sequences(qwen: Served) -> None:
    body = _m(tools=None, stop_sequences=["zzz", "Good"])
    qwen.say("Hello world. Goodbye.")
    r = qwen.post(body, MESSAGES).json()
    assert r["content"] == [{"type": "text", "text": "Hello world. "}]
    assert (r["stop_reason"], r["stop_sequence"]) == ("stop_sequence", "Good")
    qwen.say("Hello world. Goodbye.")
    streamed = _assemble(_events(qwen, body))
    assert _without_ids(streamed) == _without_ids(r)
    # A stop sequence that never comes: the model's own end.
    qwen.say("Hello.")
    r = qwen.post(body, MESSAGES).json()
    assert (r["stop_reason"], r["stop_sequence"]) == ("end_turn", None)
    with_sdk = _client(qwen.url)
    qwen.say("Hello world. Goodbye.")
    m = with_sdk.messages.create(
        model=MODEL_NAME, max_tokens=50, messages=USER, stop_sequences=["world"]
    )
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == (
        "stop_sequence",
        "world",
        "Hello ",
    )


def test_max_tokens(qwen: Served) -> None:
    qwen.say("A long answer that goes on and on.")
    r = qwen.post(_m(max_tokens=3), MESSAGES).json()
    assert r["stop_reason"] == "max_tokens" and r["stop_sequence"] is None
    assert r["usage"]["output_tokens"] == 3
    # A call cut by the limit is text, and the reason stays max_tokens.
    qwen.say(TWO_CALLS)
    r = qwen.post(_m(max_tokens=12), MESSAGES).json()
    assert r["stop_reason"] == "max_tokens"
    assert [b["type"] for b in r["content"]] == ["text"]


def test_tool_choice_none_and_no_parallel(qwen: Served) -> None:
    qwen.say(TWO_CALLS)
    r = qwen.post(_m(tool_choice={"type": "none"}), MESSAGES).json()
    assert r["content"] == [{"type": "text", "text": TWO_CALLS}]
    assert r["stop_reason"] == "end_turn"
    qwen.say(TWO_CALLS)
    choice = {"type": "auto", "disable_parallel_tool_use": True}
    r = qwen.post(_m(tool_choice=choice), MESSAGES).json()
    assert [b.get("name") for b in r["content"]] == [None, "get_weather"]


def test_count_tokens(qwen: Served) -> None:
    body = {"model": MODEL_NAME, "messages": USER, "tools": TOOLS, "system": "Be brief."}
    r = qwen.post(body, COUNT)
    assert r.status_code == 200, r.text
    count = r.json()["input_tokens"]
    qwen.say("ok")
    reply = qwen.post(_m(system="Be brief."), MESSAGES).json()
    assert count == reply["usage"]["input_tokens"] > 0
    without_tools = qwen.post(body | {"tools": None}, COUNT).json()["input_tokens"]
    assert without_tools < count  # the schemas are in the prompt
    sdk = _client(qwen.url)
    counted = sdk.messages.count_tokens(
        model=MODEL_NAME, messages=USER, tools=TOOLS, system="Be brief."
    )
    assert counted.input_tokens == count


def test_mistral_history_gets_ids_its_template_takes(
    served_factory: Callable[..., Served],
) -> None:
    """Mistral's template refuses call ids that are not 9 letters or digits; the client's
    toolu_ ids reach it as such ids, the same for the call and its result."""
    mistral = served_factory(MISTRAL_V03_TEMPLATE, special="[TOOL_CALLS]")
    mistral.say(f" [{W}]", special="[TOOL_CALLS]")
    r = mistral.post(_m(), MESSAGES).json()
    assert r["stop_reason"] == "tool_use"
    (call,) = r["content"]
    history = [
        *USER,
        {"role": "assistant", "content": r["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"]}]},
    ]
    mistral.say("Sunny.")
    answer = mistral.post(_m(messages=history), MESSAGES)
    assert answer.status_code == 200, answer.text
    assert answer.json()["content"] == [{"type": "text", "text": "Sunny."}]


# ---- conversion --------------------------------------------------------------------------


def test_conversion_to_chat_messages() -> None:
    body = MessagesRequest.model_validate(
        _m(
            system=[{"type": "text", "text": "A."}, {"type": "text", "text": "B."}],
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "is_error": True,
                            "content": "clock broken",
                        },
                        {
                            "type": "text",
                            "text": "Try again?",
                            "cache_control": {"type": "ephemeral"},
                        },
                    ],
                },
            ],
            tool_choice={"type": "auto", "disable_parallel_tool_use": True},
            stop_sequences=["END"],
            temperature=0.5,
            top_k=4,
            metadata={"user_id": "u1"},
        )
    )
    chat = to_chat(body)
    short = template_call_id("toolu_1")
    assert len(short) == 9 and short.isalnum() and short == template_call_id("toolu_1")
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "A.\nB."},
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": short,
                    "type": "function",
                    "function": {"name": "get_time", "arguments": "{}"},
                }
            ],
        },
        {
            "role": "tool",
            "content": "Error: clock broken",
            "tool_call_id": short,
            "name": "get_time",
        },
        {"role": "user", "content": "Try again?"},
    ]
    assert chat.tools == [WEATHER_TOOL, TIME_TOOL]
    assert (chat.tool_choice, chat.parallel_tool_calls) == ("auto", False)
    assert (chat.stop, chat.temperature, chat.top_k, chat.max_tokens) == (["END"], 0.5, 4, 200)


# ---- refusals, in Anthropic's error shape ------------------------------------------------

IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {}}
# (id, body, message fragment)
# fmt: off
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("image", _m(messages=[{"role": "user", "content": [IMAGE]}]), "images are not supported"),
    ("document", _m(messages=[{"role": "user", "content": [{"type": "document"}]}]),
     "documents are not supported"),
    ("image-in-result", _m(messages=[
        {"role": "user", "content": "x"}, {"role": "assistant", "content": [CALL]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [IMAGE]}]}]),
     "messages[2].content[0].content[0] has type 'image'"),
    ("thinking", _m(thinking={"type": "enabled", "budget_tokens": 1024}),
     "thinking {'type': 'enabled'} (extended thinking with a token budget) is not supported"),
    ("redacted-thinking", _m(messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
        {"role": "user", "content": "y"}]), "redacted_thinking blocks are not supported"),
    ("thinking-in-user", _m(messages=[
        {"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": ""}]}]),
     "thinking blocks are only taken in assistant messages"),
    ("tool-unknown", _m(tool_choice={"type": "tool", "name": "nope"}), "not in tools"),
    ("any-without-tools", _m(tools=None, tool_choice={"type": "any"}), "needs tools"),
    ("tool-without-name", _m(tool_choice={"type": "tool"}), "not in tools"),
    ("disable-parallel", _m(tool_choice={"type": "any", "disable_parallel_tool_use": 1}),
     "disable_parallel_tool_use must be a boolean"),
    ("choice-garbage", _m(tool_choice="auto"), "tool_choice must be"),
    ("server-tool", _m(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
     "server tools"),
    ("no-schema", _m(tools=[{"name": "f"}]), "tools[0].input_schema is required"),
    ("tool-name", _m(tools=[{"name": "a b", "input_schema": {"type": "object"}}]),
     "tools[0].name must be"),
    ("tool-twice", _m(tools=[TOOLS[0], TOOLS[0]]), "given twice"),
    ("tool-extra", _m(tools=[TOOLS[0] | {"strict": True}]), "tools[0].strict"),
    ("temperature", _m(temperature=1.5), "temperature must be in [0, 1]"),
    ("top_k", _m(top_k=-1), "top_k must be"),
    ("top_p", _m(top_p=0), "top_p must be"),
    ("max_tokens-missing", {"model": MODEL_NAME, "messages": USER}, "max_tokens is required"),
    ("max_tokens-zero", _m(max_tokens=0), "max_tokens must be"),
    ("unknown-field", _m(container="c"), "unrecognized request argument supplied: container"),
    ("unknown-block-key", _m(messages=[{"role": "user", "content": [
        {"type": "text", "text": "x", "foo": 1}]}]), "messages[0].content[0].foo"),
    ("unknown-result-id", _m(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x"}]}]), "matches no tool_use"),
    ("use-in-user", _m(messages=[{"role": "user", "content": [CALL]}]),
     "only assistant messages"),
    ("input-not-object", _m(messages=[{"role": "user", "content": "x"}, {"role": "assistant",
        "content": [CALL | {"input": "{}"}]}, {"role": "user", "content": "y"}]),
     "messages[1].content[0].input must be an object"),
    ("prefill", _m(messages=[*USER, {"role": "assistant", "content": "{"}]),
     "prefilling the reply is not supported"),
    ("system-role", _m(messages=[{"role": "system", "content": "x"}, *USER]),
     "top-level system field"),
    ("empty-stop", _m(stop_sequences=["a", ""]), "stop_sequences[1] is empty"),
    ("metadata", _m(metadata={"user_id": "u", "x": 1}), "metadata may only hold user_id"),
    ("cache-control", _m(system=[{"type": "text", "text": "x", "cache_control": {"t": 1}}]),
     "system[0].cache_control"),
    ("no-messages", _m(messages=[]), "at least one message"),
    ("stream-str", _m(stream="yes"), "stream"),
]
# fmt: on


def test_refusals_are_anthropic_errors(qwen: Served) -> None:
    failures = []
    for name, body, fragment in REFUSED:
        r = qwen.post(body, MESSAGES)
        try:
            message = _error(r, 400, "invalid_request_error")
        except AssertionError as e:
            failures.append(f"{name}: {e}")
            continue
        if fragment not in message:
            failures.append(f"{name}: {message!r}")
    assert not failures, "\n".join(failures)


def test_other_refusals(qwen: Served, base_url: str) -> None:
    message = _error(qwen.post(_m(model="claude-sonnet-4-5"), MESSAGES), 404, "not_found_error")
    assert MODEL_NAME in message
    r = qwen.http.post(MESSAGES, json=_m(), headers={"anthropic-version": ""})
    assert "anthropic-version" in _error(r, 400, "invalid_request_error")
    r = qwen.http.post(MESSAGES, json=_m(), headers={"anthropic-version": "2099-01-01"})
    assert r.status_code == 200, r.text  # any version string is taken
    assert "Method Not Allowed" in _error(qwen.http.get(MESSAGES), 405, "invalid_request_error")
    # The shared server's template is plain ChatML: it never renders tools.
    r = httpx.post(base_url + MESSAGES, json=_m(), timeout=30)
    assert "does not support tools" in _error(r, 400, "invalid_request_error")
    big = _m(system="x" * MAX_BODY_BYTES)
    assert "over the limit" in _error(
        httpx.post(base_url + MESSAGES, json=big, timeout=30), 413, "request_too_large"
    )
    # The OpenAI routes keep OpenAI's shape.
    r = httpx.post(base_url + "/v1/chat/completions", json=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_sdk_raises_the_errors(qwen: Served) -> None:
    anthropic = _sdk()
    client = _client(qwen.url)
    with pytest.raises(anthropic.BadRequestError, match="images are not supported"):
        client.messages.create(
            model=MODEL_NAME, max_tokens=10, messages=[{"role": "user", "content": [IMAGE]}]
        )
    with pytest.raises(anthropic.BadRequestError, match="not in tools"):
        client.messages.create(
            model=MODEL_NAME,
            max_tokens=10,
            messages=USER,
            tools=TOOLS,
            tool_choice={"type": "tool", "name": "nope"},
        )
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-haiku-4-5", max_tokens=10, messages=USER)


def test_api_key(served_factory: Callable[..., Served]) -> None:
    served = served_factory(QWEN25_TEMPLATE, api_key="sekrit")
    http = served.http
    body = _m(tools=None, max_tokens=2)
    assert "missing API key" in _error(http.post(MESSAGES, json=body), 401, "authentication_error")
    r = http.post(MESSAGES, json=body, headers={"x-api-key": "guess"})
    assert "incorrect API key" in _error(r, 401, "authentication_error")
    for headers in ({"x-api-key": "sekrit"}, {"Authorization": "Bearer sekrit"}):
        served.say("ok")
        r = http.post(MESSAGES, json=body, headers=headers)
        assert r.status_code == 200, (headers, r.text)
    # Either header may carry it: Anthropic's client sends both when both are configured.
    served.say("ok")
    r = http.post(MESSAGES, json=body, headers={"x-api-key": "sekrit", "Authorization": "Bearer x"})
    assert r.status_code == 200, r.text
    r = http.post(COUNT, json={"model": MODEL_NAME, "messages": USER})
    _error(r, 401, "authentication_error")
    # x-api-key works on the OpenAI routes too; their errors keep OpenAI's shape.
    chat = {"model": MODEL_NAME, "messages": USER, "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=chat).json()["error"]["code"] == "invalid_api_key"
    served.say("ok")
    ok = http.post("/v1/chat/completions", json=chat, headers={"x-api-key": "sekrit"})
    assert ok.status_code == 200, ok.text
    anthropic = _sdk()
    with pytest.raises(anthropic.AuthenticationError):
        _client(served.url, "guess").messages.create(model=MODEL_NAME, max_tokens=2, messages=USER)
    served.say("ok")
    m = _client(served.url, "sekrit").messages.create(model=MODEL_NAME, max_tokens=5, messages=USER)
    assert m.content[0].text == "ok"


def test_matched_stop_replays_only_the_tail(qwen: Served) -> None:
    from monokernel.serve.routes_anthropic import matched_stop

    hf = qwen.engine.tokenizer.hf
    prompt = hf("Say something.", add_special_tokens=False)["input_ids"]
    long = "word " * 200 + "h\u00e9llo Goodbye"
    ids = hf(long, add_special_tokens=False)["input_ids"]
    assert len(ids) > 200
    assert matched_stop(qwen.engine, prompt, ids, ["zz", "Good", "llo Go"]) == "llo Go"
    assert matched_stop(qwen.engine, prompt, ids, ["bye"]) == "bye"
    assert matched_stop(qwen.engine, prompt, ids, ["zz"]) is None
