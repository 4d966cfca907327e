"""The request side of tool calling: ``tools``/``tool_choice``/``parallel_tool_calls``
checked strictly, tool calls in the history made what chat templates expect, the tools
rendered through the model's own template, and the output format picked for parsing.

``tool_choice`` ``"required"`` or a named function can only be honoured by constraining
decoding (the model may always answer in text otherwise): ``ToolRequest.force`` names the
functions the reply must call, and serve/structured.py turns them into a grammar of the
family's tool-call text (every engine; refused with --tp > 1).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from monokernel.serve.body import echo, refuse_unknown_keys
from monokernel.serve.errors import bad_request
from monokernel.serve.tool_calls import MARKERS, ToolStream

# OpenAI's rule for function names; the name is written into the prompt and parsed back.
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
_STRICT_AUTO = (
    "is enforced only when the call is forced (tool_choice 'required' or naming the "
    "function): with tool_choice 'auto' the model may write any arguments"
)
# The model families' own formats, for a template that names no marker of its own.
_FAMILY_FORMATS = {
    "qwen2": "hermes",
    "qwen3": "hermes",
    "llama": "llama3_json",
    "mistral": "mistral",
}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    tools: list[dict[str, Any]]  # as the template gets them
    parse: bool  # False for tool_choice "none": the output stays text
    parallel: bool
    # "auto", "none", "required" or "function" (one named function).
    choice: str = "auto"
    # The functions the reply must call (a grammar enforces it); empty when it may not.
    force: tuple[str, ...] = ()


def check_tools(
    tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> ToolRequest | None:
    """The tool fields of a chat request, or None when it has no tools (an empty list
    counts as none, as clients that always send the field send it empty)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request(
                f"tool_choice={echo(tool_choice)} needs tools; none were given", "tool_choice"
            )
        return None
    checked = [_check_tool(t, i) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad_request(f"tools[{i}].function.name {name!r} is given twice", f"tools[{i}]")
    choice, force = _check_choice(tool_choice, names)
    if choice in ("auto", "none"):
        for i, t in enumerate(tools):
            if checked_strict(t):
                where = f"tools[{i}].function.strict"
                raise bad_request(f"{where}=True {_STRICT_AUTO}", where, "unsupported")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    return ToolRequest(checked, choice != "none", parallel, choice, force)


def checked_strict(tool: dict[str, Any]) -> bool:
    """Whether a tool that passed ``_check_tool`` asks for strict arguments."""
    return bool(tool["function"].get("strict") is True)


def _check_tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise bad_request(f"{where} must be an object, got {echo(tool)}", where)
    refuse_unknown_keys(tool, _TOOL_KEYS, where)
    if tool.get("type") != "function":
        raise bad_request(
            f"{where}.type is {echo(tool.get('type'))}; only 'function' tools are supported",
            f"{where}.type",
        )
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad_request(
            f"{where}.function is required and must be an object", f"{where}.function"
        )
    refuse_unknown_keys(fn, _FUNCTION_KEYS, f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise bad_request(
            f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {echo(name)}",
            f"{where}.function.name",
        )
    out: dict[str, Any] = {"name": name}
    if "description" in fn and fn["description"] is not None:
        if not isinstance(fn["description"], str):
            raise bad_request(f"{where}.function.description must be a string", f"{where}.function")
        out["description"] = fn["description"]
    params = fn.get("parameters")
    if params is None:
        # OpenAI: "omitting parameters defines a function with an empty parameter list";
        # templates print the schema, so they get that list rather than null.
        params = {"type": "object", "properties": {}}
    elif not isinstance(params, dict) or params.get("type", "object") != "object":
        raise bad_request(
            f"{where}.function.parameters must be a JSON Schema object (type 'object'), got "
            f"{echo(params)}",
            f"{where}.function.parameters",
        )
    out["parameters"] = params
    strict = fn.get("strict")
    if strict not in (None, False, True):
        raise bad_request(f"{where}.function.strict must be a boolean", f"{where}.function.strict")
    return {"type": "function", "function": out}


def _check_choice(choice: Any, names: list[str]) -> tuple[str, tuple[str, ...]]:
    """The choice's kind and the functions it forces a call to."""
    if choice is None or choice == "auto":
        return "auto", ()
    if choice == "none":
        return "none", ()
    if choice == "required":
        return "required", tuple(names)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        shaped = set(choice) == {"type", "function"} and choice["type"] == "function"
        if not shaped or not isinstance(name, str) or set(fn) != {"name"}:
            raise bad_request(
                "tool_choice must be 'none', 'auto', 'required' or "
                f"{{'type': 'function', 'function': {{'name': ...}}}}, got {echo(choice)}",
                "tool_choice",
            )
        if name not in names:
            raise bad_request(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        return "function", (name,)
    raise bad_request(
        f"tool_choice must be 'none', 'auto', 'required' or a function, got {echo(choice)}",
        "tool_choice",
    )


# ---- the history -------------------------------------------------------------------------


def history_message(msg: dict[str, Any], i: int) -> dict[str, Any]:
    """One message of the history as templates take it: assistant tool calls with their
    arguments as an object (templates print them with ``tojson``, which would quote a
    string again), tool results with the id of their call."""
    where = f"messages[{i}]"
    calls = msg.get("tool_calls")
    if calls is not None:
        if msg["role"] != "assistant":
            raise bad_request(f"{where}.tool_calls is only allowed on assistant messages", where)
        if not isinstance(calls, list):
            raise bad_request(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        msg = msg | {
            "tool_calls": [
                _history_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)
            ]
        }
    if not isinstance(msg.get("reasoning_content", ""), str):
        # Thinking templates (Qwen3's) concatenate it into the prompt.
        raise bad_request(
            f"{where}.reasoning_content must be a string", f"{where}.reasoning_content"
        )
    if msg["role"] == "tool" and not isinstance(msg.get("tool_call_id"), str):
        raise bad_request(
            f"{where}.tool_call_id is required for role 'tool' (the id of the call it answers)",
            f"{where}.tool_call_id",
        )
    return msg


def _history_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise bad_request(f"{where} must be an object", where)
    if not isinstance(call.get("id"), str):
        raise bad_request(f"{where}.id must be a string", f"{where}.id")
    if call.get("type", "function") != "function":
        raise bad_request(f"{where}.type must be 'function'", f"{where}.type")
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"{where}.function must be an object with a name", f"{where}.function")
    args = fn.get("arguments", "{}")
    try:
        parsed = json.loads(args) if isinstance(args, str) else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise bad_request(
            f"{where}.function.arguments must be a JSON object in a string, got {echo(args)}",
            f"{where}.function.arguments",
        )
    return call | {"type": "function", "function": fn | {"arguments": parsed}}


# ---- the template ------------------------------------------------------------------------


def template_source(hf: Any, tools: list[dict[str, Any]] | None) -> str:
    """The template this tokenizer applies (a tokenizer may keep a separate one for tools)."""
    try:
        return str(hf.get_chat_template(None, tools))
    except (ValueError, TypeError, AttributeError):
        return ""


def render(
    hf: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``messages`` with ``tools`` through the model's template; raises
    APIError(400) when the template does not take tools. ``kwargs`` are the request's
    ``chat_template_kwargs``. Blocking (tokenizer thread)."""
    source = template_source(hf, tools)
    unsupported = bad_request(
        "this model's chat template does not support tools", "tools", "unsupported"
    )
    if "tools" not in source:
        raise unsupported
    text = apply_template(hf, messages, tools, kwargs)
    # A template may name `tools` and still drop them (only for some roles, say): what it
    # renders without them tells. If that rendering fails, the template needs the tools.
    try:
        bare = apply_template(hf, messages, None, kwargs)
    except Exception:
        bare = None
    if bare == text:
        raise unsupported
    return encode_rendered(hf, text)


def apply_template(
    hf: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any] | None,
) -> str:
    """The prompt text; ``kwargs`` reach the template as variables (``enable_thinking``)."""
    extra = dict(kwargs or {})
    if tools is not None:
        extra["tools"] = tools
    return str(
        hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    )


def encode_rendered(hf: Any, text: str) -> list[int]:
    # The template already wrote BOS and the like as text.
    return list(hf(text, add_special_tokens=False)["input_ids"])


def tool_format(hf: Any, family: str, tools: list[dict[str, Any]]) -> str:
    """The format the model writes calls in: by the markers its template teaches, else by
    its family's convention."""
    source = template_source(hf, tools)
    for fmt in ("hermes", "mistral", "llama3_json"):
        if MARKERS[fmt][0] in source:
            return fmt
    if "<|start_header_id|>" in source:
        return "llama3_json"
    return _FAMILY_FORMATS.get(family, "hermes")


def marker_token_ids(hf: Any, fmt: str) -> dict[int, str]:
    """Token ids of this format's markers that decoding skips as special tokens (Mistral's
    ``[TOOL_CALLS]``, Llama's ``<|python_tag|>``), so the parser sees them again."""
    return skipped_marker_ids(hf, MARKERS[fmt])


def skipped_marker_ids(hf: Any, markers: Iterable[str]) -> dict[int, str]:
    """Token ids of ``markers`` that the tokenizer has as single tokens and decoding skips."""
    out: dict[int, str] = {}
    for marker in markers:
        try:
            ids = hf.convert_tokens_to_ids([marker])
        except (KeyError, ValueError, TypeError):
            continue
        tid = ids[0] if ids else None
        if not isinstance(tid, int) or tid < 0 or tid == getattr(hf, "unk_token_id", None):
            continue
        if hf.decode([tid], skip_special_tokens=True) == "":
            out[tid] = marker
    return out


@dataclass(frozen=True, slots=True)
class ToolParsing:
    """How one request's output is read back into tool calls."""

    fmt: str
    parallel: bool
    markers: dict[int, str]  # special-token id -> the marker text decoding dropped

    def stream(self) -> ToolStream:
        return ToolStream(self.fmt, self.parallel)

    def text(self, token_id: int | None, text: str) -> str:
        """An event's text with a skipped marker token written back. A special token
        decodes to nothing, so its event's text is empty and nothing is reordered."""
        if token_id is None:
            return text
        return self.markers.get(token_id, "") + text


def parsing_for(hf: Any, family: str, req: ToolRequest) -> ToolParsing | None:
    """None for tool_choice "none". Calls the tokenizer: run it on the tokenizer thread."""
    if not req.parse:
        return None
    fmt = tool_format(hf, family, req.tools)
    return ToolParsing(fmt, req.parallel, marker_token_ids(hf, fmt))
