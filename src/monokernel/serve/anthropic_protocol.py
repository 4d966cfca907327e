"""The Anthropic Messages wire format: request bodies, their conversion to the chat request
the OpenAI route serves, and the response, content blocks and stream events built back.

An Anthropic request becomes a ``ChatCompletionRequest`` (``system`` a system message,
``tool_use`` blocks assistant ``tool_calls``, ``tool_result`` blocks ``tool`` messages,
``tools`` function tools), so it is checked, rendered through the model's chat template,
queued and generated exactly as a chat request is. Everything Anthropic-specific is
checked here first, so each refusal names the field as the client wrote it
(``messages[2].content[0].tool_use_id``). A reasoning model's reasoning comes back as
thinking blocks, and earlier replies' thinking blocks go back to the template as the turn's
``reasoning_content``. ``tool_choice`` ``any`` and ``tool`` become the chat route's
``"required"`` and named function, which constrained decoding enforces (serve/structured.py;
refused where the engine cannot run it). What cannot be honoured (images, documents, a
thinking budget, server tools, prefilled replies) is refused, never dropped.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import string
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.datastructures import Headers

from monokernel.serve.body import clip, echo, refuse_unknown_keys, validate
from monokernel.serve.errors import APIError
from monokernel.serve.protocol import ChatCompletionRequest
from monokernel.serve.tool_calls import ContentDelta, Delta, ReasoningDelta
from monokernel.serve.tools import TOOL_NAME

_ALNUM = string.ascii_letters + string.digits
# Blocks a client may send that this server cannot read, and why.
_REFUSED_BLOCKS = {
    "image": "images are not supported: the served model reads text only",
    "document": "documents are not supported: send their text in a text block",
    "search_result": "search_result blocks are not supported: send their text in a text block",
    "thinking": "thinking blocks are only taken in assistant messages (the model's reasoning)",
    "redacted_thinking": "redacted_thinking blocks are not supported: this server never "
    "writes them, and cannot read one",
    "server_tool_use": "server tools are not supported: only client tools run here",
    "web_search_tool_result": "server tools are not supported: only client tools run here",
    "container_upload": "container uploads are not supported",
}
_TEXT_KEYS = frozenset({"type", "text", "cache_control", "citations"})
_TOOL_USE_KEYS = frozenset({"type", "id", "name", "input", "cache_control"})
_TOOL_RESULT_KEYS = frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"})
_THINKING_KEYS = frozenset({"type", "thinking", "signature"})
_TOOL_KEYS = frozenset({"type", "name", "description", "input_schema", "cache_control"})


def bad(message: str) -> APIError:
    return APIError(400, message)


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: str
    # Blocks are judged one by one below, so each refusal can name its path.
    content: str | list[dict[str, Any]]


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: the prompt half of a Messages request."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    thinking: Any = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # Hints that never change the output: checked for shape, then not used.
    metadata: Any = None
    service_tier: str | None = None


def check_version(headers: Headers) -> None:
    """``anthropic-version`` may be any version string (one server speaks one version of
    the API) but not an empty one, which only a broken client sends. It is optional, so
    that curl users need not send it."""
    version = headers.get("anthropic-version")
    if version is not None and not version.strip():
        raise bad("the anthropic-version header is empty; send a version such as 2023-06-01")


# ---- request -> chat request -------------------------------------------------------------


def template_call_id(client_id: str) -> str:
    """The id a tool call has in the prompt: 9 letters or digits, the shape Mistral's
    templates demand (they refuse ``toolu_…``), from a hash so every turn of a
    conversation renders the same id (and so keeps its reused prefix)."""
    n = int.from_bytes(hashlib.sha256(client_id.encode()).digest()[:8], "big")
    chars = []
    for _ in range(9):
        n, r = divmod(n, len(_ALNUM))
        chars.append(_ALNUM[r])
    return "".join(chars)


def to_chat(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request this Anthropic request means; raises APIError(400) naming the
    field for what it cannot mean."""
    if not body.messages:
        raise bad("messages must hold at least one message")
    if body.messages[-1].role == "assistant":
        raise bad(
            "the last message is the assistant's: prefilling the reply is not supported; "
            "end with a user message"
        )
    thinking_off = _check_thinking(body.thinking)
    messages: list[dict[str, Any]] = []
    if body.system is not None:
        messages.append({"role": "system", "content": _system_text(body.system)})
    calls: dict[str, str] = {}  # tool_use id -> the tool's name
    for i, m in enumerate(body.messages):
        messages += _message(m, i, calls)
    tools, choice, parallel = _tools(body.tools, body.tool_choice)
    fields: dict[str, Any] = {"model": body.model, "messages": messages}
    if thinking_off:
        # Qwen3's switch (other templates do not read it): Anthropic's default is to not think.
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    if tools is not None:
        fields |= {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}
    if isinstance(body, MessagesRequest):
        _check_sampling(body)
        fields |= {"max_tokens": body.max_tokens, "stream": body.stream}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(body, name) is not None:
                fields[name] = getattr(body, name)
        if body.stop_sequences:
            fields["stop"] = body.stop_sequences
    return validate(fields, ChatCompletionRequest)


def _check_thinking(thinking: Any) -> bool:
    """Whether the request turns thinking off. ``enabled`` is refused: its
    ``budget_tokens`` cannot be enforced (without a ``thinking`` field a model whose template
    thinks does, and its reasoning comes back as thinking blocks)."""
    if thinking is None:
        return False
    if thinking == {"type": "disabled"}:
        return True
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        raise bad(
            "thinking {'type': 'enabled'} (extended thinking with a token budget) is not "
            "supported by this server: a reasoning model thinks by its chat template's "
            "default, and its reasoning comes back as thinking blocks; omit thinking, or "
            "send {'type': 'disabled'} to ask the template not to think"
        )
    raise bad(f"thinking must be {{'type': 'enabled' | 'disabled', ...}}, got {echo(thinking)}")


def _check_sampling(body: MessagesRequest) -> None:
    # Anthropic's ranges, narrower than OpenAI's (checked again by params.check_request).
    t = body.temperature
    if t is not None and not 0 <= t <= 1:  # also refuses NaN
        raise bad(f"temperature must be in [0, 1], got {echo(t)}")
    if body.top_k is not None and body.top_k < 0:
        raise bad(f"top_k must be an integer >= 0 (0 turns it off), got {echo(body.top_k)}")
    for i, stop in enumerate(body.stop_sequences or ()):
        if not stop:
            raise bad(f"stop_sequences[{i}] is empty; each stop sequence must be non-empty")
    meta = body.metadata
    if meta is not None:
        if not isinstance(meta, dict) or set(meta) - {"user_id"}:
            raise bad(f"metadata may only hold user_id, got {echo(meta)}")
        if not isinstance(meta.get("user_id"), (str, type(None))):
            raise bad("metadata.user_id must be a string or null")
    if body.service_tier not in (None, "auto", "standard_only"):
        raise bad(f"service_tier must be 'auto' or 'standard_only', got {echo(body.service_tier)}")


def _check_cache_control(block: dict[str, Any], where: str) -> None:
    """Prompt-caching breakpoints: a hint (the prefix cache reuses whatever it can), so
    taken when well-formed and not used."""
    cc = block.get("cache_control")
    if cc is None:
        return
    if not isinstance(cc, dict) or cc.get("type") != "ephemeral" or set(cc) - {"type", "ttl"}:
        raise bad(f"{where}.cache_control must be {{'type': 'ephemeral'}}, got {echo(cc)}")


def _text(block: Any, where: str) -> str:
    """A text block's text; any other block is refused, saying why."""
    if not isinstance(block, dict):
        raise bad(f"{where} must be a content block object, got {echo(block)}")
    kind = block.get("type")
    if kind != "text":
        reason = _REFUSED_BLOCKS.get(kind) if isinstance(kind, str) else None
        if reason is not None:
            raise bad(f"{where} has type {kind!r}: {reason}")
        raise bad(f"{where} must be a text block, got type {echo(kind)}")
    refuse_unknown_keys(block, _TEXT_KEYS, where)
    _check_cache_control(block, where)
    if not isinstance(block.get("text"), str):
        raise bad(f"{where}.text must be a string")
    if block.get("citations") not in (None, []):
        raise bad(f"{where}.citations are not supported")
    return str(block["text"])


def _join(texts: Iterable[str]) -> str:
    # Blocks of one message are joined by a newline, as vLLM joins text parts for
    # templates that take a string: glued, the end of one would run into the next.
    return "\n".join(texts)


def _system_text(system: str | list[dict[str, Any]]) -> str:
    if isinstance(system, str):
        return system
    return _join(_text(b, f"system[{i}]") for i, b in enumerate(system))


def _message(m: AnthropicMessage, i: int, calls: dict[str, str]) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (a user turn with tool results is several)."""
    where = f"messages[{i}]"
    if m.role not in ("user", "assistant"):
        raise bad(
            f"{where}.role is {echo(m.role)}; expected 'user' or 'assistant' (the system "
            "prompt goes in the top-level system field)"
        )
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    if m.role == "assistant":
        return [_assistant(m.content, where, calls)]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(m.content):
        at = f"{where}.content[{j}]"
        if isinstance(block, dict) and block.get("type") == "tool_result":
            if texts:  # text before a result stays before it
                out.append({"role": "user", "content": _join(texts)})
                texts = []
            out.append(_tool_result(block, at, calls))
        elif isinstance(block, dict) and block.get("type") == "tool_use":
            raise bad(f"{at} is a tool_use block, which only assistant messages may hold")
        else:
            texts.append(_text(block, at))
    if texts or not out:
        out.append({"role": "user", "content": _join(texts)})
    return out


def _assistant(blocks: list[dict[str, Any]], where: str, calls: dict[str, str]) -> dict[str, Any]:
    texts: list[str] = []
    thoughts: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if isinstance(block, dict) and block.get("type") == "tool_use":
            tool_calls.append(_tool_use(block, at, calls))
        elif isinstance(block, dict) and block.get("type") == "thinking":
            thoughts.append(_thinking(block, at))
        elif isinstance(block, dict) and block.get("type") == "tool_result":
            raise bad(f"{at} is a tool_result block, which only user messages may hold")
        else:
            texts.append(_text(block, at))
    msg: dict[str, Any] = {"role": "assistant", "content": _join(texts)}
    if thoughts:
        # Where thinking templates (Qwen3's) read a turn's reasoning back.
        msg["reasoning_content"] = _join(thoughts)
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def _thinking(block: dict[str, Any], where: str) -> str:
    """A thinking block of an earlier reply (agents send the whole reply back). Its
    signature is not checked: this server writes an empty one and signs nothing."""
    refuse_unknown_keys(block, _THINKING_KEYS, where)
    if not isinstance(block.get("thinking"), str):
        raise bad(f"{where}.thinking must be a string")
    if not isinstance(block.get("signature", ""), str):
        raise bad(f"{where}.signature must be a string")
    return str(block["thinking"])


def _tool_use(block: dict[str, Any], where: str, calls: dict[str, str]) -> dict[str, Any]:
    refuse_unknown_keys(block, _TOOL_USE_KEYS, where)
    _check_cache_control(block, where)
    call_id, name, args = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id:
        raise bad(f"{where}.id must be a non-empty string")
    if call_id in calls:
        raise bad(f"{where}.id {call_id!r} is used by an earlier tool_use block")
    if not isinstance(name, str) or not name:
        raise bad(f"{where}.name must be a non-empty string")
    if not isinstance(args, dict):
        raise bad(f"{where}.input must be an object, got {echo(args)}")
    calls[call_id] = name
    # The chat history's shape: arguments as a JSON string (decoded again for the template).
    function = {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}
    return {"id": template_call_id(call_id), "type": "function", "function": function}


def _tool_result(block: dict[str, Any], where: str, calls: dict[str, str]) -> dict[str, Any]:
    refuse_unknown_keys(block, _TOOL_RESULT_KEYS, where)
    _check_cache_control(block, where)
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise bad(f"{where}.tool_use_id must be a string")
    if call_id not in calls:
        raise bad(
            f"{where}.tool_use_id {clip(call_id)!r} matches no tool_use block of an earlier "
            "assistant message"
        )
    content = block.get("content", "")
    if isinstance(content, list):
        content = _join(_text(b, f"{where}.content[{k}]") for k, b in enumerate(content))
    elif not isinstance(content, str):
        raise bad(f"{where}.content must be a string or a list of text blocks")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise bad(f"{where}.is_error must be a boolean")
    if is_error:
        # Chat templates have no field for a failed call: the model reads it in the text.
        content = f"Error: {content}"
    # `name` as well as the id: some templates print the tool's name with its result.
    return {
        "role": "tool",
        "tool_call_id": template_call_id(call_id),
        "name": calls[call_id],
        "content": content,
    }


def _tools(tools: list[Any] | None, choice: Any) -> tuple[list[dict[str, Any]] | None, Any, bool]:
    """OpenAI function tools, tool_choice and parallel_tool_calls for Anthropic's."""
    names: list[str] = []
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(f"{where} must be an object, got {echo(tool)}")
        kind = tool.get("type", "custom")
        if kind not in (None, "custom"):
            raise bad(
                f"{where}.type is {echo(kind)}; Anthropic's server tools (web search, bash, "
                "text editor, computer use...) are not supported, only custom tools "
                "(name, description, input_schema)"
            )
        refuse_unknown_keys(tool, _TOOL_KEYS, where)
        _check_cache_control(tool, where)
        name = tool.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad(f"{where}.name must be 1 to 64 letters, digits, '_' or '-', got {echo(name)}")
        if name in names:
            raise bad(f"{where}.name {name!r} is given twice")
        names.append(name)
        schema = tool.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise bad(
                f"{where}.input_schema is required and must be a JSON Schema object "
                f"(type 'object'), got {echo(schema)}"
            )
        function: dict[str, Any] = {"name": name, "parameters": schema}
        description = tool.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise bad(f"{where}.description must be a string")
            function["description"] = description
        out.append({"type": "function", "function": function})
    mode, parallel = _choice(choice, names)
    return (out or None), mode, parallel


def _choice(choice: Any, names: list[str]) -> tuple[Any, bool]:
    """Chat's tool_choice and parallel_tool_calls for Anthropic's tool_choice: ``auto`` and
    ``none`` are chat's own; ``any`` is ``"required"`` (a call to any of the tools) and
    ``tool`` names the function, both forced by constrained decoding (the chat route
    refuses them on an engine that cannot run it). ``disable_parallel_tool_use`` is
    ``parallel_tool_calls: false``: one call at most under ``auto``, exactly one under
    ``any`` (a named tool is always called once)."""
    if choice is None:
        return None, True
    kind = choice.get("type") if isinstance(choice, dict) else None
    keys = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    if kind not in ("auto", "any", "tool", "none") or set(choice) - keys:
        raise bad(
            "tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', "
            f"'name': ...}} (with disable_parallel_tool_use), got {echo(choice)}"
        )
    disable = choice.get("disable_parallel_tool_use", False)
    if not isinstance(disable, bool):
        raise bad("tool_choice.disable_parallel_tool_use must be a boolean")
    if kind in ("auto", "none"):
        return kind, not disable
    if not names:
        raise bad(f"tool_choice type {kind!r} needs tools; none were given")
    if kind == "any":
        return "required", not disable
    name = choice.get("name")
    if name not in names:
        raise bad(f"tool_choice names {echo(name)}, which is not in tools")
    return {"type": "function", "function": {"name": name}}, not disable


# ---- responses ---------------------------------------------------------------------------


def _random_id(prefix: str) -> str:
    return prefix + "".join(secrets.choice(_ALNUM) for _ in range(24))


def new_message_id() -> str:
    return _random_id("msg_")


def new_tool_use_id() -> str:
    return _random_id("toolu_")


def usage_json(prompt_n: int, output_n: int, cached: int) -> dict[str, int]:
    """Anthropic counts the prompt in parts that add up to it: ``input_tokens`` are those
    prefilled, ``cache_read_input_tokens`` those the prefix cache supplied. Nothing is ever
    written to a cache on request, so ``cache_creation_input_tokens`` is 0."""
    return {
        "input_tokens": prompt_n - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_n,
    }


def message_json(
    mid: str,
    model: str,
    content: list[dict[str, Any]],
    stop_reason: str | None,
    stop_sequence: str | None,
    usage: dict[str, int],
) -> dict[str, Any]:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage,
    }


def stop_reason(finish: str, called: bool, stop_sequence: str | None) -> str:
    # A reply cut by the token limit is "max_tokens" even after a call (its last call may
    # be the one that was cut), as the chat route keeps "length". After a call the reply
    # is "tool_use" even when a stop sequence ended it: agents run the tools on that.
    if finish == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "end_turn" if stop_sequence is None else "stop_sequence"


Event = tuple[str, dict[str, Any]]


class Blocks:
    """Thinking, text and tool-call deltas, in order, into content blocks, with the stream
    events that build them: consecutive reasoning is one thinking block, consecutive text
    one text block, each call a tool_use block. The whole response is built by the same
    class from the same deltas, so the two agree."""

    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []
        self._open: str | None = None  # the kind of the open block: "text" or "thinking"
        self._pieces: list[str] = []

    def add(self, delta: Delta) -> list[Event]:
        if isinstance(delta, ContentDelta):
            return self.text(delta.text)
        if isinstance(delta, ReasoningDelta):
            return self._piece("thinking", delta.text)
        return self.tool_use(delta.call.name, delta.call.arguments)

    def text(self, text: str) -> list[Event]:
        return self._piece("text", text)

    def _piece(self, kind: str, text: str) -> list[Event]:
        if not text:
            return []
        out: list[Event] = []
        if self._open != kind:
            out += self.close()
            self._open, self._pieces = kind, []
            # Reasoning here is the model's own text, not Anthropic's signed thinking: there is
            # nothing to sign, so the signature is empty (the field is required by clients).
            start = {"type": "text", "text": ""}
            if kind == "thinking":
                start = {"type": "thinking", "thinking": "", "signature": ""}
            self.content.append(dict(start))
            out.append(_start(len(self.content) - 1, start))
        self._pieces.append(text)
        delta = {"type": f"{kind}_delta", kind: text}
        index = len(self.content) - 1
        out.append(("content_block_delta", _block(index, "content_block_delta", delta=delta)))
        return out

    def tool_use(self, name: str, arguments: str) -> list[Event]:
        out = self.close()
        index = len(self.content)
        call_id = new_tool_use_id()
        self.content.append(
            {"type": "tool_use", "id": call_id, "name": name, "input": json.loads(arguments)}
        )
        # The call is whole by the time it is known (tool_calls.ToolStream), so its input
        # goes out in one delta.
        out.append(_start(index, {"type": "tool_use", "id": call_id, "name": name, "input": {}}))
        delta = {"type": "input_json_delta", "partial_json": arguments}
        out.append(("content_block_delta", _block(index, "content_block_delta", delta=delta)))
        out.append(("content_block_stop", _block(index, "content_block_stop")))
        return out

    def close(self) -> list[Event]:
        """End the open text or thinking block, if any."""
        if self._open is None:
            return []
        index = len(self.content) - 1
        self.content[index][self._open] = "".join(self._pieces)
        self._open, self._pieces = None, []
        return [("content_block_stop", _block(index, "content_block_stop"))]


def _block(index: int, kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "index": index, **fields}


def _start(index: int, block: dict[str, Any]) -> Event:
    return ("content_block_start", _block(index, "content_block_start", content_block=block))
