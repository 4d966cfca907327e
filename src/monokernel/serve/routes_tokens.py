"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, with the model's own tokenizer.

Both take the same path as generation requests up to the tokenizer: the same checks, the
same bound on prompt size, the same tokenizer thread.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from monokernel.serve import params as P
from monokernel.serve.body import load_json_object, validate
from monokernel.serve.errors import bad_request
from monokernel.serve.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from monokernel.serve.state import get_state

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    state = get_state(request)
    data = load_json_object(await request.body())
    body: TokenizeChatRequest | TokenizeCompletionRequest
    if "messages" in data:
        body = validate(data, TokenizeChatRequest)
    else:
        body = validate(data, TokenizeCompletionRequest)
    del data
    engine = state.require_engine()
    P.check_model(body.model, state.settings.served_model_name)
    limit, context = state.prompt_char_limit, engine.max_model_len
    loop = asyncio.get_running_loop()
    # Only the options that tokenise as generation does are taken: a count from this
    # endpoint must be the count a completion of the same prompt is charged.
    if isinstance(body, TokenizeChatRequest):
        if not body.add_generation_prompt:
            raise bad_request(
                "add_generation_prompt=False is not supported", "add_generation_prompt"
            )
        if body.continue_final_message:
            raise bad_request(
                "continue_final_message=True is not supported", "continue_final_message"
            )
        if body.add_special_tokens:
            raise bad_request(
                "add_special_tokens=True is not supported with messages (the chat template "
                "writes the special tokens)",
                "add_special_tokens",
            )
        P.check_roles(body.messages)
        P.check_chars(P.text_chars(body.messages), limit, context, "messages")
        ids = await loop.run_in_executor(
            state.tokenize_thread, P.encode_chat, engine, body.messages
        )
    else:
        if not body.add_special_tokens:
            raise bad_request("add_special_tokens=False is not supported", "add_special_tokens")
        P.check_chars(P.text_chars(body.prompt), limit, context, "prompt")
        ids = await loop.run_in_executor(state.tokenize_thread, P.encode_text, engine, body.prompt)
    strs = engine.tokenizer.hf.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": context, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    state = get_state(request)
    body = validate(load_json_object(await request.body()), DetokenizeRequest)
    engine = state.require_engine()
    P.check_model(body.model, state.settings.served_model_name)
    vocab = engine.tokenizer.vocab_size
    if len(body.tokens) > engine.max_model_len:
        raise bad_request(
            f"tokens holds {len(body.tokens)} ids, more than the context of "
            f"{engine.max_model_len} (--max-model-len)",
            "tokens",
        )
    if any(not 0 <= t < vocab for t in body.tokens):
        raise bad_request(f"token ids must be in [0, {vocab})", "tokens")
    loop = asyncio.get_running_loop()
    text = await loop.run_in_executor(state.tokenize_thread, engine.tokenizer.decode, body.tokens)
    return {"prompt": text}
