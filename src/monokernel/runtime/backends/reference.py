"""The reference backend: the plain PyTorch forward, one token at a time. The ground truth."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from monokernel.errors import InvalidRequestError
from monokernel.models.config import ModelConfig
from monokernel.models.transformer import Transformer
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.constrained import sample_masked
from monokernel.runtime.logprobs import token_logprobs
from monokernel.runtime.sampling import penalize, unsupported_sampling_reason
from monokernel.runtime.speculative import Speculating
from monokernel.weights.names import Weights


class ReferenceBackend(Speculating):
    name = "reference"

    def __init__(
        self, cfg: ModelConfig, weights: Weights, max_seq_len: int, device: torch.device
    ) -> None:
        self.model = Transformer(cfg, weights, max_seq_len)
        self.cache = self.model.new_cache(max_seq_len)
        self.device = device

    def _forward(self, tokens: list[int], start: int) -> torch.Tensor:
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return self.model.forward(ids, start, self.cache)

    def stream(self, request: DecodeRequest, cancel: CancelToken) -> Iterator[int]:
        sp = request.sampling
        reason = unsupported_sampling_reason(sp, self.name)
        if reason is not None:
            raise InvalidRequestError(reason)
        prompt = torch.tensor(request.prompt_ids, dtype=torch.long, device=self.device)
        logits = self.model.prefill(prompt, self.cache)
        if self.drafting(request):
            yield from self._speculate(logits, request, cancel, self.cache.max_len)
            return
        pos = len(request.prompt_ids)  # where the token being sampled will sit
        output: list[int] = []  # the tokens so far, for the penalties
        for produced in range(1, request.max_new_tokens + 1):
            if cancel.is_set():
                return
            raw = logits
            if sp.penalized:
                logits = penalize(logits, sp, request.prompt_ids, output)
            token = sample_masked(logits, sp, pos, request.matcher)
            output.append(token)
            if request.logprobs is not None and sp.logprobs is not None:
                request.logprobs.append(token_logprobs(raw, token, sp.logprobs))
            yield token
            if token in request.stop_token_ids or produced == request.max_new_tokens:
                return
            step = torch.tensor([token], dtype=torch.long, device=self.device)
            logits = self.model.forward(step, pos, self.cache, last_only=True)[0]
            pos += 1

    def close(self) -> None:
        del self.cache, self.model
