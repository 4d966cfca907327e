"""Tool calls parsed back out of generated text, one parser per model family's format.

- ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number of them, with text around.
- ``llama3_json`` (Llama 3.1+): the whole reply is ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``; several calls may be separated by ``;``.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` objects.

Every parser cuts the text into decided segments (text or a call) and holds back the rest,
and its decisions on a prefix never change when more text comes. ``ToolStream`` drives a
parser for both the streamed and the whole response, so both say the same thing. A call is
only given out once it is complete, because only then is it known to be well-formed: a
malformed one goes back into the content as the text the model wrote.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("hermes", "llama3_json", "mistral")
# Markers that tokenizers often register as special tokens, which the detokenizer skips:
# the server writes them back into the text (see ``marker_token_ids``).
MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "llama3_json": ("<|python_tag|>",),
    "mistral": ("[TOOL_CALLS]",),
}
_ALNUM = string.ascii_letters + string.digits
# json's decoder recurses per nesting level: output nested a few thousand deep raises
# RecursionError, and it must come back as text like any other malformed call.
_BAD_JSON = (ValueError, RecursionError)


@dataclass(frozen=True, slots=True)
class Text:
    text: str


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


Segment = Text | Call


def call_from(obj: Any) -> Call | None:
    """A call from a decoded object with a name and an arguments object, else None.
    Families disagree on the key (``arguments``, Llama's ``parameters``) and some models
    write the arguments as a JSON string, so all of these are taken."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except _BAD_JSON:
            return None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return Call(name, json.dumps(args, ensure_ascii=False))


def json_value_end(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON array or object opening at ``text[start]``, by bracket
    matching outside strings; None while it is still open. Well-formedness is judged later
    by ``json.loads``: this only finds where the value stops."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def partial_marker(text: str, start: int, marker: str) -> int:
    """Length of the longest tail of ``text[start:]`` that could begin ``marker``."""
    for n in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class Parser:
    """Cuts text into decided segments; subclasses hold any state across calls."""

    def scan(self, text: str, final: bool) -> tuple[list[Segment], int]:
        """Decided segments of ``text`` and how many characters they cover; the rest is
        held back for more text. With ``final`` everything is decided."""
        raise NotImplementedError


class HermesParser(Parser):
    START, END = MARKERS["hermes"]

    def scan(self, text: str, final: bool) -> tuple[list[Segment], int]:
        segments: list[Segment] = []
        pos = 0
        while pos < len(text):
            i = text.find(self.START, pos)
            if i < 0:
                end = len(text) if final else len(text) - partial_marker(text, pos, self.START)
                if end > pos:
                    segments.append(Text(text[pos:end]))
                return segments, end
            if i > pos:
                segments.append(Text(text[pos:i]))
            j = text.find(self.END, i + len(self.START))
            if j < 0 and not final:
                return segments, i
            # A last call left open (the model stopped at EOS) still counts if it is whole.
            end = len(text) if j < 0 else j + len(self.END)
            body = text[i + len(self.START) : len(text) if j < 0 else j]
            segments.append(_decode_one(body) or Text(text[i:end]))
            pos = end
        return segments, pos


def _decode_one(body: str) -> Call | None:
    try:
        return call_from(json.loads(body))
    except _BAD_JSON:
        return None


class MistralParser(Parser):
    MARKER = MARKERS["mistral"][0]

    def scan(self, text: str, final: bool) -> tuple[list[Segment], int]:
        segments: list[Segment] = []
        pos = 0
        while pos < len(text):
            i = text.find(self.MARKER, pos)
            if i < 0:
                end = len(text) if final else len(text) - partial_marker(text, pos, self.MARKER)
                if end > pos:
                    segments.append(Text(text[pos:end]))
                return segments, end
            if i > pos:
                segments.append(Text(text[pos:i]))
            k = i + len(self.MARKER)
            while k < len(text) and text[k].isspace():
                k += 1
            if k == len(text):
                if not final:
                    return segments, i
                segments.append(Text(text[i:]))
                return segments, len(text)
            if text[k] not in "[{":  # not a call after all: the marker is text
                segments.append(Text(text[i:k]))
                pos = k
                continue
            end = json_value_end(text, k)
            if end is None:
                if not final:
                    return segments, i
                segments.append(Text(text[i:]))
                return segments, len(text)
            calls = _decode_calls(text[k:end])
            segments.extend(calls if calls else [Text(text[i:end])])
            pos = end
        return segments, pos


def _decode_calls(raw: str) -> list[Call]:
    """An array of calls (or one call object); empty if any element is not a call, so a
    half-valid array is returned whole as text rather than partly as calls."""
    try:
        value = json.loads(raw)
    except _BAD_JSON:
        return []
    items = value if isinstance(value, list) else [value]
    calls = [call_from(item) for item in items]
    if not calls or any(c is None for c in calls):
        return []
    return [c for c in calls if c is not None]


class Llama3JsonParser(Parser):
    """Llama's calls are the whole reply, so the first non-blank characters decide: a
    reply opening with ``{`` or ``<|python_tag|>`` is held to the end and parsed as calls;
    any other is text from there on."""

    TAG = MARKERS["llama3_json"][0]

    def __init__(self) -> None:
        self.mode: str | None = None  # None (undecided), "text" or "calls"

    def scan(self, text: str, final: bool) -> tuple[list[Segment], int]:
        if self.mode is None:
            head = text.lstrip()
            if head.startswith((self.TAG, "{")):
                self.mode = "calls"
            elif head and not (self.TAG.startswith(head) and not final):
                self.mode = "text"
            elif not final:
                return [], 0
        if self.mode == "calls":
            if not final:
                return [], 0
            calls = self._calls(text)
            return (calls if calls else [Text(text)]) if text else [], len(text)
        return ([Text(text)] if text else []), len(text)

    def _calls(self, text: str) -> list[Call]:
        body = text.lstrip()
        body = body.removeprefix(self.TAG)
        calls: list[Call] = []
        decoder = json.JSONDecoder()
        pos = 0
        while True:
            while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
                pos += 1
            if pos == len(body):
                return calls
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except _BAD_JSON:
                return []
            call = call_from(obj)
            if call is None:
                return []
            calls.append(call)


def make_parser(fmt: str) -> Parser:
    if fmt == "hermes":
        return HermesParser()
    if fmt == "mistral":
        return MistralParser()
    if fmt == "llama3_json":
        return Llama3JsonParser()
    raise ValueError(f"unknown tool-call format {fmt!r}")


def new_call_id(fmt: str) -> str:
    # Mistral's templates refuse a call id that is not 9 letters or digits when the call
    # comes back in the history, so that family gets ids of that shape.
    if fmt == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class CallDelta:
    index: int
    id: str
    call: Call


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """Reasoning text (``reasoning.ReasoningSplitter``); the tool parser never makes one."""

    text: str


Delta = ContentDelta | CallDelta | ReasoningDelta


@dataclass
class ToolStream:
    """Generated text in, content and tool-call deltas out (streamed or not).

    Content is the text around the calls; when there are calls, the whitespace at its
    ends is layout and dropped. So trailing whitespace is held until text follows it
    (a stream must not send what the end of the reply drops). A reply of only calls has
    content null, as OpenAI's does. With
    ``parallel`` false only the first call is kept (OpenAI's "at most one call").
    """

    fmt: str
    parallel: bool = True
    parser: Parser = field(init=False)
    calls: list[CallDelta] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    _buffer: str = ""
    _blank: str = ""  # trailing whitespace, held

    def __post_init__(self) -> None:
        self.parser = make_parser(self.fmt)

    def feed(self, text: str) -> list[Delta]:
        if not text:
            return []
        self._buffer += text
        segments, used = self.parser.scan(self._buffer, final=False)
        self._buffer = self._buffer[used:]
        return list(self._take(segments))

    def finish(self) -> list[Delta]:
        """The end of the generation: decide what is held back."""
        segments, _ = self.parser.scan(self._buffer, final=True)
        self._buffer = ""
        out = list(self._take(segments))
        if self._blank and not self.calls:
            out.append(self._content(self._blank))
        self._blank = ""
        return out

    def _take(self, segments: Iterable[Segment]) -> Iterable[Delta]:
        for seg in segments:
            if isinstance(seg, Call):
                if self.calls and not self.parallel:
                    continue
                delta = CallDelta(len(self.calls), new_call_id(self.fmt), seg)
                self.calls.append(delta)
                yield delta
                continue
            if self.content:
                text = self._blank + seg.text
            elif self.calls:  # the reply opened with calls: drop the layout after them
                text = seg.text.lstrip()
            else:
                text = self._blank + seg.text
            body = text.rstrip()
            self._blank = text[len(body) :]
            if body:
                yield self._content(body)

    def _content(self, text: str) -> ContentDelta:
        self.content.append(text)
        return ContentDelta(text)

    def message(self) -> dict[str, Any]:
        """The assistant message of a finished stream (after ``finish``)."""
        content: str | None = "".join(self.content)
        if self.calls and not content:
            content = None
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.calls:
            msg["tool_calls"] = [tool_call_json(c) for c in self.calls]
        return msg


def tool_call_json(c: CallDelta) -> dict[str, Any]:
    return {
        "id": c.id,
        "type": "function",
        "function": {"name": c.call.name, "arguments": c.call.arguments},
    }
