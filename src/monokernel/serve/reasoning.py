"""Reasoning models: the ``<think>…</think>`` that templates such as Qwen3's (and DeepSeek
R1's) teach, split from the answer as it is generated, and the output reader that puts
the reasoning splitter in front of the tool-call parser.

Where the reasoning starts is read from the prompt: a template may open the assistant turn
with ``<think>`` already written (Qwen3's thinking-only releases, DeepSeek R1), and then the
reply holds only ``</think>``; otherwise a reply that opens with ``<think>`` is reasoning up
to ``</think>``. A prompt that ends with ``</think>`` (Qwen3 with ``enable_thinking``
false writes an empty one) has no reasoning to split. Tool calls are parsed only from the
text after the reasoning, so a call the model considers while thinking is not made.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from monokernel.serve.tool_calls import (
    CallDelta,
    ContentDelta,
    Delta,
    ReasoningDelta,
    ToolStream,
    partial_marker,
)
from monokernel.serve.tools import ToolParsing, skipped_marker_ids, template_source

THINK_START, THINK_END = "<think>", "</think>"
# Families whose models think even where a template copy lost the markers.
_THINKING_FAMILIES = frozenset({"qwen3"})
# Enough prompt tokens to hold "<think>\n" however a tokenizer splits it.
_TAIL_TOKENS = 16
# The ways a reply may begin: inside the reasoning (the prompt opened it), possibly with
# it (the model opens it itself), or not at all.
OPEN, MAYBE = "open", "maybe"


def thinking_template(hf: Any, family: str, tools: list[dict[str, Any]] | None) -> bool:
    return THINK_START in template_source(hf, tools) or family in _THINKING_FAMILIES


def reasoning_start(
    hf: Any, family: str, tools: list[dict[str, Any]] | None, prompt_ids: Sequence[int]
) -> str | None:
    """How the reply begins (OPEN, MAYBE), or None when it has no reasoning to split.
    Blocking (tokenizer thread)."""
    if not thinking_template(hf, family, tools):
        return None
    tail = hf.decode(list(prompt_ids[-_TAIL_TOKENS:]), skip_special_tokens=False).rstrip()
    if tail.endswith(THINK_END):
        return None
    return OPEN if tail.endswith(THINK_START) else MAYBE


@dataclass
class ReasoningSplitter:
    """Text in, ("reasoning" | "content", text) pieces out, streamed or not.

    Whitespace at the ends of the reasoning and before the answer is layout (Qwen3 writes
    ``<think>\\n…\\n</think>\\n\\n``; its template strips it when the turn comes back), so it
    is dropped; trailing whitespace inside the reasoning is held until text follows it.
    A possible partial marker is held back until the next text decides it."""

    state: str  # "start", "reasoning", "after" (the marker's layout), "content"
    _buffer: str = ""
    _blank: str = ""
    _said: bool = False  # some reasoning has gone out (so leading whitespace is dropped)

    @classmethod
    def opening(cls, start: str) -> ReasoningSplitter:
        return cls("reasoning" if start == OPEN else "start")

    @property
    def reasoning(self) -> bool:
        return self.state == "reasoning"

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        self._buffer += text
        out: list[tuple[str, str]] = []
        while True:
            buf = self._buffer
            if self.state == "start":
                head = buf.lstrip()
                if head.startswith(THINK_START):
                    self.state, self._buffer = "reasoning", head[len(THINK_START) :]
                    continue
                if THINK_START.startswith(head) and not final:
                    return out  # whitespace or "<thi": undecided
                self.state = "content"
                continue
            if self.state == "reasoning":
                i = buf.find(THINK_END)
                if i >= 0:
                    out += self._reasoning(buf[:i], end=True)
                    self.state, self._buffer = "after", buf[i + len(THINK_END) :]
                    continue
                keep = 0 if final else partial_marker(buf, 0, THINK_END)
                out += self._reasoning(buf[: len(buf) - keep], end=final)
                self._buffer = buf[len(buf) - keep :]
                return out
            if self.state == "after":
                head = buf.lstrip()
                self._buffer = head
                if not head:
                    return out
                self.state = "content"
                continue
            self._buffer = ""
            if buf:
                out.append(("content", buf))
            return out

    def finish(self) -> list[tuple[str, str]]:
        return self.feed("", final=True)

    def _reasoning(self, text: str, end: bool) -> list[tuple[str, str]]:
        text = self._blank + text
        if not self._said:
            text = text.lstrip()
        body = text.rstrip()
        self._blank = "" if end else text[len(body) :]
        if not body:
            return []
        self._said = True
        return [("reasoning", body)]


@dataclass(frozen=True, slots=True)
class OutputParsing:
    """How one chat request's output is read: reasoning split off (``start``), tool calls
    parsed (``tools``), or both."""

    tools: ToolParsing | None
    start: str | None
    markers: dict[int, str]  # special-token id -> the marker text decoding dropped

    def stream(self) -> OutputStream:
        splitter = ReasoningSplitter.opening(self.start) if self.start else None
        return OutputStream(splitter, self.tools.stream() if self.tools else None)

    def text(self, token_id: int | None, text: str) -> str:
        """An event's text with a skipped marker token written back. A special token
        decodes to nothing, so its event's text is empty and nothing is reordered."""
        if token_id is None:
            return text
        return self.markers.get(token_id, "") + text


def output_parsing(
    hf: Any,
    family: str,
    tools: ToolParsing | None,
    tool_list: list[dict[str, Any]] | None,
    prompt_ids: Sequence[int],
) -> OutputParsing | None:
    """None when the output is plain text. Blocking (tokenizer thread)."""
    start = reasoning_start(hf, family, tool_list, prompt_ids)
    if tools is None and start is None:
        return None
    markers = dict(tools.markers) if tools else {}
    if start is not None:
        markers |= skipped_marker_ids(hf, (THINK_START, THINK_END))
    return OutputParsing(tools, start, markers)


@dataclass
class OutputStream:
    """Generated text in, reasoning, content and tool-call deltas out: the reasoning
    splitter first, then the tool-call parser on what follows the reasoning."""

    splitter: ReasoningSplitter | None
    tools: ToolStream | None
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    reasoning_tokens: int = 0
    deltas: list[Delta] = field(default_factory=list)  # every delta given out, in order

    @property
    def calls(self) -> list[CallDelta]:
        return self.tools.calls if self.tools else []

    def feed(self, text: str, tokens: int = 0) -> list[Delta]:
        """``tokens``: how many generated tokens ``text`` holds, counted as reasoning when
        they are (or end) the reasoning."""
        if self.splitter is None:
            out = self._content([("content", text)])
        else:
            before = self.splitter.reasoning
            out = self._content(self.splitter.feed(text))
            if before or self.splitter.reasoning:
                self.reasoning_tokens += tokens
        self.deltas += out
        return out

    def finish(self) -> list[Delta]:
        out = self._content(self.splitter.finish()) if self.splitter else []
        if self.tools is not None:
            out += self.tools.finish()
        self.deltas += out
        return out

    def _content(self, pieces: Iterable[tuple[str, str]]) -> list[Delta]:
        out: list[Delta] = []
        for kind, text in pieces:
            if not text:
                continue
            if kind == "reasoning":
                self.reasoning.append(text)
                out.append(ReasoningDelta(text))
            elif self.tools is not None:
                out += self.tools.feed(text)
            else:
                self.content.append(text)
                out.append(ContentDelta(text))
        return out

    def message(self) -> dict[str, Any]:
        """The assistant message of a finished stream (after ``finish``)."""
        if self.tools is not None:
            msg = self.tools.message()
        else:
            msg = {"role": "assistant", "content": "".join(self.content)}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        return msg
