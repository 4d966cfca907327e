"""``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from monokernel.runtime.constrained import Constraint
from monokernel.runtime.engine import Engine, TokenEvent
from monokernel.runtime.logprobs import TokenLogprobs
from monokernel.serve import params as P
from monokernel.serve import structured as S
from monokernel.serve.body import parse_body
from monokernel.serve.errors import APIError, error_body
from monokernel.serve.generation import Generation
from monokernel.serve.logprobs_format import LogprobsFormat
from monokernel.serve.protocol import (
    ChatCompletionRequest,
    ChunkMaker,
    CompletionRequest,
    chat_choice,
    completion_choice,
    new_id,
    response,
    timings_json,
    unwrap_prompt,
)
from monokernel.serve.reasoning import OutputParsing, OutputStream, output_parsing
from monokernel.serve.scheduler import QueueFullError
from monokernel.serve.state import ServerState, get_state
from monokernel.serve.tool_calls import CallDelta, ContentDelta, Delta
from monokernel.serve.tools import parsing_for

log = logging.getLogger("monokernel.serve")
router = APIRouter()


def _model_card(state: ServerState) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": state.settings.served_model_name,
        "object": "model",
        "created": 0,
        "owned_by": "monokernel",
    }
    if state.engine is not None:
        card |= {"max_model_len": state.engine.max_model_len, "root": state.engine.source}
    return card


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(get_state(request))]}


# `:path`: served names are often hub ids with a slash (HuggingFaceTB/SmolLM2-135M-Instruct).
@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> dict[str, Any]:
    state = get_state(request)
    P.check_model(model_id, state.settings.served_model_name)
    return _model_card(state)


@router.post("/v1/completions", response_model=None)
async def completions(request: Request) -> Response:
    return await _serve(request, await parse_body(request, CompletionRequest))


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request) -> Response:
    return await _serve(request, await parse_body(request, ChatCompletionRequest))


def _encode(
    engine: Engine, body: CompletionRequest | ChatCompletionRequest
) -> tuple[list[int], OutputParsing | None, Constraint | None]:
    """Prompt ids, how to read reasoning and tool calls back, and what the output must
    match (blocking: the tokenizer thread)."""
    if not isinstance(body, ChatCompletionRequest):
        ids = P.encode_prompt(engine, body)
        return ids, None, S.request_constraint(engine, body, None, None)
    tool_req = P.chat_tools(body)
    ids = P.encode_prompt(engine, body, tool_req)
    hf, family = engine.tokenizer.hf, engine.model_config.family
    tools = parsing_for(hf, family, tool_req) if tool_req else None
    constraint = S.request_constraint(engine, body, tools, tool_req)
    parsing = output_parsing(hf, family, tools, tool_req.tools if tool_req else None, ids)
    return ids, parsing, constraint


async def admit(
    state: ServerState, body: CompletionRequest | ChatCompletionRequest, arrival: float
) -> tuple[Generation, OutputParsing | None]:
    """Validate, tokenise and take a place in the queue; every refusal raises APIError.
    The Anthropic and Responses routes come here too, with their requests made chat
    requests."""
    state.check_admitting()
    engine = state.require_engine()
    P.check_model(body.model, state.settings.served_model_name)
    P.check_request(body)
    S.check_engine(engine, body)
    P.check_prompt_size(body, state.prompt_char_limit, engine.max_model_len)
    # Tokenising a long prompt takes milliseconds: keep it off the event loop.
    loop = asyncio.get_running_loop()
    ids, parsing, constraint = await loop.run_in_executor(
        state.tokenize_thread, _encode, engine, body
    )
    cap = state.settings.default_max_tokens_cap
    prepared = P.prepare(engine, body, ids, cap, constraint)
    if prepared.params.logprobs is not None:
        _check_logprobs_with(body, parsing)
    try:
        ticket = state.scheduler.enter()
    except QueueFullError as e:
        retry = {"Retry-After": str(state.settings.retry_after_s)}
        raise APIError(503, str(e), code="queue_full", headers=retry) from e
    choices = body.n or 1
    gen = Generation(engine, prepared, ticket, state.metrics, arrival, state.engine_thread, choices)
    state.generations.add(gen)  # until its response is over: the drain waits for it
    return gen, parsing


def _check_logprobs_with(
    body: CompletionRequest | ChatCompletionRequest, parsing: OutputParsing | None
) -> None:
    """What logprobs do not combine with: a completion's echo (the prompt's logprobs are
    not computed) and a streamed reply read back as reasoning or tool calls (its chunks are
    not the tokens')."""
    if isinstance(body, CompletionRequest) and body.echo:
        raise APIError(
            400, "logprobs with echo: the prompt's log-probabilities are not computed", "echo"
        )
    if body.stream and parsing is not None:
        raise APIError(
            400,
            "logprobs in a streamed reply that is read back as reasoning or tool calls are "
            "not supported; ask without stream, or without logprobs",
            "logprobs",
        )


async def _serve(request: Request, body: CompletionRequest | ChatCompletionRequest) -> Response:
    state = get_state(request)
    arrival = time.perf_counter()
    gen, parsing = await admit(state, body, arrival)
    chat = isinstance(body, ChatCompletionRequest)
    rid = new_id("chatcmpl" if chat else "cmpl")
    model = state.settings.served_model_name
    echoed = "" if isinstance(body, ChatCompletionRequest) else _echo(state, body)
    engine = state.require_engine()
    want_lps = gen.prepared.params.logprobs is not None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = ChunkMaker(chat, rid, model)
        formats = (
            [LogprobsFormat(engine.tokenizer, chat) for _ in range(gen.choices)] if want_lps else []
        )
        events = _sse(gen, request, chunks, include_usage, parsing, echoed, formats)
        return GenerationStream(gen, events, state)
    done = await collect_choices(state, gen, request, parsing)
    if any(
        c.final is None or c.final.timings is None or c.final.finish_reason == "cancelled"
        for c in done
    ):
        # Only reached when the client has gone: nobody reads this.
        return JSONResponse(error_body(499, "the client closed the request"), status_code=499)
    out_choices = []
    for i, c in enumerate(done):
        assert c.final is not None and c.final.finish_reason is not None
        lps = LogprobsFormat(engine.tokenizer, chat).format(c.logprobs) if want_lps else None
        if not chat:
            out_choices.append(completion_choice(i, echoed + c.text, c.final.finish_reason, lps))
        elif c.out is None:
            out_choices.append(chat_choice(i, c.text, c.final.finish_reason, logprobs=lps))
        else:
            finish = _finish_reason(c.final.finish_reason, c.out)
            out_choices.append(chat_choice(i, c.text, finish, c.out.message(), lps))
    first = done[0].final
    assert first is not None and first.timings is not None
    timings = timings_json(first.timings, gen.queue_s)
    generated = sum(len(c.ids) for c in done)
    return JSONResponse(response(chat, rid, model, out_choices, gen.prompt_n, generated, timings))


def _echo(state: ServerState, body: CompletionRequest) -> str:
    """A completion's ``echo``: its prompt, written before the completion (token ids
    decoded); "" without echo."""
    if not body.echo:
        return ""
    prompt = unwrap_prompt(body.prompt)
    if isinstance(prompt, str):
        return prompt
    return state.require_engine().tokenizer.decode(list(prompt))  # type: ignore[arg-type]


@dataclass
class Choice:
    """One choice of a whole generation, as collect_choices read it."""

    parts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    final: TokenEvent | None = None  # None if the client left first
    out: OutputStream | None = None  # with parsing: reasoning, content, calls
    logprobs: list[tuple[int, TokenLogprobs]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.parts)


async def collect_choices(
    state: ServerState, gen: Generation, request: Request, parsing: OutputParsing | None
) -> list[Choice]:
    """A whole generation, each of its choices: its text (with skipped markers written
    back), its final event, its token ids and logprobs, and with ``parsing`` the finished
    output stream (reasoning, content, calls): the streamed routes' own reader, so the two
    never disagree."""
    choices = [Choice(out=parsing.stream() if parsing else None) for _ in range(gen.choices)]
    try:
        async for event in gen.events(request):
            c = choices[event.choice]
            text = parsing.text(event.token_id, event.text) if parsing else event.text
            c.parts.append(text)
            if c.out is not None:
                c.out.feed(text, tokens=int(event.token_id is not None))
            if event.token_id is not None:
                c.ids.append(event.token_id)
                if event.logprobs is not None:
                    c.logprobs.append((event.token_id, event.logprobs))
            if event.finish_reason is not None:
                c.final = event
    finally:
        gen.abandon()
        state.generations.discard(gen)
    for c in choices:
        if c.out is not None:
            c.out.finish()
    return choices


async def collect(
    state: ServerState, gen: Generation, request: Request, parsing: OutputParsing | None
) -> tuple[str, TokenEvent | None, list[int], OutputStream | None]:
    """A one-choice generation (collect_choices): text, final event, token ids, output."""
    (c,) = await collect_choices(state, gen, request, parsing)
    return c.text, c.final, c.ids, c.out


def _finish_reason(finish: str, calls: OutputStream) -> str:
    # OpenAI's "tool_calls" when the model stopped after calling; a reply cut by the
    # token limit stays "length", as its last call may be the one that was cut.
    return "tool_calls" if calls.calls and finish == "stop" else finish


def _data(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _delta_chunks(chunks: ChunkMaker, deltas: list[Delta], choice: int = 0) -> Iterator[bytes]:
    for d in deltas:
        if isinstance(d, ContentDelta):
            yield _data(chunks.delta(d.text, choice=choice))
        elif not isinstance(d, CallDelta):
            yield _data(chunks.reasoning(d.text, choice))
        else:
            call = d.call
            for chunk in chunks.tool_call(d.index, d.id, call.name, call.arguments, choice):
                yield _data(chunk)


async def _sse(
    gen: Generation,
    request: Request,
    chunks: ChunkMaker,
    include_usage: bool,
    parsing: OutputParsing | None = None,
    echoed: str = "",
    lp_formats: list[LogprobsFormat] | None = None,
) -> AsyncIterator[bytes]:
    """The stream of every choice in turn (each opens with its role, or its echo), then the
    usage and [DONE]. ``lp_formats``: a logprobs formatter a choice, when asked for."""
    calls = [parsing.stream() if parsing else None for _ in range(gen.choices)]

    def opening(i: int) -> Iterator[bytes]:
        if chunks.chat:
            yield _data(chunks.role(i))
        if echoed:  # a completion's echo: the prompt first
            yield _data(chunks.delta(echoed, choice=i))

    for piece in opening(0):  # at once, before the request's turn comes
        yield piece
    opened = {0}
    generated = 0
    try:
        async for event in gen.events(request):
            i = event.choice
            if i not in opened:
                opened.add(i)
                for piece in opening(i):
                    yield piece
            stream = calls[i]
            if stream is not None and parsing is not None:
                text = parsing.text(event.token_id, event.text)
                deltas = stream.feed(text, tokens=int(event.token_id is not None))
                for piece in _delta_chunks(chunks, deltas, i):
                    yield piece
            if event.finish_reason is None:
                if lp_formats and event.token_id is not None and event.logprobs:
                    # One chunk a token, its text possibly empty (held back by the
                    # detokenizer or a stop string), so no token's logprobs are lost.
                    lps = lp_formats[i].format([(event.token_id, event.logprobs)])
                    yield _data(chunks.delta(event.text, logprobs=lps, choice=i))
                elif event.text and stream is None:
                    yield _data(chunks.delta(event.text, choice=i))
                continue
            if event.finish_reason == "cancelled" or event.timings is None:
                return  # the client has gone
            timings = timings_json(event.timings, gen.queue_s)
            last = i == gen.choices - 1
            extra = {"timings": timings} if last else {}
            if stream is None:
                yield _data(chunks.delta(event.text, event.finish_reason, choice=i, **extra))
            else:
                for piece in _delta_chunks(chunks, stream.finish(), i):
                    yield piece
                finish = _finish_reason(event.finish_reason, stream)
                yield _data(chunks.delta("", finish, choice=i, **extra))
            generated += event.timings.generated_tokens
            if include_usage and last:
                yield _data(chunks.usage(gen.prompt_n, generated, timings=timings))
    except APIError as e:  # the server is shutting down
        yield _data(e.body())
    except Exception as e:
        # Headers are out already; report in-band so the client does not hang or guess.
        log.exception("streamed generation failed")
        yield _data(error_body(500, f"generation failed: {type(e).__name__}: {e}"))
    yield b"data: [DONE]\n\n"


class GenerationStream(StreamingResponse):
    """An SSE response that always releases its generation, even when the client leaves
    before the first byte and the body iterator is never started."""

    def __init__(self, gen: Generation, content: AsyncIterator[bytes], state: ServerState) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.gen = gen
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.abandon()
            self.state.generations.discard(self.gen)
