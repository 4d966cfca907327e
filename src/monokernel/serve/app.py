"""The FastAPI app factory: routes, error handlers, middlewares and background loading."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from monokernel.runtime.engine import Engine
from monokernel.serve import routes_misc, routes_openai
from monokernel.serve.body import validation_message
from monokernel.serve.errors import APIError, error_body
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

    app = FastAPI(title="monokernel", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.monokernel = state
    app.include_router(routes_openai.router)
    app.include_router(routes_misc.router)
    _install_error_handlers(app)
    # Added last = outermost: the key is checked before a byte of the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    return app


def _reply(request: Request, status: int, body: dict[str, Any], headers: dict[str, str] | None):
    get_state(request).metrics.reject(status)
    return JSONResponse(body, status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return _reply(request, e.status, e.body(), e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(e.errors()))
        return _reply(request, 400, error_body(400, message, param, "invalid_value"), None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = e.detail if isinstance(e.detail, str) else str(e.detail)
        if e.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return _reply(request, e.status_code, error_body(e.status_code, message), e.headers)

    @app.exception_handler(Exception)
    async def crash(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        body = error_body(500, f"internal error: {type(e).__name__}: {e}")
        return _reply(request, 500, body, None)
