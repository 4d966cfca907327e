"""Request bodies: JSON whatever the Content-Type (``curl -d`` sends a form type), then
the pydantic model, with pydantic's error list turned into one sentence naming the field."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from monokernel.serve.errors import APIError

M = TypeVar("M", bound=BaseModel)

# Union members add their type to pydantic's error path (prompt.str, prompt.list[int]).
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart", "StreamOptions"}


async def parse_body(request: Request, model: type[M]) -> M:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from e
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_value")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = validation_message(e.errors())
        raise APIError(400, message, param, "invalid_value") from e


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
    given = repr(first.get("input"))
    given = given if len(given) <= 60 else given[:57] + "..."
    return f"{field}: {first.get('msg', 'invalid value')} (got {given})", field
