"""The tool-call parsers on model-output strings of each family, without a server."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from monokernel.serve.tool_calls import CallDelta, ContentDelta, Delta, ToolStream

W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
T = '{"name": "get_time", "arguments": {}}'
WEATHER = ("get_weather", {"city": "Paris"})
TIME = ("get_time", {})

# (id, format, model output, content, [(name, arguments)])
# fmt: off
CASES: list[tuple[str, str, str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    ("hermes-one", "hermes", f"<tool_call>\n{W}\n</tool_call>", None, [WEATHER]),
    ("hermes-text-then-two", "hermes",
     f"Let me look.\n<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>",
     "Let me look.", [WEATHER, TIME]),
    ("hermes-unclosed-at-eos", "hermes", f"<tool_call>\n{W}\n", None, [WEATHER]),
    ("hermes-args-as-string", "hermes",
     '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
     None, [WEATHER]),
    ("hermes-malformed", "hermes",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par}\n</tool_call>', []),
    ("hermes-no-name", "hermes", '<tool_call>{"arguments": {}}</tool_call>',
     '<tool_call>{"arguments": {}}</tool_call>', []),
    ("hermes-one-good-one-bad", "hermes",
     f"<tool_call>{W}</tool_call><tool_call>{{oops</tool_call>",
     "<tool_call>{oops</tool_call>", [WEATHER]),
    ("hermes-plain", "hermes", "Paris is sunny.\n", "Paris is sunny.\n", []),
    ("hermes-tag-like-text", "hermes", "a <tool> b <tool_ca", "a <tool> b <tool_ca", []),
    ("llama-one", "llama3_json",
     '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [WEATHER]),
    ("llama-python-tag-two", "llama3_json",
     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {}}', None, [WEATHER, TIME]),
    ("llama-leading-space", "llama3_json", f"  {W}", None, [WEATHER]),
    ("llama-text", "llama3_json", "It is {sunny} in Paris.", "It is {sunny} in Paris.", []),
    ("llama-malformed", "llama3_json", '{"name": "get_weather", "parameters": {"city"',
     '{"name": "get_weather", "parameters": {"city"', []),
    ("llama-json-not-a-call", "llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama-code", "llama3_json", "<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("mistral-two", "mistral", f"[TOOL_CALLS] [{W}, {T}]", None, [WEATHER, TIME]),
    ("mistral-text-around", "mistral",
     'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}] ok',
     "Checking.  ok", [WEATHER]),
    ("mistral-brackets-in-strings", "mistral",
     '[TOOL_CALLS] [{"name": "f", "arguments": {"s": "]}\\"["}}]', None, [("f", {"s": ']}"['})]),
    ("mistral-malformed", "mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {]',
     '[TOOL_CALLS] [{"name": "f", "arguments": {]', []),
    ("mistral-half-valid-array", "mistral", f'[TOOL_CALLS] [{W}, {{"x": 1}}]',
     f'[TOOL_CALLS] [{W}, {{"x": 1}}]', []),
    ("mistral-marker-then-text", "mistral", "[TOOL_CALLS] sorry", "[TOOL_CALLS] sorry", []),
]
# fmt: on
ARGS = ("name", "fmt", "text", "content", "calls")


def _whole(fmt: str, text: str, parallel: bool = True) -> dict[str, Any]:
    stream = ToolStream(fmt, parallel)
    stream.feed(text)
    stream.finish()
    return stream.message()


def _calls(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls", [])
    ]


@pytest.mark.parametrize(
    ("name", "fmt", "text", "content", "calls"), CASES, ids=[c[0] for c in CASES]
)
def test_parse_whole(
    name: str, fmt: str, text: str, content: str | None, calls: list[tuple[str, Any]]
) -> None:
    message = _whole(fmt, text)
    assert message["content"] == content
    assert _calls(message) == calls
    for call in message.get("tool_calls", []):
        assert call["type"] == "function"
        assert isinstance(call["function"]["arguments"], str)
        if fmt == "mistral":  # the shape Mistral's template demands back in the history
            assert len(call["id"]) == 9 and call["id"].isalnum()
        else:
            assert call["id"].startswith("call_")


@pytest.mark.parametrize(
    ("name", "fmt", "text", "content", "calls"), CASES, ids=[c[0] for c in CASES]
)
def test_streamed_pieces_add_up_to_the_whole(
    name: str, fmt: str, text: str, content: str | None, calls: list[tuple[str, Any]]
) -> None:
    """Cut anywhere (one character at a time, or random pieces), the deltas say what the
    whole text says."""
    rng = random.Random(name)
    cuts = [list(text)]
    for _ in range(5):
        points = sorted(rng.sample(range(1, len(text)), k=min(4, len(text) - 1)))
        cuts.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)])
    for pieces in cuts:
        stream = ToolStream(fmt)
        deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
        streamed = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
        assert (streamed or None) == content or (streamed == content == "")
        got = [
            (d.call.name, json.loads(d.call.arguments)) for d in deltas if isinstance(d, CallDelta)
        ]
        assert got == calls
        assert [d.index for d in _calls_in(deltas)] == list(range(len(calls)))


def _calls_in(deltas: list[Delta]) -> list[CallDelta]:
    return [d for d in deltas if isinstance(d, CallDelta)]


def test_marker_prefix_is_held_until_decided() -> None:
    stream = ToolStream("hermes")
    assert stream.feed("Hi <tool_") == [ContentDelta("Hi")]  # " <tool_" may start a call
    assert stream.feed("x>") == [ContentDelta(" <tool_x>")]
    stream = ToolStream("hermes")
    assert stream.feed("<tool_call>\n{") == []
    assert stream.feed('"name": "get_time", "arguments": {}}\n</tool_call>')[0] == CallDelta(
        0, stream.calls[0].id, stream.calls[0].call
    )


def test_text_after_an_opening_brace_waits_for_the_end_with_llama() -> None:
    stream = ToolStream("llama3_json")
    assert stream.feed('{"name": "get_time", ') == []
    assert stream.feed('"parameters": {}}') == []
    (delta,) = stream.finish()
    assert isinstance(delta, CallDelta) and delta.call.name == "get_time"
    plain = ToolStream("llama3_json")
    assert plain.feed("Sunny") == [ContentDelta("Sunny")]  # decided at once: streamed


def test_parallel_false_keeps_the_first_call() -> None:
    text = f"<tool_call>{W}</tool_call>\n<tool_call>{T}</tool_call>"
    assert _calls(_whole("hermes", text, parallel=False)) == [WEATHER]
    assert _calls(_whole("hermes", text)) == [WEATHER, TIME]


def test_ids_are_unique() -> None:
    text = "".join(f"<tool_call>{T}</tool_call>" for _ in range(50))
    ids = [c["id"] for c in _whole("hermes", text)["tool_calls"]]
    assert len(set(ids)) == 50


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "llama3_json"])
def test_absurdly_nested_output_is_text(fmt: str) -> None:
    # json recurses per level; a model's runaway brackets must come back as text, not a 500
    nested = '{"name": "f", "arguments": {"a": ' + "[" * 50_000 + "]" * 50_000 + "}}"
    opener = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS] [", "llama3_json": ""}[fmt]
    closer = {"hermes": "</tool_call>", "mistral": "]", "llama3_json": ""}[fmt]
    text = opener + nested + closer
    assert _whole(fmt, text) == {"role": "assistant", "content": text}
