"""The penalties, logit_bias, min_p and logprobs inside the monokernel (logit_rules.py,
kernels/csrc/sampling.cuh ``penalize``, kernels/csrc/logprobs.cuh) against the host's rule:
each step's token is replayed on the host from the kernel's own raw logits of that step
(runtime/sampling.py ``penalize`` + ``sample``), and each step's logprobs record is
runtime/logprobs.py's on those logits. Random weights, the odd shape (every size odd) and the
Llama-3.2-1B shape (a 128k vocabulary).

GPU tests (marker ``gpu``) on a Hopper GPU.
"""

from __future__ import annotations

import functools

import pytest
import torch

from monokernel.models.shapes import SHAPES
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.backends.monokernel.kernel import Probe
from monokernel.runtime.logprobs import TokenLogprobs, token_logprobs
from monokernel.runtime.sampling import SamplingParams, penalize, sample
from monokernel.testing.gpu_models import needs_hopper
from monokernel.weights.random_weights import random_weights

pytestmark = [
    pytest.mark.gpu,
    needs_hopper,
]

STEPS = 48


@functools.lru_cache(maxsize=1)
def _backend(shape: str):  # type: ignore[no-untyped-def]
    from monokernel.runtime.backends.monokernel import MonokernelBackend

    cfg = SHAPES[shape]
    dev = torch.device("cuda")
    weights = random_weights(cfg, device=dev, seed=5, logit_scale=4.0)
    return cfg, MonokernelBackend(cfg, weights, 256, dev)


def _prompt(vocab: int, n: int = 24) -> list[int]:
    # Few distinct ids, so the repetition penalty has prompt tokens to act on.
    ids = torch.randint(0, min(vocab, 40), (n,), generator=torch.Generator().manual_seed(3))
    return ids.tolist()


def _run_kernel(
    shape: str, sampling: SamplingParams
) -> tuple[list[int], torch.Tensor, list[TokenLogprobs]]:
    """The kernel's tokens (every one drawn by the kernel: the first from its first step),
    each step's raw logits, and the logprobs records."""
    cfg, mk = _backend(shape)
    prompt = _prompt(cfg.vocab_size)
    raw = torch.full((STEPS, cfg.vocab_size), float("nan"), device="cuda")
    lps: list[TokenLogprobs] = []
    got = list(
        mk.driver.run(
            prompt, STEPS, sampling, (), None, probe=Probe(debug_logits=raw), logprobs=lps
        )
    )
    torch.cuda.synchronize()
    return got, raw[: len(got)].cpu(), lps


def _replay(shape: str, sampling: SamplingParams, raw: torch.Tensor) -> list[int]:
    """The host rule's token at each step, from the kernel's raw logits of that step."""
    prompt = _prompt(SHAPES[shape].vocab_size)
    out: list[int] = []
    for s in range(raw.shape[0]):
        z = penalize(raw[s], sampling, prompt, out)
        out.append(sample(z, sampling, len(prompt) + s))
    return out


CASES = [
    SamplingParams(temperature=0.0, repetition_penalty=1.6),
    SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7),
    SamplingParams(temperature=0.0, logit_bias={7: 6.0, 11: -100.0, 500: 3.5}),
    SamplingParams(temperature=0.9, seed=4, frequency_penalty=0.8, repetition_penalty=1.2),
    SamplingParams(temperature=0.9, seed=5, min_p=0.2),
    SamplingParams(temperature=1.1, seed=6, min_p=0.05, top_k=20, top_p=0.9, presence_penalty=1),
]


@pytest.mark.parametrize("sampling", CASES, ids=lambda p: ",".join(p.penalty_fields()))
def test_the_kernel_draws_by_the_hosts_rule(sampling: SamplingParams) -> None:
    got, raw, _ = _run_kernel("odd", sampling)
    assert len(got) == STEPS
    assert got == _replay("odd", sampling, raw)
    # Not vacuous: the same steps without the rule give other tokens.
    plain = SamplingParams(
        temperature=sampling.temperature,
        seed=sampling.seed,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
    )
    assert _replay("odd", plain, raw) != got


@pytest.mark.parametrize("shape", ["odd", "llama-3.2-1b"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_raw_logits_log_softmax(shape: str, temperature: float) -> None:
    sampling = SamplingParams(temperature=temperature, seed=9, logprobs=5, frequency_penalty=0.5)
    got, raw, lps = _run_kernel(shape, sampling)
    assert len(lps) == len(got) == STEPS
    assert got == _replay(shape, sampling, raw)
    for s, (token, lp) in enumerate(zip(got, lps, strict=True)):
        want = token_logprobs(raw[s], token, 5)
        assert abs(lp.logprob - want.logprob) <= 1e-4, (s, lp, want)
        assert [i for i, _ in lp.top] == [i for i, _ in want.top], (s, lp, want)
        for (_, a), (_, b) in zip(lp.top, want.top, strict=True):
            assert abs(a - b) <= 1e-4, (s, lp, want)


def test_a_request_gets_every_tokens_logprobs() -> None:
    """Through the backend's stream: the first token's from the prefill, the rest from the
    kernel; greedy without penalties, so each token is its own top alternative."""
    cfg, mk = _backend("odd")
    sampling = SamplingParams(temperature=0.0, logprobs=3)
    lps: list[TokenLogprobs] = []
    req = DecodeRequest(tuple(_prompt(cfg.vocab_size)), sampling, 20, frozenset(), None, lps)
    ids = list(mk.stream(req, CancelToken()))
    assert len(ids) == len(lps) == 20
    for token, lp in zip(ids, lps, strict=True):
        assert lp.top[0][0] == token and abs(lp.top[0][1] - lp.logprob) < 1e-6
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1] and lp.logprob <= 0
