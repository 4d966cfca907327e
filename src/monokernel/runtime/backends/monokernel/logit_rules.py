"""A request's logit processing and logprobs inside the running kernel: the buffers the
kernel reads the penalties from and writes each step's log-probabilities to
(kernels/csrc/sampling.cuh ``penalize``, kernels/csrc/logprobs.cuh).

The rule is runtime/sampling.py's ``penalize`` and ``min_p`` and runtime/logprobs.py's
``token_logprobs``, computed in the kernel's LM head and sampler, so the kernel never leaves
its loop for them. The host fills the buffers before the launch (the prompt's ids for
``repetition_penalty``, the tokens already produced, the bias); the kernel counts each token it
draws. Buffers (per kernel, each allocated by the first request that needs it):

    seen       [V] int32 device   1 if the id is in the prompt, + 2 a time generated
    bias       [V] float32 device logit_bias, dense
    raw        [V] float32 device the step's logits before the mask and penalties
    lp_out     [max_steps, LOGPROB_WORDS] host-mapped: each step's record (layout.py)
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import torch

from monokernel.kernels import launcher, layout
from monokernel.runtime.logprobs import TokenLogprobs
from monokernel.runtime.sampling import SamplingParams, check_bias_ids

# The Params fields of a launch with none of it (null buffers, neutral values).
NEUTRAL: Mapping[str, object] = MappingProxyType(
    dict(
        logit_bias=0,
        seen=0,
        raw_logits=0,
        lp_out=0,
        presence=0.0,
        frequency=0.0,
        repetition=1.0,
        min_p=0.0,
        n_logprobs=0,
    )
)


class LogitRules:
    """The buffers of one kernel on ``device`` (a vocabulary of ``vocab`` ids, launches of up
    to ``max_steps`` steps)."""

    def __init__(self, vocab: int, max_steps: int, device: torch.device) -> None:
        self.vocab, self.max_steps, self.device = vocab, max_steps, device
        self._seen: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self._raw: torch.Tensor | None = None
        self._lp: launcher.HostMapped | None = None
        self._lp_floats: ctypes.Array[ctypes.c_float] | None = None

    def fields(
        self, sampling: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]
    ) -> Mapping[str, object]:
        """The Params fields of a launch drawing by ``sampling`` after ``prompt_ids`` and the
        ``output_ids`` already produced (the first token, where the prefill drew it); fills
        the buffers on the current stream, which the launch waits for (``filled``).
        NEUTRAL itself for a request with none of it."""
        if not sampling.host_fields():
            return NEUTRAL
        f = dict(NEUTRAL)
        counting = sampling.presence_penalty != 0 or sampling.frequency_penalty != 0
        if sampling.repetition_penalty != 1 or counting:
            seen = self._seen = _buffer(self._seen, self.vocab, torch.int32, self.device)
            seen.zero_()
            if sampling.repetition_penalty != 1 and prompt_ids:
                ids = torch.tensor(prompt_ids, dtype=torch.long).to(self.device, non_blocking=True)
                seen.index_fill_(0, ids, 1)
            if output_ids:
                out = torch.tensor(output_ids, dtype=torch.long).to(self.device, non_blocking=True)
                seen.index_add_(0, out, torch.full_like(out, 2, dtype=torch.int32))
            f.update(
                seen=seen.data_ptr(),
                presence=float(sampling.presence_penalty),
                frequency=float(sampling.frequency_penalty),
                repetition=float(sampling.repetition_penalty),
            )
        if sampling.logit_bias:
            check_bias_ids(sampling, self.vocab)
            ids_list = [t for t, _ in sampling.logit_bias]
            bias = self._bias = _buffer(self._bias, self.vocab, torch.float32, self.device)
            bias.zero_()
            values = torch.tensor([b for _, b in sampling.logit_bias], dtype=torch.float32)
            bias[torch.tensor(ids_list, dtype=torch.long).to(self.device)] = values.to(self.device)
            f["logit_bias"] = bias.data_ptr()
        if sampling.min_p > 0 and not sampling.greedy:
            f["min_p"] = float(sampling.min_p)
        if sampling.logprobs is not None:
            self._raw = _buffer(self._raw, self.vocab, torch.float32, self.device)
            if self._lp is None:
                self._lp = launcher.HostMapped(self.max_steps * layout.LOGPROB_WORDS)
                self._lp_floats = (ctypes.c_float * self._lp.n).from_address(
                    ctypes.addressof(self._lp.words)
                )
            f.update(
                raw_logits=self._raw.data_ptr(),
                lp_out=self._lp.device_ptr,
                n_logprobs=sampling.logprobs,
            )
        return f

    @staticmethod
    def filled(fields: Mapping[str, object]) -> bool:
        """Whether ``fields`` (from ``fields``) point at buffers the host filled just now."""
        return bool(fields["seen"] or fields["logit_bias"])

    def logprobs(self, step: int, n: int) -> TokenLogprobs:
        """Kernel step ``step``'s record (its token word has landed, so the record has):
        the token's log-probability and the ``n`` alternatives'."""
        assert self._lp is not None and self._lp_floats is not None
        at = step * layout.LOGPROB_WORDS
        words, floats = self._lp.words, self._lp_floats
        top = tuple((int(words[at + 1 + 2 * j]), float(floats[at + 2 + 2 * j])) for j in range(n))
        return TokenLogprobs(float(floats[at]), top)

    def close(self) -> None:
        if self._lp is not None:
            self._lp.free()
            self._lp = self._lp_floats = None


def _buffer(
    t: torch.Tensor | None, n: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return t if t is not None else torch.empty(n, dtype=dtype, device=device)
