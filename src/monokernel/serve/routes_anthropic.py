"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API.

The request is made a chat request (``anthropic_protocol.to_chat``) and then takes the
chat route's own path: the same checks, template rendering, queue, generation and
tool-call parsing. Errors on these paths are in Anthropic's shape (``errors.error_body_for``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from monokernel.runtime.engine import Engine, TokenEvent
from monokernel.serve import params as P
from monokernel.serve.anthropic_protocol import (
    Blocks,
    CountTokensRequest,
    Event,
    MessagesRequest,
    check_version,
    message_json,
    new_message_id,
    stop_reason,
    to_chat,
    usage_json,
)
from monokernel.serve.body import parse_body
from monokernel.serve.errors import APIError, anthropic_error_body
from monokernel.serve.generation import Generation
from monokernel.serve.reasoning import OutputParsing
from monokernel.serve.routes_openai import GenerationStream, admit, collect
from monokernel.serve.state import ServerState, get_state
from monokernel.tokenizer.detokenize import IncrementalDetokenizer
from monokernel.tokenizer.stop_strings import StopStringMatcher

log = logging.getLogger("monokernel.serve")
router = APIRouter()


@router.post("/v1/messages", response_model=None)
async def messages(request: Request) -> Response:
    check_version(request.headers)
    body = await parse_body(request, MessagesRequest)
    chat = to_chat(body)
    state = get_state(request)
    gen, parsing = await admit(state, chat, time.perf_counter())
    mid = new_message_id()
    model = state.settings.served_model_name
    stops = tuple(body.stop_sequences or ())
    if body.stream:
        return GenerationStream(gen, _sse(state, gen, request, mid, model, parsing, stops), state)
    text, final, ids, out = await collect(state, gen, request, parsing)
    if final is None or final.timings is None or final.finish_reason == "cancelled":
        # Only reached when the client has gone: nobody reads this.
        body_499 = anthropic_error_body(499, "the client closed the request")
        return JSONResponse(body_499, status_code=499)
    blocks = Blocks()
    called = False
    if out is None:
        blocks.text(text)
    else:
        # Rebuilt from the reader's record, in the order the model wrote it.
        for delta in out.deltas:
            blocks.add(delta)
        called = bool(out.calls)
    blocks.close()
    reason, sequence = await _stop(state, gen, final, ids, stops, called)
    usage = _usage(gen, final)
    return JSONResponse(message_json(mid, model, blocks.content, reason, sequence, usage))


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    """The prompt's tokens as ``/v1/messages`` would render them (template, tools)."""
    check_version(request.headers)
    chat = to_chat(await parse_body(request, CountTokensRequest))
    state = get_state(request)
    engine = state.require_engine()
    P.check_model(chat.model, state.settings.served_model_name)
    P.check_request(chat)
    P.check_prompt_size(chat, state.prompt_char_limit, engine.max_model_len)
    loop = asyncio.get_running_loop()
    tools = P.chat_tools(chat)
    ids = await loop.run_in_executor(state.tokenize_thread, P.encode_prompt, engine, chat, tools)
    return {"input_tokens": len(ids)}


def _usage(gen: Generation, final: TokenEvent) -> dict[str, int]:
    assert final.timings is not None
    # Prompt tokens the prefix cache supplied (the monokernel's prefix reuse); an engine
    # without a prefix cache reports None, and then none were.
    cached = final.timings.cached_tokens or 0
    return usage_json(gen.prompt_n, final.timings.generated_tokens, cached)


def matched_stop(
    engine: Engine, prompt_ids: Sequence[int], ids: Sequence[int], stops: Sequence[str]
) -> str | None:
    """The stop sequence that ended a generation, or None if none did (an EOS did).

    The engine reports only "stop", and cuts the stop string from the text; replaying its
    detokenizer and stop matcher over the same ids finds which stop string it saw. Only
    the tail is replayed: the stop string ended the generation, so it lies in the last
    few tokens (a character may take up to 4 byte tokens; the rest is margin), and a
    long reply costs no more than a short one. Blocking (tokenizer thread)."""
    tail = 4 * max(len(s) for s in stops) + 8
    context = [*prompt_ids[-tail:], *ids[:-tail]][-tail:]
    detok = IncrementalDetokenizer(engine.tokenizer, context)
    matcher = StopStringMatcher(stops)
    for token in ids[-tail:]:
        matcher.feed(detok.add(token))
        if matcher.stopped:
            break
    if not matcher.stopped:
        matcher.feed(detok.flush())
    if not matcher.stopped:
        return None
    # The first to appear: the earliest, and of those at one place the shortest.
    found = [(matcher.text.find(s), len(s), s) for s in matcher.stops if s in matcher.text]
    return min(found)[2] if found else None


async def _stop(
    state: ServerState,
    gen: Generation,
    final: TokenEvent,
    ids: list[int],
    stops: Sequence[str],
    called: bool,
) -> tuple[str, str | None]:
    """stop_reason and stop_sequence."""
    sequence = None
    if final.finish_reason == "stop" and stops and not called:
        loop = asyncio.get_running_loop()
        prompt = gen.prepared.prompt_ids
        sequence = await loop.run_in_executor(
            state.tokenize_thread, matched_stop, gen.engine, prompt, ids, stops
        )
    assert final.finish_reason is not None
    return stop_reason(final.finish_reason, called, sequence), sequence


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def _events(events: list[Event]) -> bytes:
    return b"".join(_event(name, data) for name, data in events)


async def _sse(
    state: ServerState,
    gen: Generation,
    request: Request,
    mid: str,
    model: str,
    parsing: OutputParsing | None,
    stops: Sequence[str],
) -> AsyncIterator[bytes]:
    """Anthropic's event sequence: message_start, ping, then per block content_block_start,
    deltas, content_block_stop, then message_delta (stop_reason, usage) and message_stop."""
    # The prompt's size is known now; how much of it the prefix cache supplied is known
    # only at the end, so message_delta carries the final input counts.
    opening = message_json(mid, model, [], None, None, usage_json(gen.prompt_n, 0, 0))
    yield _event("message_start", {"type": "message_start", "message": opening})
    yield _event("ping", {"type": "ping"})
    blocks = Blocks()
    calls = parsing.stream() if parsing else None
    ids: list[int] = []
    try:
        async for event in gen.events(request):
            if event.token_id is not None:
                ids.append(event.token_id)
            if calls is not None and parsing is not None:
                text = parsing.text(event.token_id, event.text)
                deltas = calls.feed(text, tokens=int(event.token_id is not None))
                out = [e for d in deltas for e in blocks.add(d)]
            else:
                out = blocks.text(event.text)
            if out:
                yield _events(out)
            if event.finish_reason is None:
                continue
            if event.finish_reason == "cancelled" or event.timings is None:
                return  # the client has gone
            last = [e for d in calls.finish() for e in blocks.add(d)] if calls else []
            yield _events(last + blocks.close())
            called = bool(calls and calls.calls)
            reason, sequence = await _stop(state, gen, event, ids, stops, called)
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            usage = _usage(gen, event)
            yield _event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
            yield _event("message_stop", {"type": "message_stop"})
    except APIError as e:  # the server is shutting down
        yield _event("error", anthropic_error_body(e.status, e.message))
    except Exception as e:
        # Headers are out already; report in-band so the client does not hang or guess.
        log.exception("streamed generation failed")
        message = f"generation failed: {type(e).__name__}: {e}"
        yield _event("error", anthropic_error_body(500, message))
