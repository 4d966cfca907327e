"""ASGI middlewares that guard the routes: the API key and the body-size limit.

Both are plain ASGI (not BaseHTTPMiddleware) so streaming responses and disconnect
messages pass through untouched.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import hmac
import json
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from monokernel.serve.errors import error_body_for


async def send_error(
    scope: Scope,
    send: Send,
    status: int,
    message: str,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> None:
    state = getattr(getattr(scope.get("app"), "state", None), "monokernel", None)
    if state is not None:  # counted like the refusals the routes make
        state.metrics.reject(status)
    body = json.dumps(error_body_for(scope.get("path", ""), status, message, None, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def bearer_token(header: str | None) -> bytes:
    """The credentials of ``Authorization: Bearer X``; the scheme name is
    case-insensitive (RFC 9110), so ``bearer X`` counts too."""
    scheme, _, token = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return b""
    return token.strip().encode("latin-1")


# Paths outside /v1 that are API calls all the same (vLLM's), so they need the key too.
_KEYED_PATHS = ("/tokenize", "/detokenize")


class ApiKeyMiddleware:
    """``Authorization: Bearer KEY`` (OpenAI's clients) or ``x-api-key: KEY`` (Anthropic's)
    on /v1/*, /tokenize and /detokenize; the page, /health and /metrics stay open."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1") or path in _KEYED_PATHS):
            header = _header(scope, b"authorization")
            x_api_key = _header(scope, b"x-api-key")
            # Either header may carry the key: Anthropic's client sends both when both its
            # key and its auth token are configured, and one of them may be meant elsewhere.
            given = [bearer_token(header)]
            if x_api_key is not None:
                given.append(x_api_key.strip().encode("latin-1"))
            if not any(hmac.compare_digest(g, self.expected) for g in given):
                message = (
                    "missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
                    if not header and x_api_key is None
                    else "incorrect API key"
                )
                await send_error(
                    scope, send, 401, message, "invalid_api_key", {"WWW-Authenticate": "Bearer"}
                )
                return
        await self.app(scope, receive, send)


# Bodies at least this big are followed by a malloc_trim once their request is over.
TRIM_AFTER_BYTES = 1 << 20


def _find_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim  # glibc only
    except (OSError, AttributeError, TypeError):
        return None
    return trim


_malloc_trim = _find_malloc_trim()


async def give_memory_back() -> None:
    """Return freed heap to the OS. glibc raises its mmap threshold after a big block is
    freed, so later multi-MiB bodies land on the heap and their pages stay in the
    process after the request; trimming after each big body keeps RSS where it was."""
    if _malloc_trim is not None:
        await asyncio.to_thread(_malloc_trim, 0)


class BodyLimitMiddleware:
    """Refuse bodies over ``max_bytes`` with 413, whether or not Content-Length is sent.

    Request bodies are small JSON, so the body is read here in full (up to the limit) and
    replayed to the app; later ``receive`` calls go to the server, so the routes still see
    the client's disconnect.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        too_big = (
            f"the request body is over the limit of {self.max_bytes} bytes "
            "(the server's --max-body-bytes)"
        )
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await send_error(scope, send, 413, too_big, "request_too_large")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                chunks.clear()
                await send_error(scope, send, 413, too_big, "request_too_large")
                await give_memory_back()
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                body: dict[str, Any] = {"type": "http.request", "body": b"".join(chunks)}
                chunks.clear()  # the app holds the joined copy; do not keep two
                return body | {"more_body": False}
            return await receive()

        try:
            await self.app(scope, replay, send)
        finally:
            chunks.clear()
            if size >= TRIM_AFTER_BYTES:
                await give_memory_back()
