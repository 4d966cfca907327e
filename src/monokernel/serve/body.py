"""Request bodies: JSON whatever the Content-Type (``curl -d`` sends a form type), then
the pydantic model, with pydantic's error list turned into one sentence naming the field.

Any body that is not a JSON object of the right shape (undecodable, nested past
``MAX_JSON_DEPTH``, the wrong types) is a 400 in OpenAI's shape, never a 500.
"""

from __future__ import annotations

import json
import reprlib
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from monokernel.serve.errors import APIError, bad_request

M = TypeVar("M", bound=BaseModel)

# No request this server takes nests deeper than ~6 levels; 32 leaves room for clients
# that send extra structure, and stays far from Python's recursion limit in everything
# that walks the value later (pydantic, repr, the chat template, json.dumps).
MAX_JSON_DEPTH = 32
# Echoed values are cut to this many characters: an error must not repeat a 16 MiB prompt.
MAX_ECHO_CHARS = 100

# Union members add their type to pydantic's error path (prompt.str, prompt.list[int]).
_TYPE_NAMES = {
    "str",
    "int",
    "float",
    "bool",
    "list",
    "dict",
    "none",
    "TextPart",
    "StreamOptions",
    "constrained-str",
}

_echo = reprlib.Repr()
_echo.maxstring = MAX_ECHO_CHARS
_echo.maxother = MAX_ECHO_CHARS
_echo.maxlong = 40
_echo.maxlevel = 3


def clip(text: str) -> str:
    return text if len(text) <= MAX_ECHO_CHARS else text[: MAX_ECHO_CHARS - 3] + "..."


def unknown_field(name: str) -> APIError:
    """OpenAI's refusal of a field it does not know, naming it."""
    return bad_request(
        f"unrecognized request argument supplied: {clip(name)}", name, "unknown_field"
    )


def refuse_unknown_keys(obj: dict[str, Any], known: frozenset[str], where: str) -> None:
    """Refuse the first key of ``obj`` (found at ``where``) that is not in ``known``."""
    for key in obj:
        if key not in known:
            raise unknown_field(f"{where}.{key}")


def echo(value: Any) -> str:
    """``repr`` for error messages, bounded in length and depth whatever the value."""
    return clip(_echo.repr(value))


def json_depth_exceeds(data: Any, limit: int) -> bool:
    """Whether containers nest deeper than ``limit``; iterative, so depth cannot hurt it."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def load_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or APIError(400) in OpenAI's shape for anything else."""
    problem: str | None = None
    data: Any = None
    try:
        data = json.loads(raw)
    except RecursionError:
        problem = f"the request body nests deeper than {MAX_JSON_DEPTH} levels"
    except ValueError as e:  # also UnicodeDecodeError, and ints past 4,300 digits
        problem = f"the request body is not valid JSON ({clip(str(e))})"
    if problem is not None:
        raise APIError(400, problem, code="invalid_json")
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_value")
    # Counting brackets is C-speed and clears every ordinary body without a walk.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and json_depth_exceeds(
        data, MAX_JSON_DEPTH
    ):
        raise APIError(
            400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
        )
    return data


async def parse_body(request: Request, model: type[M]) -> M:
    return validate(load_json_object(await request.body()), model)


def validate(data: dict[str, Any], model: type[M]) -> M:
    """The pydantic model of a JSON object, or APIError(400) naming the field."""
    errors: list[Any] = []
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
    del data
    message, param = validation_message(errors)
    del errors  # they hold the offending value, perhaps the whole prompt
    raise APIError(400, message, param, "invalid_value")


def validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """One readable sentence (and the field) from pydantic's error list."""
    if not errors:
        return "the request body is invalid", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON ({detail})", None
    if not loc:
        return f"the request body must be a JSON object ({first.get('msg', '')})", None
    field = ".".join(p for p in loc if "[" not in p and p not in _TYPE_NAMES)
    if first.get("type") == "missing":
        return f"{field} is required", field
    if first.get("type") == "extra_forbidden":
        return f"unrecognized request argument supplied: {clip(field)}", field
    return f"{field}: {first.get('msg', 'invalid value')} (got {echo(first.get('input'))})", field
