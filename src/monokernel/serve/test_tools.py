"""Tool calling in /v1/chat/completions: request checks, tools and tool history through
the families' templates, and calls parsed back, streamed and not, on loopback servers
whose backend replays a scripted model output (random weights cannot be asked to call)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from monokernel.runtime.engine import Engine
from monokernel.serve import params as P
from monokernel.serve.errors import APIError
from monokernel.serve.protocol import ChatCompletionRequest
from monokernel.serve.testing import Served, refused_as
from monokernel.serve.testing_names import CHAT, MODEL_NAME
from monokernel.serve.testing_tools import (
    LLAMA31_TEMPLATE,
    MISTRAL_V03_TEMPLATE,
    QWEN25_TEMPLATE,
    TIME_TOOL,
    TOOLS_IGNORED_TEMPLATE,
    WEATHER_TOOL,
)
from monokernel.serve.tools import ToolParsing, marker_token_ids, render, tool_format
from monokernel.testing.tiny_models import CHATML_TEMPLATE

USER = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [WEATHER_TOOL, TIME_TOOL]
W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
T = '{"name": "get_time", "arguments": {}}'
TWO_CALLS = f"Let me check.\n<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>"
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def _c(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": USER, "tools": TOOLS, "max_tokens": 200} | fields


@pytest.fixture(scope="module")
def qwen(served_factory: Callable[..., Served]) -> Served:
    return served_factory(QWEN25_TEMPLATE)


def _stream(served: Served, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with served.http.stream("POST", CHAT, json=body | {"stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def _assemble(chunks: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """The message and finish_reason a client builds from the deltas."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in chunks:
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content.append(delta.get("content") or "")
            for tc in delta.get("tool_calls", []):
                call = calls.setdefault(tc["index"], {"function": {"arguments": ""}})
                if "id" in tc:
                    assert "id" not in call, "a call's id comes once, in its first delta"
                    call |= {"id": tc["id"], "type": tc["type"]}
                    call["function"]["name"] = tc["function"]["name"]
                call["function"]["arguments"] += tc["function"].get("arguments", "")
            finish = choice["finish_reason"] or finish
    text = "".join(content)
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    assert finish is not None
    return message, finish


def _without_ids(message: dict[str, Any]) -> dict[str, Any]:
    calls = [{k: v for k, v in c.items() if k != "id"} for c in message.get("tool_calls", [])]
    return {"role": message["role"], "content": message["content"], "tool_calls": calls}


# ---- request checks ----------------------------------------------------------------------

# (id, body, message fragment, param, code)
# fmt: off
REFUSED: list[tuple[str, dict[str, Any], str, str, str | None]] = [
    ("tools-not-list", _c(tools={"a": 1}), "valid list", "tools", "invalid_value"),
    ("tool-not-object", _c(tools=["get_weather"]), "must be an object", "tools[0]", None),
    ("tool-type", _c(tools=[{"type": "web_search"}]), "only 'function' tools",
     "tools[0].type", None),
    ("no-function", _c(tools=[{"type": "function"}]), "is required", "tools[0].function", None),
    ("tool-extra-key", _c(tools=[WEATHER_TOOL | {"cache_control": {}}]),
     "unrecognized request argument supplied: tools[0].cache_control", "tools[0].cache_control",
     "unknown_field"),
    ("function-extra-key", _c(tools=[{"type": "function", "function": {"name": "f", "x": 1}}]),
     "unrecognized", "tools[0].function.x", "unknown_field"),
    ("name-spaces", _c(tools=[{"type": "function", "function": {"name": "get weather"}}]),
     "1 to 64 letters", "tools[0].function.name", None),
    ("name-missing", _c(tools=[{"type": "function", "function": {}}]), "1 to 64 letters",
     "tools[0].function.name", None),
    ("parameters-array", _c(tools=[{"type": "function",
                                   "function": {"name": "f", "parameters": {"type": "array"}}}]),
     "JSON Schema object", "tools[0].function.parameters", None),
    ("strict", _c(tools=[{"type": "function", "function": {"name": "f", "strict": True}}]),
     "enforced only when the call is forced", "tools[0].function.strict", "unsupported"),
    ("duplicate", _c(tools=[WEATHER_TOOL, WEATHER_TOOL]), "given twice", "tools[1]", None),
    ("named-unknown", _c(tool_choice={"type": "function", "function": {"name": "nope"}}),
     "not in tools", "tool_choice", None),
    ("choice-garbage", _c(tool_choice="sometimes"), "must be 'none', 'auto'", "tool_choice",
     None),
    ("choice-without-tools", _c(tools=None, tool_choice="required"), "needs tools",
     "tool_choice", None),
    ("parallel-str", _c(parallel_tool_calls="yes"), "valid boolean", "parallel_tool_calls",
     "invalid_value"),
    ("tool-no-id", _c(messages=[*HISTORY[:2], {"role": "tool", "content": "x"}]),
     "tool_call_id is required", "messages[2].tool_call_id", None),
    ("arguments-not-json", _c(messages=[HISTORY[0], {**HISTORY[1], "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]),
     "must be a JSON object in a string", "messages[1].tool_calls[0].function.arguments", None),
    ("calls-on-user", _c(messages=[{"role": "user", "content": "x", "tool_calls": []}]),
     "only allowed on assistant", "messages[0]", None),
]
# fmt: on


def test_bad_tool_requests_name_the_field(qwen: Served) -> None:
    failures = []
    for name, body, fragment, param, code in REFUSED:
        r = qwen.post(body)
        if not refused_as(r, param, fragment, code=code):
            failures.append(f"{name}: {r.status_code} {r.text}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_template_without_tools_is_refused(base_url: str, choice: str) -> None:
    # The shared server's template is plain ChatML: it never renders tools.
    r = httpx.post(base_url + CHAT, json=_c(tool_choice=choice), timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] == "this model's chat template does not support tools"
    assert error["param"] == "tools"


def test_empty_tools_and_neutral_choice_are_plain_chat(base_url: str) -> None:
    for extra in (
        {"tools": []},
        {"tools": [], "tool_choice": "auto"},
        {"tools": None, "tool_choice": "none"},
    ):
        r = httpx.post(base_url + CHAT, json=_c(max_tokens=2) | extra, timeout=30)
        assert r.status_code == 200, (extra, r.text)
        assert "tool_calls" not in r.json()["choices"][0]["message"]


# ---- templates ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf(engine: Engine) -> Any:
    return copy.deepcopy(engine.tokenizer.hf)


def _render_text(hf: Any, template: str, messages: list[dict[str, Any]]) -> str:
    tok = copy.copy(hf)
    tok.chat_template = template
    req = ChatCompletionRequest.model_validate({"messages": messages, "tools": TOOLS})
    tools_req = P.chat_tools(req)
    assert tools_req is not None
    ids = render(tok, P.chat_messages(req.messages), tools_req.tools)
    return tok.decode(ids)


def test_qwen_template_gets_tools_and_history(hf: Any) -> None:
    text = _render_text(hf, QWEN25_TEMPLATE, HISTORY)
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert '"description": "The weather in a city."' in text
    # arguments went to the template as an object: printed once, not as a quoted string
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_llama_template_gets_tools_and_history(hf: Any) -> None:
    text = _render_text(hf, LLAMA31_TEMPLATE, HISTORY)
    assert '"name": "get_time"' in text and "Environment: ipython" in text
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in text
    assert "ipython<|end_header_id|>\n\nsunny, 21 C" in text


def test_mistral_template_gets_tools(hf: Any) -> None:
    text = _render_text(hf, MISTRAL_V03_TEMPLATE, USER)
    assert text.startswith("[AVAILABLE_TOOLS] [") and "get_weather" in text
    # Its history wants 9-character call ids, which is why Mistral calls get such ids.
    with pytest.raises(Exception, match="length 9"):
        _render_text(hf, MISTRAL_V03_TEMPLATE, HISTORY)


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, TOOLS_IGNORED_TEMPLATE])
def test_templates_that_drop_tools_are_refused(hf: Any, template: str) -> None:
    with pytest.raises(APIError, match="does not support tools"):
        _render_text(hf, template, USER)


@pytest.mark.parametrize(
    ("template", "family", "fmt"),
    [
        (QWEN25_TEMPLATE, "llama", "hermes"),  # a template's markers beat the family
        (LLAMA31_TEMPLATE, "qwen2", "llama3_json"),
        (MISTRAL_V03_TEMPLATE, "llama", "mistral"),
        ("{{ tools }}{{ messages }}", "qwen3", "hermes"),  # no markers: the family's own
        ("{{ tools }}{{ messages }}", "mistral", "mistral"),
        ("{{ tools }}{{ messages }}", "llama", "llama3_json"),
    ],
)
def test_format_follows_the_template(hf: Any, template: str, family: str, fmt: str) -> None:
    tok = copy.copy(hf)
    tok.chat_template = template
    assert tool_format(tok, family, TOOLS) == fmt


def test_skipped_marker_tokens_are_written_back(hf: Any) -> None:
    tok = copy.deepcopy(hf)
    assert marker_token_ids(tok, "mistral") == {}  # not a token: it decodes as text anyway
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tid = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    assert tok.decode([tid], skip_special_tokens=True) == ""
    markers = marker_token_ids(tok, "mistral")
    assert markers == {tid: "[TOOL_CALLS]"}
    parsing = ToolParsing("mistral", True, markers)
    assert parsing.text(tid, "") == "[TOOL_CALLS]"
    assert parsing.text(5, "x") == "x" and parsing.text(None, "y") == "y"


# ---- calls parsed back over HTTP ---------------------------------------------------------


def test_calls_non_streamed(qwen: Served) -> None:
    qwen.say(TWO_CALLS)
    r = qwen.post(_c())
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me check."
    calls = message["tool_calls"]
    assert [(c["type"], c["function"]["name"]) for c in calls] == [
        ("function", "get_weather"),
        ("function", "get_time"),
    ]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize(
    "output",
    [
        TWO_CALLS,
        f"<tool_call>\n{W}\n</tool_call>",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call> sorry',
        "Paris is sunny, 21 \u00b0C. <tool_",
        "",
    ],
)
def test_streamed_deltas_add_up_to_the_non_streamed_reply(qwen: Served, output: str) -> None:
    qwen.say(output)
    whole = qwen.post(_c()).json()["choices"][0]
    qwen.say(output)
    chunks = _stream(qwen, _c(stream_options={"include_usage": True}))
    message, finish = _assemble(chunks)
    assert finish == whole["finish_reason"]
    assert _without_ids(message) == _without_ids(whole["message"])
    assert chunks[-1]["usage"]["completion_tokens"] > 0
    if "tool_calls" in whole["message"]:
        first = next(c for c in chunks if c["choices"] and "tool_calls" in c["choices"][0]["delta"])
        head = first["choices"][0]["delta"]["tool_calls"][0]
        assert head["function"]["arguments"] == "" and head["id"].startswith("call_")


def test_malformed_call_is_content(qwen: Served) -> None:
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par}\n</tool_call>'
    qwen.say(bad)
    choice = qwen.post(_c()).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": bad}


def test_choice_none_leaves_text_alone(qwen: Served) -> None:
    qwen.say(TWO_CALLS)
    choice = qwen.post(_c(tool_choice="none")).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": TWO_CALLS}


def test_parallel_false_gives_one_call(qwen: Served) -> None:
    qwen.say(TWO_CALLS)
    message = qwen.post(_c(parallel_tool_calls=False)).json()["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


def test_call_cut_by_max_tokens_is_length_and_text(qwen: Served) -> None:
    qwen.say(TWO_CALLS)
    choice = qwen.post(_c(max_tokens=12)).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert "tool_calls" not in choice["message"]
    assert choice["message"]["content"].startswith("Let me check.")


def test_history_goes_back_through_the_template(qwen: Served) -> None:
    """A tool result turn: the prompt is what the template makes of the history, with the
    call's arguments as an object, and the answer after it is plain text."""
    qwen.say("It is sunny in Paris.")
    r = qwen.post(_c(messages=HISTORY))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "It is sunny in Paris.",
    }
    hf = qwen.engine.tokenizer.hf
    history = copy.deepcopy(HISTORY)
    history[1]["content"] = ""
    history[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    text = hf.apply_chat_template(history, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert body["usage"]["prompt_tokens"] == len(hf(text, add_special_tokens=False)["input_ids"])


def test_mistral_marker_skipped_by_decoding_still_makes_a_call(
    served_factory: Callable[..., Served],
) -> None:
    mistral = served_factory(MISTRAL_V03_TEMPLATE, special="[TOOL_CALLS]")
    mistral.say(f" [{W}]", special="[TOOL_CALLS]")
    choice = mistral.post(_c()).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and len(call["id"]) == 9
    mistral.say(f" [{W}]", special="[TOOL_CALLS]")
    message, finish = _assemble(_stream(mistral, _c()))
    assert finish == "tool_calls"
    assert _without_ids(message) == _without_ids(choice["message"])


def test_openai_client_tool_loop(qwen: Served) -> None:
    """The official client: a call, streamed and not, then the tool result turn."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=qwen.url + "/v1", api_key="x", max_retries=0, timeout=30)
    qwen.say(f"<tool_call>\n{W}\n</tool_call>")
    r = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    qwen.say(f"<tool_call>\n{W}\n</tool_call>")
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, tools=TOOLS, stream=True
    )
    names, args, finishes = [], "", []
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                if tc.function and tc.function.name:
                    names.append(tc.function.name)
                args += (tc.function.arguments or "") if tc.function else ""
            finishes.append(c.finish_reason)
    assert names == ["get_weather"] and json.loads(args) == {"city": "Paris"}
    assert finishes[-1] == "tool_calls"

    qwen.say("Sunny.")
    turn = [
        *USER,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    r = client.chat.completions.create(model=MODEL_NAME, messages=turn, tools=TOOLS)
    assert r.choices[0].message.content == "Sunny."
    assert r.choices[0].finish_reason == "stop"
