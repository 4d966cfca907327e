"""Request body -> (prompt token ids, SamplingParams), with every refusal naming its field.

Checks run before a request joins the queue, so a bad request is answered at once and
never waits behind a good one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from monokernel.errors import InvalidRequestError
from monokernel.runtime.constrained import Constraint
from monokernel.runtime.engine import Engine
from monokernel.runtime.sampling import (
    MAX_LOGPROBS,
    SamplingParams,
    unsupported_sampling_reason,
)
from monokernel.serve import structured
from monokernel.serve.body import clip, echo, unknown_field
from monokernel.serve.errors import APIError, bad_request
from monokernel.serve.fim import fim_prompt
from monokernel.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    unwrap_prompt,
)
from monokernel.serve.tools import (
    ToolRequest,
    apply_template,
    check_tools,
    encode_rendered,
    history_message,
    render,
)

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
_PENALTY_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
_MAX_LOGIT_BIAS = 1024  # entries: OpenAI's own limit is lower; each costs the host a copy
# The longest token, in characters, of a tokenizer that cannot list its vocabulary: far
# above any real vocabulary's, so the bound below still never refuses a prompt that fits.
_UNKNOWN_TOKEN_CHARS = 1024
# Normalisers may compose characters (NFC/NFKC turn "e" + U+0301 into one character), so
# a token may stand for more input characters than its vocabulary string shows.
_NORMALISATION_SLACK = 2


@dataclass(frozen=True, slots=True)
class Prepared:
    prompt_ids: list[int]
    params: SamplingParams


def check_model(name: str | None, served: str) -> None:
    if name is not None and name != served:
        raise APIError(
            404,
            f"the model {echo(name)} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


def _is_none(v: Any) -> bool:
    return v is None


def _is_false(v: Any) -> bool:
    return v is None or v is False


def _is_true(v: Any) -> bool:
    return v is None or v is True


def _is_number(target: float) -> Callable[[Any], bool]:
    def neutral(v: Any) -> bool:
        return v is None or (type(v) in (int, float) and v == target)

    return neutral


def _judged_elsewhere(v: Any) -> bool:
    # Structured-output fields: serve/structured.py enforces them or refuses them.
    return True


def _is_empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


# Fields clients send (OpenAI's, and vLLM's extras) that this server does not implement:
# the value that asks for nothing is accepted, any other is refused naming the field.
_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "length_penalty": _is_number(1.0),
    "min_tokens": _is_number(0),
    "use_beam_search": _is_false,
    "continue_final_message": _is_false,
    "add_generation_prompt": _is_true,
    "include_stop_str_in_output": _is_false,
    "skip_special_tokens": _is_true,  # the engine decodes without special tokens
    "spaces_between_special_tokens": _is_true,
    "truncate_prompt_tokens": _is_none,
    "prompt_logprobs": _is_none,
    "allowed_token_ids": _is_none,
    "bad_words": _is_empty,
    "documents": _is_none,
    "chat_template": _is_none,
    "chat_template_kwargs": _is_empty,
    "mm_processor_kwargs": _is_empty,
    "guided_json": _judged_elsewhere,
    "guided_regex": _judged_elsewhere,
    "guided_choice": _judged_elsewhere,
    "guided_grammar": _judged_elsewhere,
    "guided_decoding_backend": _is_none,
    "guided_whitespace_pattern": _is_none,
    "structured_outputs": _judged_elsewhere,
    "structural_tag": _is_none,
    "logits_processors": _is_none,
    "return_tokens_as_token_ids": _is_false,
    "return_token_ids": _is_false,
    "cache_salt": _is_none,
    "kv_transfer_params": _is_none,
    "vllm_xargs": _is_none,
    "priority": _is_number(0),
    "functions": _is_none,
    "function_call": _is_none,
    "audio": _is_none,
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": _is_none,
    "reasoning_effort": _is_none,
    "verbosity": _is_none,
    "web_search_options": _is_none,
}
# Per endpoint: chat's `echo` and `add_special_tokens` are vLLM extras with their own
# defaults (the template writes the special tokens), unlike the completion fields.
_NEUTRAL_CHAT: dict[str, Callable[[Any], bool]] = {
    "echo": _is_false,
    "add_special_tokens": _is_false,
}
_NEUTRAL_COMPLETION: dict[str, Callable[[Any], bool]] = {"add_special_tokens": _is_true}
# Fields that never change what is generated (bookkeeping and routing hints): taken and
# not used, as a server with one model and no storage has nothing to do with them.
_HINTS = frozenset(
    {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
    | {"request_id"}
)
_STREAM_NEUTRAL: dict[str, Callable[[Any], bool]] = {"continuous_usage_stats": _is_false}
# OpenAI's roles; a template renders any string it is given, so an unknown one (a typo,
# or a role of another API) would be rendered literally instead of being refused.
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _check_extras(
    extras: dict[str, Any], neutral: dict[str, Callable[[Any], bool]], where: str = ""
) -> None:
    for field, value in extras.items():
        name = where + field
        test = neutral.get(field)
        if test is None:
            if not where and field in _HINTS:
                continue
            raise unknown_field(name)
        if not test(value):
            raise bad_request(
                f"{name}={echo(value)} is not supported by this server", name, "unsupported"
            )


def check_request(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Everything that can be judged without the tokenizer, so a bad request is answered
    at once; raises APIError(400) naming the field."""
    unsupported_fields(req)
    extra_neutral = _NEUTRAL_CHAT if isinstance(req, ChatCompletionRequest) else _NEUTRAL_COMPLETION
    _check_extras(req.model_extra or {}, _NEUTRAL | extra_neutral)
    if req.stream_options is not None:
        if not req.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        _check_extras(req.stream_options.model_extra or {}, _STREAM_NEUTRAL, "stream_options.")
    if isinstance(req, ChatCompletionRequest):
        check_roles(req.messages)
        chat_tools(req)
        template_kwargs(req.chat_template_kwargs)
    structured.requested(req)
    asked = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        asked = req.max_completion_tokens
    _range_checks(req, asked)


def chat_tools(req: ChatCompletionRequest) -> ToolRequest | None:
    """The request's tools, checked; None when it has none."""
    return check_tools(req.tools, req.tool_choice, req.parallel_tool_calls)


# What apply_chat_template takes as its own arguments, or the server sets: a kwarg of that
# name would change how the prompt is built, not pass a variable to the template.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "tokenize"}
    | {"add_generation_prompt", "continue_final_message", "return_dict", "return_tensors"}
    | {"return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation"}
    | {"max_length", "bos_token", "eos_token", "pad_token", "unk_token", "raise_exception"}
)


def template_kwargs(value: Any) -> dict[str, Any] | None:
    """``chat_template_kwargs`` (vLLM's): variables for the chat template, such as Qwen3's
    ``enable_thinking``. Only JSON scalars, so nothing a template could call or walk deep
    into reaches it."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(
            f"chat_template_kwargs must be an object, got {echo(value)}", "chat_template_kwargs"
        )
    for key, v in value.items():
        where = f"chat_template_kwargs.{clip(key)}"
        if not key.isidentifier():
            raise bad_request(f"{where}: template variable names must be identifiers", where)
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise bad_request(
                f"{where} is set by the server and cannot be passed to the template", where
            )
        if v is not None and type(v) not in (str, int, float, bool):
            raise bad_request(
                f"{where} must be a string, number, boolean or null, got {echo(v)}", where
            )
    return value or None


def check_roles(messages: list[ChatMessage]) -> None:
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise bad_request(
                f"messages[{i}].role is {echo(m.role)}; expected one of {', '.join(ROLES)}",
                f"messages[{i}].role",
            )


# Choices a request may ask for (n): run one after another in its engine slot.
MAX_CHOICES = 16


def unsupported_fields(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse features we cannot honour rather than ignoring them."""
    if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
        raise bad_request(f"n must be in [1, {MAX_CHOICES}] (choices), got {echo(req.n)}", "n")
    checks: list[tuple[str, bool]] = [
        ("best_of", req.best_of is not None and req.best_of != 1),
    ]
    for field, refused in checks:
        if not refused:
            continue
        value = getattr(req, field)
        raise bad_request(
            f"{field}={echo(value)} is not supported by this server", field, "unsupported"
        )


def longest_token_chars(engine: Engine) -> int:
    """The longest vocabulary entry in characters. Byte-level BPE writes one character per
    byte and SentencePiece one per character, so no token covers more input than this."""
    try:
        vocab = engine.tokenizer.hf.get_vocab()
        return max(8, max(len(piece) for piece in vocab))
    except Exception:  # a tokenizer without get_vocab: a bound that is safe, if loose
        return _UNKNOWN_TOKEN_CHARS


def prompt_char_limit(engine: Engine) -> int:
    """More characters than this cannot fit ``max_model_len`` tokens whatever they say:
    each token covers at most ``longest_token_chars`` of them. Checked before tokenising,
    so an oversized prompt costs a length check, not seconds of tokenizer time."""
    return engine.max_model_len * longest_token_chars(engine) * _NORMALISATION_SLACK


def text_chars(value: Any) -> int:
    """Characters in every string of a message (content, name, tool calls...), without
    the whitespace around each, which chat templates may trim."""
    total = 0
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            total += len(node.strip())
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
        elif isinstance(node, BaseModel):
            stack.append(node.__dict__)
            stack.append(node.__pydantic_extra__ or {})
    return total


def check_prompt_size(
    req: CompletionRequest | ChatCompletionRequest, char_limit: int, max_model_len: int
) -> None:
    """Refuse, without tokenising, a prompt that cannot fit the context."""
    if isinstance(req, ChatCompletionRequest):
        # The tools' schemas are rendered into the prompt too.
        chars = text_chars(req.messages) + text_chars(req.tools)
        field, chars = "messages", chars + text_chars(req.chat_template_kwargs)
    else:
        field, prompt = "prompt", req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            ids = max((len(p) for p in prompt if isinstance(p, list)), default=0)
            if ids >= max_model_len:
                raise bad_request(
                    f"the prompt is {ids} tokens, which leaves no room to generate in the "
                    f"context of {max_model_len} tokens; shorten the prompt",
                    field,
                    "context_length_exceeded",
                )
            return
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            if len(prompt) >= max_model_len:
                raise bad_request(
                    f"the prompt is {len(prompt)} tokens, which leaves no room to generate "
                    f"in the context of {max_model_len} tokens; shorten the prompt",
                    field,
                    "context_length_exceeded",
                )
            return
        chars = text_chars(prompt) + text_chars(req.suffix)
    check_chars(chars, char_limit, max_model_len, field)


def check_chars(chars: int, char_limit: int, max_model_len: int, field: str) -> None:
    if chars > char_limit:
        raise bad_request(
            f"the prompt is {chars} characters; no prompt over {char_limit} characters can "
            f"fit the context of {max_model_len} tokens (--max-model-len), so it was refused "
            "before tokenising",
            field,
            "context_length_exceeded",
        )


_MAX_SEED = 2**64 - 1  # the sampler's hash keys on 64 bits; larger seeds would be cut
_MAX_TOP_K = 2**63 - 1


def _range_checks(req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> None:
    # SamplingParams checks some of these too; checking here first lets the error carry
    # `param`, and answers before the prompt is tokenised.
    if max_tokens is not None and max_tokens < 1:
        param = "max_tokens"
        if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
            param = "max_completion_tokens"
        raise bad_request(f"{param} must be an integer >= 1, got {echo(max_tokens)}", param)
    t = req.temperature
    if t is not None and not 0 <= t <= 2:  # also refuses NaN and the infinities
        raise bad_request(f"temperature must be in [0, 2], got {echo(t)}", "temperature")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {echo(req.top_p)}", "top_p")
    if req.top_k is not None and not -1 <= req.top_k <= _MAX_TOP_K:
        raise bad_request(
            f"top_k must be an integer in [-1, 2^63) (0 or -1 turn it off), got {echo(req.top_k)}",
            "top_k",
        )
    if req.seed is not None and not 0 <= req.seed <= _MAX_SEED:
        raise bad_request(f"seed must be an integer in [0, 2^64), got {echo(req.seed)}", "seed")
    for field in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, field)
        if v is not None and not -2 <= v <= 2:  # also refuses NaN and the infinities
            raise bad_request(f"{field} must be in [-2, 2], got {echo(v)}", field)
    rp = req.repetition_penalty
    if rp is not None and not 0 < rp < float("inf"):
        raise bad_request(f"repetition_penalty must be > 0, got {echo(rp)}", "repetition_penalty")
    if req.min_p is not None and not 0 <= req.min_p <= 1:
        raise bad_request(f"min_p must be in [0, 1], got {echo(req.min_p)}", "min_p")
    _logit_bias(req.logit_bias)


def _logit_bias(value: dict[str, float] | None, vocab: int | None = None) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token id (a decimal string) -> bias in [-100, 100]."""
    if not value:
        return {}
    if len(value) > _MAX_LOGIT_BIAS:
        raise bad_request(
            f"logit_bias may name at most {_MAX_LOGIT_BIAS} tokens, got {len(value)}: "
            f"{echo(value)}",
            "logit_bias",
        )
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 12:
            raise bad_request(
                f"logit_bias keys must be token ids (decimal integers), got {echo(key)}",
                "logit_bias",
            )
        token = int(key)
        if vocab is not None and token >= vocab:
            raise bad_request(
                f"logit_bias names token {token}; token ids must be in [0, {vocab})",
                "logit_bias",
            )
        if not -100 <= bias <= 100:
            raise bad_request(
                f"logit_bias values must be in [-100, 100], got {echo(bias)} for token {token}",
                "logit_bias",
            )
        if token in out:
            raise bad_request(f"logit_bias names token {token} more than once", "logit_bias")
        out[token] = float(bias)
    return out


def requested_logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The alternatives a token the request asks for (0: the chosen token's alone), or
    None for no logprobs; 400 naming the field for a value of the wrong kind. Chat takes
    ``logprobs: true`` and ``top_logprobs`` (0-20); completions ``logprobs`` as a number
    (0-20)."""
    top = f"[0, {MAX_LOGPROBS}]"
    if isinstance(req, ChatCompletionRequest):
        if req.logprobs is not None and not isinstance(req.logprobs, bool):
            raise bad_request(f"logprobs must be a boolean, got {echo(req.logprobs)}", "logprobs")
        n = req.top_logprobs
        if n is not None and not 0 <= n <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in {top}, got {echo(n)}", "top_logprobs")
        if not req.logprobs:
            if n:
                raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return n or 0
    if req.top_logprobs is not None:
        raise bad_request(
            "top_logprobs is a chat completions field; completions take logprobs: N",
            "top_logprobs",
        )
    n = req.logprobs
    if n is None:
        return None
    if type(n) is not int or not 0 <= n <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be an integer in {top}, got {echo(n)}", "logprobs")
    return n


def check_sampling_engine(engine: Engine, params: SamplingParams) -> None:
    """400 naming the field when the engine cannot apply the request's logit processing
    or return its logprobs."""
    why = unsupported_sampling_reason(params, engine.engine_name)
    if why is not None:
        raise bad_request(why, why.split(" ", 1)[0], "unsupported")


def _stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not s for s in stops):
        raise bad_request("stop must be a string or a list of non-empty strings", "stop")
    return stops


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template wants them: content flattened to one string."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts: list[str] = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"messages[{i}].content has a {part.type!r} part; only text parts "
                        "are supported",
                        f"messages[{i}].content",
                    )
                texts.append(part.text)
            content = "".join(texts)
        msg = m.model_dump(exclude_none=True) | {"content": content or ""}
        out.append(history_message(msg, i))
    if not out:
        raise bad_request("messages must hold at least one message", "messages")
    return out


def encode_prompt(
    engine: Engine,
    req: CompletionRequest | ChatCompletionRequest,
    tools: ToolRequest | None = None,
) -> list[int]:
    """Tokenise (blocking: call it off the event loop)."""
    if isinstance(req, ChatCompletionRequest):
        kwargs = template_kwargs(req.chat_template_kwargs)
        return encode_chat(engine, req.messages, tools, kwargs)
    if req.suffix:
        return fim_prompt(engine, req.prompt, req.suffix)
    return encode_text(engine, req.prompt)


def encode_chat(
    engine: Engine,
    messages: list[ChatMessage],
    tools: ToolRequest | None = None,
    kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Through the chat template, with the tools when there are some and the request's
    ``chat_template_kwargs`` (blocking: call it off the event loop)."""
    try:
        msgs = chat_messages(messages)
        if tools is None and not kwargs:
            return engine.encode(msgs)
        if not engine.tokenizer.has_chat_template:
            field = "tools" if tools is not None else "chat_template_kwargs"
            raise bad_request(
                f"this model's tokenizer has no chat template, so it cannot take {field}", field
            )
        hf = engine.tokenizer.hf
        if tools is None:
            ids = encode_rendered(hf, apply_template(hf, msgs, None, kwargs))
        else:
            ids = render(hf, msgs, tools.tools, kwargs)
        if not ids:
            raise bad_request("the prompt encodes to no tokens", "messages")
        return ids
    except InvalidRequestError as e:
        raise bad_request(str(e), "messages") from e
    except APIError:
        raise
    except Exception as e:  # a template may raise anything (e.g. jinja's raise_exception)
        raise bad_request(
            f"the chat template refused these messages: {clip(str(e))}", "messages"
        ) from e


def encode_text(engine: Engine, prompt: str | list[str] | list[int] | list[list[int]]) -> list[int]:
    """A completion prompt: text or token ids (blocking: call it off the event loop)."""
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
        raise bad_request(
            f"prompt holds {len(prompt)} prompts; send one prompt per request", "prompt"
        )
    prompt = unwrap_prompt(prompt)
    if isinstance(prompt, str):
        try:
            return engine.encode(prompt)
        except InvalidRequestError as e:
            raise bad_request(str(e), "prompt") from e
        except Exception as e:  # e.g. a lone surrogate ("\ud800"), which no tokenizer takes
            raise bad_request(f"the prompt could not be tokenised: {clip(str(e))}", "prompt") from e
    ids = list(prompt)
    vocab = engine.tokenizer.vocab_size
    if not ids:
        raise bad_request("the prompt is empty", "prompt")
    if any(not 0 <= t < vocab for t in ids):
        raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
    return ids


def prepare(
    engine: Engine,
    req: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    max_tokens_cap: int,
    constraint: Constraint | None = None,
) -> Prepared:
    """Sampling parameters for a tokenised request; raises APIError(400) naming the field.
    ``constraint``: what the output must match (serve/structured.py), already checked."""
    asked = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        asked = req.max_completion_tokens
    room = engine.max_model_len - len(prompt_ids)
    if asked is None:
        if room < 1:
            raise bad_request(
                f"the prompt is {len(prompt_ids)} tokens, which leaves no room to generate "
                f"in the context of {engine.max_model_len} tokens; shorten the prompt",
                "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                "context_length_exceeded",
            )
        max_tokens = min(room, max_tokens_cap)
    else:
        max_tokens = asked
        if max_tokens > engine.max_model_len:  # before check_fits prints a 4,000-digit number
            param = "max_tokens"
            if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
                param = "max_completion_tokens"
            raise bad_request(
                f"{param} {echo(max_tokens)} is over the context limit of "
                f"{engine.max_model_len} tokens",
                param,
                "context_length_exceeded",
            )
        try:
            engine.check_fits(len(prompt_ids), max_tokens)
        except InvalidRequestError as e:
            raise bad_request(str(e), "max_tokens", "context_length_exceeded") from e
    stop_ids = tuple(req.stop_token_ids or ())
    vocab = engine.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in stop_ids):
        raise bad_request(f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
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
            constraint=constraint,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            min_p=req.min_p or 0.0,
            logit_bias=_logit_bias(req.logit_bias, engine.model_config.vocab_size),
            logprobs=requested_logprobs(req),
        )
    except InvalidRequestError as e:
        first = str(e).split(" ", 1)[0]
        known = first in _SAMPLING_FIELDS or first in _PENALTY_FIELDS or first == "logit_bias"
        raise bad_request(str(e), first if known else None) from e
    check_sampling_engine(engine, params)
    return Prepared(prompt_ids, params)
