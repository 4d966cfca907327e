"""``POST /v1/responses``: OpenAI's Responses API.

The request is made a chat request (``responses_protocol.to_chat``) and takes the chat
route's own path: the same checks, template, queue, generation (constrained for
``text.format`` and a forced call), reasoning split and tool-call parsing. Errors are in
OpenAI's shape, as on the chat route, naming this request's fields.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from monokernel.runtime.engine import TokenEvent
from monokernel.serve.body import parse_body
from monokernel.serve.errors import APIError, error_body
from monokernel.serve.generation import Generation
from monokernel.serve.protocol import ChatCompletionRequest
from monokernel.serve.reasoning import OutputParsing, OutputStream
from monokernel.serve.responses_protocol import (
    Conversation,
    Event,
    Items,
    ResponsesRequest,
    chat_error,
    new_id,
    response_json,
    to_chat,
    usage_json,
)
from monokernel.serve.routes_openai import GenerationStream, admit, collect
from monokernel.serve.state import ServerState, get_state
from monokernel.serve.tool_calls import ContentDelta

log = logging.getLogger("monokernel.serve")
router = APIRouter()


class _Call:
    """What one request needs from beginning to end."""

    def __init__(
        self,
        state: ServerState,
        req: ResponsesRequest,
        chat: ChatCompletionRequest,
        conv: Conversation,
        gen: Generation,
    ) -> None:
        self.state, self.req, self.chat, self.conv, self.gen = state, req, chat, conv, gen
        self.rid = new_id("resp")
        self.model = state.settings.served_model_name
        self.items = Items()

    def response(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        out = self.items.output
        return response_json(self.rid, self.req, self.model, self.chat, out, status, usage)

    def finish(self, final: TokenEvent, out: OutputStream | None) -> dict[str, Any]:
        assert final.timings is not None
        status = "incomplete" if final.finish_reason == "length" else "completed"
        cached = final.timings.cached_tokens or 0
        reasoning = out.reasoning_tokens if out else 0
        usage = usage_json(self.gen.prompt_n, final.timings.generated_tokens, cached, reasoning)
        if self.req.store:
            self.state.responses.put(
                self.rid, [*self.conv.messages, self.items.turn()], self.conv.calls | _ids(self)
            )
        return self.response(status, usage)


def _ids(call: _Call) -> set[str]:
    return {i["call_id"] for i in call.items.output if i["type"] == "function_call"}


@router.post("/v1/responses", response_model=None)
async def responses(request: Request) -> Response:
    req = await parse_body(request, ResponsesRequest)
    state = get_state(request)
    chat, conv = to_chat(req, state.responses)
    try:
        gen, parsing = await admit(state, chat, time.perf_counter())
    except APIError as e:
        raise chat_error(e) from None  # named as this request names the field
    call = _Call(state, req, chat, conv, gen)
    if req.stream:
        return GenerationStream(gen, _sse(call, request, parsing), state)
    text, final, _, out = await collect(state, gen, request, parsing)
    if final is None or final.timings is None or final.finish_reason == "cancelled":
        # Only reached when the client has gone: nobody reads this.
        return JSONResponse(error_body(499, "the client closed the request"), status_code=499)
    for delta in out.deltas if out else [ContentDelta(text)]:
        call.items.add(delta)
    call.items.close()
    return JSONResponse(call.finish(final, out))


def _event(ev: Event) -> bytes:
    return f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False)}\n\n".encode()


async def _sse(
    call: _Call, request: Request, parsing: OutputParsing | None
) -> AsyncIterator[bytes]:
    """response.created, response.in_progress, each item's events, then
    response.completed (or response.incomplete when max_output_tokens cut it)."""
    items = call.items
    yield _event(items.event("response.created", response=call.response("in_progress")))
    yield _event(items.event("response.in_progress", response=call.response("in_progress")))
    out = parsing.stream() if parsing else None
    try:
        async for event in call.gen.events(request):
            if out is not None and parsing is not None:
                text = parsing.text(event.token_id, event.text)
                deltas = out.feed(text, tokens=int(event.token_id is not None))
            else:
                deltas = [ContentDelta(event.text)]
            evs = [e for d in deltas for e in items.add(d)]
            if event.finish_reason is not None:
                if event.finish_reason == "cancelled" or event.timings is None:
                    return  # the client has gone
                evs += [e for d in (out.finish() if out else []) for e in items.add(d)]
                evs += items.close()
            for ev in evs:
                yield _event(ev)
            if event.finish_reason is not None:
                response = call.finish(event, out)
                kind = "response.completed"
                if response["status"] == "incomplete":
                    kind = "response.incomplete"
                yield _event(items.event(kind, response=response))
    except APIError as e:  # the server is shutting down
        yield _event(items.event("error", code=e.code, message=e.message, param=e.param))
    except Exception as e:
        # Headers are out already; report in-band so the client does not hang or guess.
        log.exception("streamed generation failed")
        message = f"generation failed: {type(e).__name__}: {e}"
        yield _event(items.event("error", code="server_error", message=message, param=None))
