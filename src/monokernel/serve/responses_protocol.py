"""The OpenAI Responses wire format (``POST /v1/responses``): the request, its conversion
to the chat request the chat route serves, the bounded store behind
``previous_response_id``, and the output items and stream events built back.

As with Anthropic's API, the request becomes a ``ChatCompletionRequest`` (``instructions``
a system message, ``function_call`` items assistant ``tool_calls``,
``function_call_output`` items ``tool`` messages, function tools chat tools), so it is
checked, rendered, queued, generated and parsed exactly as a chat request is. What is
specific to this API is checked here first, so each refusal names the field as the client
wrote it (``input[2].call_id``), and the chat route's own refusals are renamed to this
API's fields (``chat_error``). ``text.format`` becomes the chat route's
``response_format`` and ``strict`` function tools chat's, so structured output and forced
tool calls are enforced by constrained decoding as on chat (serve/structured.py; refused
where the engine cannot run it).
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from monokernel.serve.anthropic_protocol import template_call_id
from monokernel.serve.body import clip, echo, refuse_unknown_keys, unknown_field, validate
from monokernel.serve.errors import APIError, bad_request
from monokernel.serve.params import text_chars
from monokernel.serve.protocol import ChatCompletionRequest
from monokernel.serve.tool_calls import CallDelta, ContentDelta, Delta

# How many past responses ``previous_response_id`` can name, and how many characters of
# conversation they may hold together (the least recently used go first): a bound on what
# the server keeps whatever clients send.
STORE_RESPONSES = 256
STORE_CHARS = 64 * 1024 * 1024
_ROLES = ("user", "assistant", "system", "developer")
_MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})
_CALL_KEYS = frozenset({"type", "call_id", "name", "arguments", "id", "status"})
_OUTPUT_KEYS = frozenset({"type", "call_id", "output", "id", "status"})
_REASONING_KEYS = frozenset({"type", "id", "summary", "content", "encrypted_content", "status"})
_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
# text.format's keys by type (OpenAI's ResponseFormatTextConfig).
_FORMAT_KEYS = {
    "text": frozenset({"type"}),
    "json_object": frozenset({"type"}),
    "json_schema": frozenset({"type", "name", "schema", "strict", "description"}),
}
# The chat route's names for this API's fields, longest first (see ``chat_error``).
_CHAT_NAMES = (
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_tokens", "max_output_tokens"),
)
_CHAT_TOOL = re.compile(r"tools\[(\d+)\]\.function\b")
# Taken and not used: they never change what is generated.
_HINTS = ("metadata", "user", "service_tier", "prompt_cache_key", "safety_identifier")


class ResponsesRequest(BaseModel):
    # extra="allow": unknown fields are refused by name in ``check_extras``.
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    text: Any = None  # its format, see ``response_format``
    # Accepted at their neutral values only (see ``check_extras``).
    reasoning: Any = None
    include: list[Any] | None = None
    truncation: str | None = None


def check_extras(req: ResponsesRequest) -> None:
    """Neutral values of fields this server does not implement, and unknown fields, each
    refused by name, as the chat route refuses them."""
    if req.reasoning not in (None, {}):
        raise bad_request(
            f"reasoning={echo(req.reasoning)} is not supported: a reasoning model thinks by "
            "its chat template (see chat_template_kwargs on chat); its reasoning comes back "
            "as reasoning items",
            "reasoning",
            "unsupported",
        )
    if req.include:
        raise bad_request(f"include={echo(req.include)} is not supported", "include", "unsupported")
    if req.truncation not in (None, "disabled"):
        raise bad_request(
            f"truncation={echo(req.truncation)} is not supported: prompts over the context "
            "are refused, not cut",
            "truncation",
            "unsupported",
        )
    for name in req.model_extra or {}:
        if name not in _HINTS:
            raise unknown_field(name)


def response_format(text: Any) -> dict[str, Any] | None:
    """The chat route's ``response_format`` for ``text``: ``{"format": {"type": "text"}}``
    (or nothing) asks for none, ``json_object`` and ``json_schema`` (``name``, ``schema``,
    ``strict``, ``description`` beside ``type``, where chat nests them in ``json_schema``)
    for constrained decoding. Only the shape is checked here; the chat route checks the
    rest, and ``chat_error`` names its refusals ``text.format…``."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request(f"text must be an object, got {echo(text)}", "text")
    refuse_unknown_keys(text, frozenset({"format"}), "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if not isinstance(fmt, dict) or kind not in _FORMAT_KEYS:
        raise bad_request(
            f"text.format.type must be one of {', '.join(_FORMAT_KEYS)}, got {echo(kind)}",
            "text.format.type",
        )
    refuse_unknown_keys(fmt, _FORMAT_KEYS[kind], "text.format")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def chat_error(e: APIError) -> APIError:
    """A refusal of the chat request renamed to the fields this request has: chat's
    ``max_tokens`` is ``max_output_tokens``, ``response_format`` (and its
    ``json_schema``) ``text.format``, ``tools[i].function.x`` ``tools[i].x``."""
    for chat, ours in _CHAT_NAMES:
        if e.param is not None and (e.param == chat or e.param.startswith(chat + ".")):
            e.param = ours + e.param[len(chat) :]
            e.message = e.message.replace(chat, ours)
            break
    if e.param is not None and _CHAT_TOOL.match(e.param):
        e.param = _CHAT_TOOL.sub(r"tools[\1]", e.param)
        e.message = _CHAT_TOOL.sub(r"tools[\1]", e.message)
    return e


# ---- the store ---------------------------------------------------------------------------


@dataclass
class Stored:
    messages: list[dict[str, Any]]  # the conversation in chat form, without instructions
    calls: set[str]  # function call ids a function_call_output may answer
    chars: int


class ResponseStore:
    """Past responses for ``previous_response_id``: at most ``STORE_RESPONSES`` of them and
    ``STORE_CHARS`` characters, the least recently used evicted first. In memory, so it
    empties when the server restarts."""

    def __init__(self, responses: int = STORE_RESPONSES, chars: int = STORE_CHARS) -> None:
        self.max_responses = responses
        self.max_chars = chars
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def get(self, rid: str) -> Stored:
        with self._lock:
            stored = self._items.get(rid)
            if stored is not None:
                self._items.move_to_end(rid)
        if stored is None:
            raise bad_request(
                f"Previous response with id {clip(rid)!r} not found (this server keeps the "
                f"last {self.max_responses} stored responses, in memory)",
                "previous_response_id",
                "previous_response_not_found",
            )
        return stored

    def put(self, rid: str, messages: list[dict[str, Any]], calls: set[str]) -> None:
        chars = text_chars(messages)
        if chars > self.max_chars:
            return  # larger than the whole store: it would only evict everything else
        with self._lock:
            self._items[rid] = Stored(messages, calls, chars)
            self._chars += chars
            while len(self._items) > self.max_responses or self._chars > self.max_chars:
                _, old = self._items.popitem(last=False)
                self._chars -= old.chars


# ---- request -> chat request -------------------------------------------------------------


@dataclass
class Conversation:
    """The chat messages of a request (the previous response's, then its input), and the
    call ids a ``function_call_output`` may answer."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    calls: set[str] = field(default_factory=set)
    _reasoning: list[str] = field(default_factory=list)  # for the next assistant turn

    def assistant(self) -> dict[str, Any]:
        """The assistant turn to add to: the last message if it is the assistant's (a call
        joins the text before it, as chat holds them in one turn), else a new one."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            self.messages.append({"role": "assistant", "content": ""})
        msg = self.messages[-1]
        if self._reasoning:
            msg["reasoning_content"] = msg.get("reasoning_content", "") + "\n".join(self._reasoning)
            self._reasoning = []
        return msg


def to_chat(
    req: ResponsesRequest, store: ResponseStore
) -> tuple[ChatCompletionRequest, Conversation]:
    """The chat request this request means, and its conversation (without instructions),
    which the store keeps with the reply."""
    check_extras(req)
    fmt = response_format(req.text)
    conv = Conversation()
    if req.previous_response_id is not None:
        stored = store.get(req.previous_response_id)
        conv.messages = [dict(m) for m in stored.messages]
        conv.calls = set(stored.calls)
    if isinstance(req.input, str):
        conv.messages.append({"role": "user", "content": req.input})
    else:
        if not req.input:
            raise bad_request("input must hold at least one item", "input")
        for i, item in enumerate(req.input):
            _item(conv, item, f"input[{i}]")
    messages = list(conv.messages)
    if req.instructions is not None:
        # Instructions apply to this response only: they are not carried to the next.
        messages.insert(0, {"role": "system", "content": req.instructions})
    fields: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    tools = _tools(req.tools)
    if tools:
        fields["tools"] = tools
    if req.tool_choice is not None:
        fields["tool_choice"] = _choice(req.tool_choice)
    if req.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = req.parallel_tool_calls
    for name in ("temperature", "top_p"):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        fields["max_tokens"] = req.max_output_tokens
    if fmt is not None:
        fields["response_format"] = fmt
    try:
        return validate(fields, ChatCompletionRequest), conv
    except APIError as e:
        raise chat_error(e) from None


def _item(conv: Conversation, item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be an object, got {echo(item)}", where)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        refuse_unknown_keys(item, _MESSAGE_KEYS, where)
        role = item.get("role")
        if role not in _ROLES:
            raise bad_request(
                f"{where}.role is {echo(role)}; expected one of {', '.join(_ROLES)}",
                f"{where}.role",
            )
        text = _content(item.get("content"), f"{where}.content")
        if role == "assistant":
            msg = conv.assistant()
            if msg.get("tool_calls"):  # text after a call is a turn of its own
                conv.messages.append({"role": "assistant", "content": text})
            else:
                msg["content"] += text
        else:
            conv.messages.append({"role": role, "content": text})
    elif kind == "function_call":
        refuse_unknown_keys(item, _CALL_KEYS, where)
        call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"{where}.call_id must be a non-empty string", f"{where}.call_id")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where}.name must be a non-empty string", f"{where}.name")
        if not isinstance(args, str):
            raise bad_request(
                f"{where}.arguments must be a JSON object in a string", f"{where}.arguments"
            )
        conv.calls.add(call_id)
        msg = conv.assistant()
        call = {"id": template_call_id(call_id), "type": "function"}
        # The chat route checks the arguments and names this path if they are not an object.
        call["function"] = {"name": name, "arguments": args}
        msg.setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        refuse_unknown_keys(item, _OUTPUT_KEYS, where)
        call_id, output = item.get("call_id"), item.get("output")
        if call_id not in conv.calls:
            raise bad_request(
                f"{where}.call_id {echo(call_id)} matches no function_call before it (in input "
                "or the previous response)",
                f"{where}.call_id",
            )
        if not isinstance(output, str):
            output = _content(output, f"{where}.output")
        conv.messages.append(
            {"role": "tool", "tool_call_id": template_call_id(str(call_id)), "content": output}
        )
    elif kind == "reasoning":
        refuse_unknown_keys(item, _REASONING_KEYS, where)
        if item.get("encrypted_content") is not None:
            raise bad_request(
                f"{where}.encrypted_content is not supported: nothing is encrypted here",
                f"{where}.encrypted_content",
            )
        parts = item.get("content") or []
        if not isinstance(parts, list) or any(
            not isinstance(p, dict)
            or p.get("type") != "reasoning_text"
            or not isinstance(p.get("text"), str)
            for p in parts
        ):
            raise bad_request(
                f"{where}.content must be a list of reasoning_text parts", f"{where}.content"
            )
        conv._reasoning += [p["text"] for p in parts]
    else:
        raise bad_request(
            f"{where}.type is {echo(kind)}; only message, function_call, function_call_output "
            "and reasoning items are supported",
            f"{where}.type",
        )


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text"):
            raise bad_request(
                f"{at} has type {echo(kind)}; only input_text and output_text parts are "
                "supported (the served model reads text only)",
                f"{at}.type",
            )
        if set(part) - {"type", "text", "annotations", "logprobs"} or not isinstance(
            part.get("text"), str
        ):
            raise bad_request(f"{at} must be {{'type', 'text'}} with a string text", at)
        if part.get("annotations") not in (None, []):
            raise bad_request(f"{at}.annotations are not supported", f"{at}.annotations")
        texts.append(part["text"])
    return "".join(texts)


def _tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise bad_request(
                f"{where}.type is {echo(kind)}; only function tools are supported (no hosted "
                "tools: web search, file search, code interpreter, computer use...)",
                f"{where}.type",
            )
        refuse_unknown_keys(tool, _TOOL_KEYS, where)
        # strict goes to the chat route, which enforces it when the call is forced and
        # refuses it under tool_choice auto/none (the model may write any arguments then).
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _choice(choice: Any) -> Any:
    # Chat's shape, so the chat route judges it ("required" and a named function are
    # enforced by constrained decoding there).
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and set(choice) == {"type", "name"}
    ):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


# ---- the response ------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_json(prompt_n: int, output_n: int, cached: int, reasoning: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_n,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output_n,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt_n + output_n,
    }


def response_json(
    rid: str,
    req: ResponsesRequest,
    model: str,
    chat: ChatCompletionRequest,
    output: list[dict[str, Any]],
    status: str,
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    tools = [
        {"type": "function", "strict": False, "description": None, "parameters": None}
        | t["function"]
        for t in chat.tools or ()
    ]
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": chat.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": None,
        "store": req.store,
        "temperature": req.temperature,
        "text": {"format": _format_echo(req.text)},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": tools,
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": usage,
        "metadata": req.model_extra.get("metadata") if req.model_extra else None,
    }


def _format_echo(text: Any) -> dict[str, Any]:
    """``text.format`` as the response echoes it (checked by ``response_format``)."""
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt if isinstance(fmt, dict) else {"type": "text"}
    return {"description": None, "strict": None} | fmt


Event = dict[str, Any]


class Items:
    """Reasoning, text and call deltas, in order, into output items, with the stream
    events that build them: consecutive reasoning is one reasoning item, consecutive text
    one message item, each call a function_call item. The whole response is built by the
    same class from the same deltas, so the two agree."""

    def __init__(self) -> None:
        self.output: list[dict[str, Any]] = []
        self.seq = 0
        self._open: str | None = None  # "message" or "reasoning"
        self._pieces: list[str] = []

    def event(self, kind: str, **fields: Any) -> Event:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def add(self, delta: Delta) -> list[Event]:
        if isinstance(delta, ContentDelta):
            return self._piece("message", delta.text)
        if isinstance(delta, CallDelta):
            return self._call(delta)
        return self._piece("reasoning", delta.text)

    def _piece(self, kind: str, text: str) -> list[Event]:
        if not text:
            return []
        out: list[Event] = []
        if self._open != kind:
            out += self.close()
            self._open, self._pieces = kind, []
            if kind == "message":
                item = {"id": new_id("msg"), "type": "message", "role": "assistant"}
                item |= {"status": "in_progress", "content": []}
                part = {"type": "output_text", "text": "", "annotations": []}
            else:
                item = {"id": new_id("rs"), "type": "reasoning", "summary": []}
                item |= {"status": "in_progress", "content": []}
                part = {"type": "reasoning_text", "text": ""}
            self.output.append(item)
            index = len(self.output) - 1
            out.append(
                self.event("response.output_item.added", output_index=index, item=_copy(item))
            )
            out.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        item = self.output[-1]
        self._pieces.append(text)
        where = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
        if kind == "message":
            out.append(self.event("response.output_text.delta", **where, delta=text, logprobs=[]))
        else:
            out.append(self.event("response.reasoning_text.delta", **where, delta=text))
        return out

    def _call(self, d: CallDelta) -> list[Event]:
        out = self.close()
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress"}
        item |= {"call_id": d.id, "name": d.call.name, "arguments": ""}
        self.output.append(item)
        index = len(self.output) - 1
        out.append(self.event("response.output_item.added", output_index=index, item=_copy(item)))
        where = {"item_id": item["id"], "output_index": index}
        # The call is whole once it is known (tool_calls.ToolStream): one delta.
        args = d.call.arguments
        out.append(self.event("response.function_call_arguments.delta", **where, delta=args))
        out.append(self.event("response.function_call_arguments.done", **where, arguments=args))
        item |= {"arguments": args, "status": "completed"}
        out.append(self.event("response.output_item.done", output_index=index, item=_copy(item)))
        return out

    def close(self) -> list[Event]:
        """End the open message or reasoning item, if any."""
        if self._open is None:
            return []
        item, index = self.output[-1], len(self.output) - 1
        text = "".join(self._pieces)
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        out: list[Event] = []
        if self._open == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            out.append(self.event("response.output_text.done", **where, text=text, logprobs=[]))
        else:
            part = {"type": "reasoning_text", "text": text}
            out.append(self.event("response.reasoning_text.done", **where, text=text))
        out.append(self.event("response.content_part.done", **where, part=part))
        item |= {"content": [part], "status": "completed"}
        out.append(self.event("response.output_item.done", output_index=index, item=_copy(item)))
        self._open, self._pieces = None, []
        return out

    def turn(self) -> dict[str, Any]:
        """The output as the assistant turn a later request's history holds."""
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.output:
            if item["type"] == "message":
                msg["content"] += item["content"][0]["text"] if item["content"] else ""
            elif item["type"] == "reasoning":
                msg["reasoning_content"] = item["content"][0]["text"] if item["content"] else ""
            else:
                call = {"id": template_call_id(item["call_id"]), "type": "function"}
                call["function"] = {"name": item["name"], "arguments": item["arguments"]}
                msg.setdefault("tool_calls", []).append(call)
        return msg


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))
