"""The FastAPI app factory: routes, error handlers, middlewares and background loading."""

from __future__ import annotations

import logging
import traceback
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from monokernel.runtime.engine import Engine
from monokernel.serve import (
    routes_anthropic,
    routes_misc,
    routes_openai,
    routes_responses,
    routes_tokens,
)
from monokernel.serve.body import clip, validation_message
from monokernel.serve.errors import APIError, error_body_for
from monokernel.serve.limits import ApiKeyMiddleware, BodyLimitMiddleware
from monokernel.serve.settings import ServerSettings
from monokernel.serve.state import ServerState, get_state

log = logging.getLogger("monokernel.serve")


def create_app(
    settings: ServerSettings,
    load_engine: Callable[[], Engine],
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """``load_engine`` runs on a background thread once the server is up; until it
    returns, /health answers 503 and generation requests 503 with Retry-After."""
    state = ServerState(settings, load_engine, on_load_error)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start_loading()
        yield
        # The engine itself is not closed here: whoever built it owns it (the CLI does).
        state.engine_thread.shutdown(wait=False)
        state.tokenize_thread.shutdown(wait=False)

    app = FastAPI(title="monokernel", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.monokernel = state
    app.include_router(routes_openai.router)
    app.include_router(routes_anthropic.router)
    app.include_router(routes_responses.router)
    app.include_router(routes_misc.router)
    app.include_router(routes_tokens.router)
    _install_error_handlers(app)
    # Added last = outermost: the key is checked before a byte of the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    if settings.allowed_origins:
        # Outside the key check: a browser's preflight carries no credentials, and a 401
        # without CORS headers would reach the page as an opaque network error.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["Retry-After"],
            max_age=600,
        )
    return app


def _reply(
    request: Request, status: int, body: dict[str, Any], headers: dict[str, str] | None
) -> JSONResponse:
    get_state(request).metrics.reject(status)
    return JSONResponse(body, status_code=status, headers=headers)


def release_frames(error: BaseException) -> None:
    """Drop the locals of the finished frames an error's tracebacks hold.

    ``raise X from e`` inside ``except ... as e`` in a plain function leaves a cycle (the
    frame holds ``e``, whose traceback holds the frame) that keeps the frame's locals, a
    request and its prompt among them, until the cyclic GC runs, and big strings do not
    prompt it to. Frames still running (this handler's callers) are left alone.
    """
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        release_frames(e)
        return _reply(request, e.status, e.body_for(request.url.path), e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(e.errors()))
        release_frames(e)
        body = error_body_for(request.url.path, 400, message, param, "invalid_value")
        return _reply(request, 400, body, None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = e.detail if isinstance(e.detail, str) else str(e.detail)
        if e.status_code == 404:
            message = f"no route {request.method} {clip(request.url.path)}"
        body = error_body_for(request.url.path, e.status_code, message)
        return _reply(request, e.status_code, body, e.headers)

    @app.exception_handler(Exception)
    async def crash(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        message = f"internal error: {type(e).__name__}: {clip(str(e))}"
        body = error_body_for(request.url.path, 500, message)
        release_frames(e)
        return _reply(request, 500, body, None)
