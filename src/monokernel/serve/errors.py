"""Errors in the OpenAI shape, ``{"error": {"message", "type", "param", "code"}}``, and on
the Anthropic routes (``/v1/messages``) in Anthropic's, ``{"type": "error", "error":
{"type", "message"}}``: each client reads only its own API's shape."""

from __future__ import annotations

from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "server_error",
}


class APIError(Exception):
    """Raised anywhere in a request; the app turns it into an OpenAI-style JSON error."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def body_for(self, path: str) -> dict[str, Any]:
        return error_body_for(path, self.status, self.message, self.param, self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 naming the field (``param``) it is about."""
    return APIError(400, message, param=param, code=code)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# Anthropic's error types by status. 503 (queue full, loading, shutting down) is
# "overloaded_error", which Anthropic sends with its own 529; the status stays 503 so that
# Retry-After and the OpenAI routes' behaviour are the same.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
ANTHROPIC_PREFIX = "/v1/messages"


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body_for(
    path: str, status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The error in the shape of the API that ``path`` belongs to. Anthropic's shape has no
    ``param``: its messages name the field themselves."""
    if is_anthropic_path(path):
        return anthropic_error_body(status, message)
    return error_body(status, message, param, code)
