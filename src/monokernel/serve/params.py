"""Request body -> (prompt token ids, SamplingParams), with every refusal naming its field.

Checks run before a request joins the queue, so a bad request is answered at once and
never waits behind a good one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from monokernel.errors import InvalidRequestError
from monokernel.runtime.engine import Engine
from monokernel.runtime.sampling import SamplingParams
from monokernel.serve.errors import APIError
from monokernel.serve.protocol import ChatCompletionRequest, CompletionRequest

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")


@dataclass(frozen=True, slots=True)
class Prepared:
    prompt_ids: list[int]
    params: SamplingParams


def bad(message: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def check_model(name: str | None, served: str) -> None:
    if name is not None and name != served:
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


def unsupported_fields(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse features we cannot honour rather than ignoring them."""
    checks: list[tuple[str, bool]] = [
        ("n", req.n is not None and req.n != 1),
        ("best_of", req.best_of is not None and req.best_of != 1),
        ("logprobs", req.logprobs not in (None, False, 0)),
        ("top_logprobs", bool(req.top_logprobs)),
        ("presence_penalty", bool(req.presence_penalty)),
        ("frequency_penalty", bool(req.frequency_penalty)),
        ("logit_bias", bool(req.logit_bias)),
    ]
    if isinstance(req, CompletionRequest):
        checks += [("echo", req.echo), ("suffix", bool(req.suffix))]
    else:
        fmt = (req.response_format or {}).get("type", "text")
        checks += [
            ("tools", bool(req.tools)),
            ("tool_choice", req.tool_choice not in (None, "none", "auto")),
            ("response_format", fmt != "text"),
        ]
    for field, refused in checks:
        if not refused:
            continue
        if field == "n":
            raise bad(f"n must be 1 (one choice per request), got {req.n}", "n")
        value = getattr(req, field)
        raise bad(f"{field}={value!r} is not supported by this server", field, "unsupported")


def _range_checks(req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> None:
    # SamplingParams checks these too; checking here first lets the error carry `param`.
    if max_tokens is not None and max_tokens < 1:
        param = "max_tokens"
        if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
            param = "max_completion_tokens"
        raise bad(f"{param} must be an integer >= 1, got {max_tokens}", param)
    if req.temperature is not None and not req.temperature >= 0:
        raise bad(f"temperature must be >= 0, got {req.temperature}", "temperature")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise bad(f"top_p must be in (0, 1], got {req.top_p}", "top_p")
    if req.top_k is not None and req.top_k < -1:
        raise bad(f"top_k must be an integer >= -1 (0 or -1 turn it off), got {req.top_k}", "top_k")
    if req.seed is not None and req.seed < 0:
        raise bad(f"seed must be a non-negative integer, got {req.seed}", "seed")


def _stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not s for s in stops):
        raise bad("stop must be a string or a list of non-empty strings", "stop")
    return stops


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template wants them: content flattened to one string."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            texts: list[str] = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad(
                        f"messages[{i}].content has a {part.type!r} part; only text parts "
                        "are supported",
                        f"messages[{i}].content",
                    )
                texts.append(part.text)
            content = "".join(texts)
        out.append(m.model_dump(exclude_none=True) | {"content": content or ""})
    if not out:
        raise bad("messages must hold at least one message", "messages")
    return out


def encode_prompt(engine: Engine, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
    """Tokenise (blocking: call it off the event loop)."""
    if isinstance(req, ChatCompletionRequest):
        try:
            return engine.encode(chat_messages(req))
        except InvalidRequestError as e:
            raise bad(str(e), "messages") from e
        except APIError:
            raise
        except Exception as e:  # a template may raise anything (e.g. jinja's raise_exception)
            raise bad(f"the chat template refused these messages: {e}", "messages") from e
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad(f"prompt holds {len(prompt)} prompts; send one prompt per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            return engine.encode(prompt)
        except InvalidRequestError as e:
            raise bad(str(e), "prompt") from e
    ids = list(prompt)
    vocab = engine.tokenizer.vocab_size
    if not ids:
        raise bad("the prompt is empty", "prompt")
    if any(not 0 <= t < vocab for t in ids):
        raise bad(f"prompt token ids must be in [0, {vocab})", "prompt")
    return ids


def prepare(
    engine: Engine,
    req: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    max_tokens_cap: int,
) -> Prepared:
    """Sampling parameters for a tokenised request; raises APIError(400) naming the field."""
    asked = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        asked = req.max_completion_tokens
    _range_checks(req, asked)
    room = engine.max_model_len - len(prompt_ids)
    if asked is None:
        if room < 1:
            raise bad(
                f"the prompt is {len(prompt_ids)} tokens, which leaves no room to generate "
                f"in the context of {engine.max_model_len} tokens; shorten the prompt",
                "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                "context_length_exceeded",
            )
        max_tokens = min(room, max_tokens_cap)
    else:
        max_tokens = asked
        try:
            engine.check_fits(len(prompt_ids), max_tokens)
        except InvalidRequestError as e:
            raise bad(str(e), "max_tokens", "context_length_exceeded") from e
    stop_ids = tuple(req.stop_token_ids or ())
    vocab = engine.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in stop_ids):
        raise bad(f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            seed=req.seed,
            stop=_stop_tuple(req.stop),
            stop_token_ids=stop_ids,
            ignore_eos=req.ignore_eos,
        )
    except InvalidRequestError as e:
        first = str(e).split(" ", 1)[0]
        raise bad(str(e), first if first in _SAMPLING_FIELDS else None) from e
    return Prepared(prompt_ids, params)
