"""The OpenAI wire format: request bodies (pydantic) and response/chunk builders.

Request fields are strictly typed (``"5"`` is not an integer, ``"yes"`` not a boolean).
Fields that change the output but that this engine does not implement (``n``,
``best_of``) are accepted only at their neutral value and refused otherwise, and a field
the server does not know is refused as OpenAI's API refuses it (see
``params.check_request``), so nothing a client asks for is dropped. Penalties, ``min_p``,
``logit_bias`` and ``logprobs`` are implemented on every engine (logprobs on one GPU).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict

from monokernel.runtime.engine import Timings


class StreamOptions(BaseModel):
    # extra="allow": params.check_request judges the extras (continuous_usage_stats...).
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras, accepted as top-level body fields (`extra_body` in the openai client).
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # Logit processing (runtime/sampling.py ``penalize``; the monokernel's sampling.cuh).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's
    min_p: float | None = None  # vLLM's
    logit_bias: dict[str, float] | None = None
    # Chat: a boolean and top_logprobs; completions: a number (params.requested_logprobs).
    logprobs: Any = None
    top_logprobs: int | None = None
    # Accepted only at its neutral value.
    best_of: int | None = None


class CompletionRequest(_SamplingFields):
    # A string, one-string list, token ids, or one list of token ids.
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    # Not OpenAI's on this endpoint, but vLLM's (serve/structured.py reads it).
    response_format: dict[str, Any] | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Extra keys (name, tool_call_id, ...) reach the chat template unchanged; tool_calls
    # are checked and their arguments decoded first (tools.history_message).
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    # Judged field by field in tools.check_tools, so each error can name its path.
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # Judged in params.template_kwargs, which names the offending key.
    chat_template_kwargs: Any = None


def unwrap_prompt(prompt: Any) -> Any:
    """A completion prompt given as a list of one prompt (one text, or one list of token
    ids) as that prompt; any other prompt as it is."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return prompt[0]
    return prompt


class TokenizeCompletionRequest(BaseModel):
    """vLLM's ``POST /tokenize`` with a prompt."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """vLLM's ``POST /tokenize`` with chat messages, through the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


# ---- responses ------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens`` where the engine reuses
    prefixes (the prompt tokens an earlier request's K/V supplied)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def timings_json(t: Timings, queue_s: float) -> dict[str, float | int]:
    """llama.cpp-style timings. ``prompt_ms`` is the engine's TTFT (prefill plus the first
    token); ``predicted_per_second`` counts the tokens after the first over the time after
    it, i.e. the steady decode rate. ``queue_ms`` is time spent waiting for the engine.
    With speculative decoding, llama.cpp's ``draft_n`` (tokens drafted) and
    ``draft_n_accepted`` (those the model agreed with); with prefix reuse, its ``cache_n``
    (prompt tokens an earlier request's K/V supplied)."""
    extra: dict[str, float | int] = {}
    if t.drafted_tokens is not None and t.accepted_tokens is not None:
        extra = {"draft_n": t.drafted_tokens, "draft_n_accepted": t.accepted_tokens}
    if t.cached_tokens is not None:
        extra["cache_n"] = t.cached_tokens
    prompt_ms = t.ttft_s * 1e3
    predicted_ms = t.decode_s * 1e3
    decode_steps = max(t.generated_tokens - 1, 0)
    return {
        "prompt_n": t.prompt_tokens,
        "prompt_ms": round(prompt_ms, 3),
        "prompt_per_token_ms": round(prompt_ms / t.prompt_tokens, 3) if t.prompt_tokens else 0.0,
        "prompt_per_second": round(t.prompt_tok_s, 3),
        "predicted_n": t.generated_tokens,
        "predicted_ms": round(predicted_ms, 3),
        "predicted_per_token_ms": round(predicted_ms / decode_steps, 3) if decode_steps else 0.0,
        "predicted_per_second": round(t.decode_tok_s, 3),
        "ttft_ms": round(prompt_ms, 3),
        "queue_ms": round(queue_s * 1e3, 3),
        **extra,
    }


def completion_choice(
    index: int, text: str, finish: str, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def chat_choice(
    index: int,
    text: str,
    finish: str,
    message: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``message`` replaces the plain text reply (a reply with tool calls)."""
    return {
        "index": index,
        "message": message or {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish,
    }


def response(
    chat: bool,
    rid: str,
    model: str,
    choices: list[dict[str, Any]],
    prompt_n: int,
    completion_n: int,
    timings: dict[str, Any],
) -> dict[str, Any]:
    """A whole (non-streamed) completion or chat completion; ``completion_n``: the
    generated tokens of every choice."""
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": now(),
        "model": model,
        "choices": choices,
        "usage": usage(prompt_n, completion_n, timings.get("cache_n")),
        "timings": timings,
    }


class ChunkMaker:
    """Builds the SSE chunks of one streamed response (completion or chat)."""

    def __init__(self, chat: bool, rid: str, model: str) -> None:
        self.chat = chat
        self.rid = rid
        self.model = model
        self.created = now()

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        base = {
            "id": self.rid,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        return base | extra

    def role(self, choice: int = 0) -> dict[str, Any]:
        """A chat choice opens with the assistant role, as OpenAI's does."""
        c = {"index": choice, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        return self._chunk([c | {"finish_reason": None}])

    def delta(
        self,
        text: str,
        finish: str | None = None,
        logprobs: dict[str, Any] | None = None,
        choice: int = 0,
        **extra: Any,
    ) -> dict[str, Any]:
        if self.chat:
            c: dict[str, Any] = {"index": choice, "delta": {"content": text} if text else {}}
        else:
            c = {"index": choice, "text": text}
        c |= {"logprobs": logprobs, "finish_reason": finish}
        return self._chunk([c], **extra)

    def reasoning(self, text: str, choice: int = 0) -> dict[str, Any]:
        """A piece of the reasoning, under vLLM's (and DeepSeek's) ``reasoning_content``."""
        c = {"index": choice, "delta": {"reasoning_content": text}}
        return self._chunk([c | {"logprobs": None, "finish_reason": None}])

    def tool_call(
        self, index: int, call_id: str, name: str, arguments: str, choice: int = 0
    ) -> list[dict[str, Any]]:
        """OpenAI's two kinds of tool-call delta: the call's id, type and name (arguments
        empty), then its arguments. ``index``: the call's; ``choice``: the choice's."""
        head = {"index": index, "id": call_id, "type": "function"}
        head["function"] = {"name": name, "arguments": ""}
        first = {"index": choice, "delta": {"tool_calls": [head]}}
        args = {"index": index, "function": {"arguments": arguments}}
        second = {"index": choice, "delta": {"tool_calls": [args]}}
        done = {"logprobs": None, "finish_reason": None}
        return [self._chunk([first | done]), self._chunk([second | done])]

    def usage(self, prompt_n: int, completion_n: int, **extra: Any) -> dict[str, Any]:
        cached = extra.get("timings", {}).get("cache_n")
        return self._chunk([], usage=usage(prompt_n, completion_n, cached), **extra)
