"""The playground page, ``/health`` and ``/metrics``."""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse

from monokernel.serve.state import get_state

router = APIRouter()


@cache
def _playground_html() -> str:
    return resources.files("monokernel.serve").joinpath("static/playground.html").read_text()


@router.get("/", response_class=HTMLResponse)
async def playground() -> HTMLResponse:
    return HTMLResponse(_playground_html())


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = get_state(request)
    failure = state.engine_failure()
    if failure is not None:  # the process is about to exit non-zero: restart it
        return JSONResponse({"status": "failed", "error": failure}, status_code=503)
    if state.draining:  # so that a load balancer stops sending here
        return JSONResponse({"status": "shutting_down"}, status_code=503)
    if state.engine is not None:
        return JSONResponse({"status": "ok", "model": state.settings.served_model_name})
    if state.load_error is not None:
        return JSONResponse({"status": "error", "error": state.load_error}, status_code=503)
    return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> PlainTextResponse:
    state = get_state(request)
    text = state.metrics.render(state.scheduler.waiting, state.scheduler.running)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")
