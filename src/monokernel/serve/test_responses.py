"""``POST /v1/responses`` (issue 37, item 5) with the ``openai`` client: text, streaming,
reasoning items, a function-call round trip through ``previous_response_id`` and through
explicit items, the bounded store, and refusals; on loopback servers whose backend
replays a scripted output."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from monokernel.serve.responses_protocol import ResponseStore
from monokernel.serve.testing import Served, refused_as
from monokernel.serve.testing_names import MODEL_NAME
from monokernel.serve.testing_tools import QWEN3_TEMPLATE, QWEN25_TEMPLATE

openai = pytest.importorskip("openai")

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": False,
}
W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CALL = f"Let me check.\n<tool_call>\n{W}\n</tool_call>"


@pytest.fixture(scope="module")
def qwen(served_factory: Callable[..., Served]) -> Served:
    return served_factory(QWEN25_TEMPLATE)


@pytest.fixture(scope="module")
def qwen3(served_factory: Callable[..., Served]) -> Served:
    return served_factory(QWEN3_TEMPLATE)


def _client(served: Served) -> Any:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=30)


def _prompt_n(served: Served, body: dict[str, Any]) -> int:
    r = served.post({"model": MODEL_NAME, "max_output_tokens": 50} | body, "/v1/responses")
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["input_tokens"])


def test_text(qwen: Served) -> None:
    qwen.say("Hello there.")
    client = _client(qwen)
    r = client.responses.create(model=MODEL_NAME, input="Hi", instructions="Be brief.")
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "completed" and r.output_text == "Hello there."
    [item] = r.output
    assert item.type == "message" and item.role == "assistant"
    assert item.content[0].type == "output_text" and item.content[0].annotations == []
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    # The instructions reached the template as a system message.
    qwen.say("x")
    long = "Answer briefly and politely, in plain words. " * 4
    assert _prompt_n(qwen, {"input": "Hi", "instructions": long}) > _prompt_n(qwen, {"input": "Hi"})


def test_incomplete(qwen: Served) -> None:
    qwen.say("one two three four five six seven")
    r = _client(qwen).responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2


def test_stream(qwen: Served) -> None:
    qwen.say(CALL)
    client = _client(qwen)
    events = list(client.responses.create(model=MODEL_NAME, input="Hi", tools=[TOOL], stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for kind in (
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
    ):
        assert kind in kinds, kind
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Let me check."
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    final = events[-1].response
    qwen.say(CALL)
    whole = client.responses.create(model=MODEL_NAME, input="Hi", tools=[TOOL])

    def shape(r: Any) -> list[Any]:
        return [i.model_dump(exclude={"id", "call_id"}) for i in r.output]

    assert shape(final) == shape(whole)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.model_dump() for i in done] == [i.model_dump() for i in final.output]


def test_function_call_round_trip(qwen: Served) -> None:
    client = _client(qwen)
    qwen.say(CALL)
    first = client.responses.create(model=MODEL_NAME, input="Weather in Paris?", tools=[TOOL])
    calls = [i for i in first.output if i.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    call = calls[0]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    # Through previous_response_id: the stored conversation continues.
    qwen.say("It is sunny.")
    second = client.responses.create(
        model=MODEL_NAME, previous_response_id=first.id, input=[output], tools=[TOOL]
    )
    assert second.output_text == "It is sunny." and second.previous_response_id == first.id
    # Through explicit items: the same prompt, so the same token count.
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        *[i.model_dump(exclude_none=True) for i in first.output],
        output,
    ]
    qwen.say("It is sunny.")
    third = client.responses.create(model=MODEL_NAME, input=items, tools=[TOOL], store=False)
    assert third.output_text == "It is sunny."
    assert third.usage.input_tokens == second.usage.input_tokens
    # store=False: not kept.
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL_NAME, previous_response_id=third.id, input="x")
    assert e.value.body["code"] == "previous_response_not_found"


def test_reasoning_items(qwen3: Served) -> None:
    client = _client(qwen3)
    qwen3.say("<think>\nPondering.\n</think>\n\nSunny.")
    r = client.responses.create(model=MODEL_NAME, input="Weather?")
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Pondering."
    assert r.output_text == "Sunny."
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    qwen3.say("<think>\nPondering.\n</think>\n\nSunny.")
    events = list(client.responses.create(model=MODEL_NAME, input="Weather?", stream=True))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == "Pondering."
    # The reasoning goes back with previous_response_id (Qwen3 keeps it after a tool call).
    qwen3.say("ok")
    nxt = client.responses.create(model=MODEL_NAME, previous_response_id=r.id, input="More?")
    assert nxt.usage.input_tokens > r.usage.input_tokens


def test_store_is_bounded() -> None:
    store = ResponseStore(responses=2, chars=1000)
    for rid in ("a", "b", "c"):
        store.put(rid, [{"role": "user", "content": rid}], set())
    store.get("b")
    store.put("d", [{"role": "user", "content": "d"}], set())
    with pytest.raises(Exception, match="not found"):
        store.get("a")
    with pytest.raises(Exception, match="not found"):
        store.get("c")  # b was used more recently
    store.put("e", [{"role": "user", "content": "x" * 600}], set())
    store.put("f", [{"role": "user", "content": "y" * 600}], set())
    with pytest.raises(Exception, match="not found"):
        store.get("e")  # over the character bound


def _m(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "input": "Hi"} | fields


# (id, body, param, message fragment)
# fmt: off
REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    ("unknown-field", _m(frobnicate=1), "frobnicate", "unrecognized request argument"),
    ("unknown-prev", _m(previous_response_id="resp_nope"), "previous_response_id", "not found"),
    ("strict-auto", _m(tools=[TOOL | {"strict": True}]), "tools[0].strict",
     "tools[0].strict=True is enforced only when the call is forced"),
    ("hosted-tool", _m(tools=[{"type": "web_search"}]), "tools[0].type", "only function tools"),
    ("image", _m(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "input[0].content[0].type", "text only"),
    ("role", _m(input=[{"role": "tool", "content": "x"}]), "input[0].role", "expected one of"),
    ("orphan-output", _m(input=[{"type": "function_call_output", "call_id": "c", "output": "x"}]),
     "input[0].call_id", "matches no function_call"),
    ("item-type", _m(input=[{"type": "item_reference", "id": "x"}]), "input[0].type",
     "only message"),
    ("bad-args", _m(input=[{"role": "user", "content": "x"},
                           {"type": "function_call", "call_id": "c", "name": "f",
                            "arguments": "[1]"}], tools=[TOOL]),
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
    ("format-type", _m(text={"format": {"type": "yaml"}}), "text.format.type", "must be one of"),
    ("format-key", _m(text={"format": {"type": "json_object", "schema": {}}}),
     "text.format.schema", "unrecognized request argument"),
    ("format-name", _m(text={"format": {"type": "json_schema", "schema": {}}}),
     "text.format.name", "text.format.name is required"),
    ("text-key", _m(text={"verbosity": "low"}), "text.verbosity", "unrecognized request argument"),
    ("reasoning", _m(reasoning={"effort": "high"}), "reasoning", "not supported"),
    ("truncation", _m(truncation="auto"), "truncation", "not supported"),
    ("max-output", _m(max_output_tokens=0), "max_output_tokens", "max_output_tokens must be"),
    ("temperature", _m(temperature=3), "temperature", "[0, 2]"),
    ("model", _m(model="nope"), "model", "does not exist"),
]
# fmt: on


def test_refusals(qwen: Served) -> None:
    failures = []
    for name, body, param, fragment in REFUSED:
        r = qwen.post(body, "/v1/responses")
        if not refused_as(r, param, fragment, statuses=(400, 404)):
            failures.append(f"{name}: {r.status_code} {r.text}")
    assert not failures, "\n".join(failures)
