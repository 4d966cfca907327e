"""Structured output on the server: the request fields that constrain the output turned
into one ``Constraint`` (runtime/constrained.py), each refusal naming its field.

- OpenAI's ``response_format``: ``{"type": "json_object"}`` or ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}}``;
- vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``) and the older ``guided_json``/``guided_regex``/``guided_choice``/
  ``guided_grammar`` it replaced;
- ``tool_choice`` ``"required"`` or a named function: a grammar for the model family's
  tool-call text, so the parser reads back a call whose arguments match the tool's schema.

Every one of them is enforced or refused, never ignored.
"""

from __future__ import annotations

import json
from typing import Any

from monokernel.runtime.constrained import (
    JSON_OPTIONS,
    Constraint,
    ConstraintError,
    unsupported_reason,
)
from monokernel.runtime.engine import Engine
from monokernel.serve.body import clip, echo, refuse_unknown_keys
from monokernel.serve.errors import APIError, bad_request
from monokernel.serve.protocol import ChatCompletionRequest, CompletionRequest
from monokernel.serve.tool_calls import MARKERS
from monokernel.serve.tools import ToolParsing, ToolRequest

# vLLM's request extras this module reads (params.check_request lets them through).
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_FIELDS = (*GUIDED_FIELDS, "structured_outputs")
_FORMAT_TYPES = ("text", "json_object", "json_schema")
_JSON_SCHEMA_KEYS = frozenset({"name", "schema", "strict", "description"})
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# structured_outputs keys accepted at the value that asks for nothing.
_STRUCTURED_NEUTRAL = frozenset({"disable_fallback", "disable_any_whitespace"})
Request = CompletionRequest | ChatCompletionRequest


def requested(req: Request) -> tuple[Constraint, str] | None:
    """The constraint the request's output fields ask for and the field that asked; None
    when they ask for none. Needs no tokenizer: checked before the request is queued."""
    found: list[tuple[Constraint, str]] = []
    fmt = _response_format(req.response_format)
    if fmt is not None:
        found.append((fmt, "response_format"))
    extras = req.model_extra or {}
    for field in GUIDED_FIELDS:
        value = extras.get(field)
        if value is not None:
            found.append((_guided(field.removeprefix("guided_"), value, field), field))
    so = extras.get("structured_outputs")
    if so is not None:
        found.append((_structured_outputs(so), "structured_outputs"))
    if len(found) > 1:
        names = ", ".join(field for _, field in found)
        raise bad_request(f"give one output constraint per request, not {names}", found[1][1])
    return found[0] if found else None


def constraint_field(req: Request) -> str | None:
    """The field that asks for constrained decoding, if one does."""
    asked = requested(req)
    if asked is not None:
        return asked[1]
    if isinstance(req, ChatCompletionRequest) and req.tools and _forces_call(req.tool_choice):
        return "tool_choice"
    return None


def _forces_call(choice: Any) -> bool:
    return choice == "required" or isinstance(choice, dict)


def _response_format(value: dict[str, Any] | None) -> Constraint | None:
    if value is None:
        return None
    kind = value.get("type")
    if kind not in _FORMAT_TYPES:
        raise bad_request(
            f"response_format.type must be one of {', '.join(_FORMAT_TYPES)}, got {echo(kind)}",
            "response_format.type",
        )
    if kind == "text":
        refuse_unknown_keys(value, frozenset({"type"}), "response_format")
        return None
    if kind == "json_object":
        refuse_unknown_keys(value, frozenset({"type"}), "response_format")
        return Constraint.json_object()
    refuse_unknown_keys(value, frozenset({"type", "json_schema"}), "response_format")
    spec = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad_request(f"{where} is required and must be an object", where)
    refuse_unknown_keys(spec, _JSON_SCHEMA_KEYS, where)
    if not isinstance(spec.get("name"), str):
        raise bad_request(f"{where}.name is required and must be a string", f"{where}.name")
    if spec.get("strict") not in (None, True, False):
        raise bad_request(f"{where}.strict must be a boolean", f"{where}.strict")
    # The schema is always enforced, strict or not: OpenAI's non-strict mode only means
    # it may not be, and enforcing it is what the client hopes for.
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise bad_request(f"{where}.schema must be a JSON Schema object", f"{where}.schema")
    return Constraint.json_schema(schema)


def _guided(kind: str, value: Any, field: str) -> Constraint:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise bad_request(f"{field} is not valid JSON: {clip(str(e))}", field) from e
        if not isinstance(value, (dict, bool)):
            raise bad_request(f"{field} must be a JSON Schema object, got {echo(value)}", field)
        return Constraint.json_schema(value)
    if kind == "json_object":
        if value is not True:
            raise bad_request(f"{field} must be true", field)
        return Constraint.json_object()
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise bad_request(f"{field} must be a non-empty string", field)
        return Constraint.regex(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise bad_request(f"{field} must be a non-empty list of strings", field)
        return Constraint.choice(value)
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"{field} must be a non-empty grammar string", field)
    return _grammar(value, field)


def _grammar(text: str, field: str) -> Constraint:
    """A Lark grammar (llguidance's dialect), or a GBNF one (llama.cpp's) converted to it."""
    if "::=" not in text:
        return Constraint.lark(text)
    from monokernel.runtime.constrained import require_llguidance

    require_llguidance()
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return Constraint.lark(any_to_lark(text))
    except Exception as e:  # the converter raises whatever its parser meets
        raise bad_request(
            f"{field}: the GBNF grammar could not be read: {clip(str(e))}", field
        ) from e


def _structured_outputs(value: Any) -> Constraint:
    where = "structured_outputs"
    if not isinstance(value, dict):
        raise bad_request(f"{where} must be an object, got {echo(value)}", where)
    refuse_unknown_keys(value, frozenset(_STRUCTURED_KEYS) | _STRUCTURED_NEUTRAL, where)
    for key in _STRUCTURED_NEUTRAL:
        if value.get(key) not in (None, False):
            raise bad_request(
                f"{where}.{key}={echo(value[key])} is not supported by this server",
                f"{where}.{key}",
                "unsupported",
            )
    given = [k for k in _STRUCTURED_KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise bad_request(
            f"{where} must set exactly one of {', '.join(_STRUCTURED_KEYS)}; got "
            f"{', '.join(given) or 'none'}",
            where,
        )
    return _guided(given[0], value[given[0]], f"{where}.{given[0]}")


# ---- tool calls ----------------------------------------------------------------------------


def tool_constraint(parsing: ToolParsing, req: ToolRequest, family: str) -> Constraint:
    """The grammar of a reply that is only tool calls, in the format the parser reads:
    one call for a named function or without ``parallel_tool_calls``, else one or more."""
    key = "parameters" if parsing.fmt == "llama3_json" else "arguments"
    # A schema inside a Lark grammar takes its options in the schema ("x-guidance").
    schema = {"anyOf": [_call_schema(t, key) for t in _forced(req)], "x-guidance": JSON_OPTIONS}
    several = req.parallel and req.choice == "required"
    if parsing.fmt == "hermes":
        call = '"<tool_call>\\n" body "\\n</tool_call>"'
        start = 'start: call ("\\n" call)*' if several else "start: call"
        return Constraint.lark(f"{start}\ncall: {call}\nbody: %json {json.dumps(schema)}\n")
    if parsing.fmt == "llama3_json":
        start = 'start: body ("; " body)*' if several else "start: body"
        return Constraint.lark(f"{start}\nbody: %json {json.dumps(schema)}\n")
    if parsing.fmt == "mistral":
        # The marker as the tokenizer's own special token where it has one (what the model
        # emits, and what the parser gets back through ToolParsing.markers), else as text.
        ids = [t for t, text in parsing.markers.items() if text == MARKERS["mistral"][0]]
        marker = f"<[{ids[0]}]>" if ids else json.dumps(MARKERS["mistral"][0])
        calls = '"[" body (", " body)* "]"' if several else '"[" body "]"'
        return Constraint.lark(f"start: {marker} {calls}\nbody: %json {json.dumps(schema)}\n")
    raise bad_request(
        f"tool_choice 'required' or a named function needs constrained decoding of this "
        f"model's tool-call format ({parsing.fmt}, family {family}), which is not implemented "
        "yet (Hermes/Qwen, Llama 3 JSON and Mistral [TOOL_CALLS] calls are); use tool_choice "
        "'auto'",
        "tool_choice",
        "unsupported",
    )


def _forced(req: ToolRequest) -> list[dict[str, Any]]:
    return [t["function"] for t in req.tools if t["function"]["name"] in req.force]


def _call_schema(fn: dict[str, Any], key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, key: fn["parameters"]},
        "required": ["name", key],
        "additionalProperties": False,
    }


# ---- the engine ----------------------------------------------------------------------------


def check_engine(engine: Engine, req: Request) -> None:
    """400 when the request asks for constrained decoding and this server's engine
    cannot run it, before the prompt is tokenised."""
    field = constraint_field(req)
    if field is None:
        return
    reason = unsupported_reason(engine.engine_name)
    if reason is not None:
        raise bad_request(f"{field}: {reason}", field, "unsupported")


def request_constraint(
    engine: Engine,
    req: Request,
    tools: ToolParsing | None,
    tool_req: ToolRequest | None,
) -> Constraint | None:
    """The request's constraint, compiled once to check it. Blocking: tokenizer thread."""
    asked = requested(req)
    if tool_req is not None and tool_req.force and tools is not None:
        if asked is not None:
            raise bad_request(
                f"{asked[1]} cannot be combined with tool_choice {echo(tool_req.choice)}: "
                "a forced tool call has its own format",
                asked[1],
            )
        asked = tool_constraint(tools, tool_req, engine.model_config.family), "tool_choice"
    if asked is None:
        return None
    compile_check(engine, *asked)
    return asked[0]


def compile_check(engine: Engine, constraint: Constraint, field: str) -> None:
    """Compile the grammar once now, so a schema llguidance refuses (or a missing
    llguidance) is a 400 before the request waits in the queue. Blocking: tokenizer
    thread."""
    try:
        engine.constraint_matcher(constraint)
    except ConstraintError as e:
        raise bad_request(f"{field}: {e}", field, "unsupported") from e
    except APIError:
        raise
