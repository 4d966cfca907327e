"""Logit processing (sampling.penalize, min_p): the rule against a direct recomputation,
and the reference and torch engines applying it identically."""

from __future__ import annotations

import math

import pytest
import torch

from monokernel.errors import InvalidRequestError
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.backends.reference import ReferenceBackend
from monokernel.runtime.backends.torch_compiled import TorchBackend
from monokernel.runtime.sampling import (
    SamplingParams,
    penalize,
    probabilities,
    sample,
    unsupported_sampling_reason,
)
from monokernel.weights.random_weights import random_weights
from monokernel.weights.test_repack import CONFIGS


def _direct(
    logits: list[float], p: SamplingParams, prompt: list[int], output: list[int]
) -> list[float]:
    """The rule written out token by token, in plain Python."""
    bias = dict(p.logit_bias)
    out = []
    for t, x in enumerate(logits):
        x += bias.get(t, 0.0)
        if t in prompt or t in output:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        n = output.count(t)
        x -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
        out.append(x)
    return out


CASES = [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(frequency_penalty=-1.0),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.8),
    SamplingParams(logit_bias={3: 5.0, 10: -2.5}),
    SamplingParams(
        presence_penalty=-0.5,
        frequency_penalty=0.4,
        repetition_penalty=1.2,
        logit_bias={0: 1.0, 6: -7.0},
    ),
]


@pytest.mark.parametrize("vocab", [11, 97, 1001])
@pytest.mark.parametrize("params", CASES, ids=lambda p: ",".join(p.penalty_fields()))
def test_penalize_matches_direct(vocab: int, params: SamplingParams) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(vocab, generator=g) * 3
    prompt = torch.randint(0, vocab, (7,), generator=g).tolist()
    output = torch.randint(0, vocab, (9,), generator=g).tolist() + [vocab - 1] * 3
    got = penalize(logits, params, prompt, output)
    want = torch.tensor(_direct(logits.tolist(), params, prompt, output))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    assert torch.equal(logits, logits.clone())  # not modified in place


def test_neutral_params_leave_logits_alone() -> None:
    logits = torch.randn(13)
    assert torch.equal(penalize(logits, SamplingParams(), [1, 2], [3, 3]), logits)
    assert not SamplingParams().penalized


def test_masked_logits_stay_masked() -> None:
    logits = torch.tensor([1.0, float("-inf"), -2.0, float("-inf")])
    p = SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, logit_bias={1: 100})
    got = penalize(logits, p, [0, 1], [1, 2, 3])
    assert got[1] == float("-inf") and got[3] == float("-inf")


@pytest.mark.parametrize("vocab", [7, 131])
def test_logit_bias_forces_and_bans(vocab: int) -> None:
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 5
    top = int(torch.argmax(logits))
    forced = vocab - 2 if top != vocab - 2 else 0
    for temperature in (0.0, 1.0):
        force = SamplingParams(temperature=temperature, seed=3, logit_bias={forced: 100})
        for pos in range(5):
            assert sample(penalize(logits, force, [], []), force, pos) == forced
        ban = SamplingParams(temperature=temperature, seed=3, logit_bias={top: -100})
        draws = {sample(penalize(logits, ban, [], []), ban, pos) for pos in range(20)}
        assert top not in draws


@pytest.mark.parametrize("vocab", [9, 257])
@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_matches_direct(vocab: int, min_p: float) -> None:
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * 2
    t = 0.8
    p = SamplingParams(temperature=t, min_p=min_p, seed=11)
    z = [x / t for x in logits.tolist()]
    m = max(z)
    weights = [math.exp(x - m) for x in z]
    total = sum(weights)
    keep = [w / total >= min_p * (1 / total) for w in weights]  # p_max = 1 / total
    kept_total = sum(w for w, k in zip(weights, keep, strict=True) if k)
    want = torch.tensor([w / kept_total if k else 0.0 for w, k in zip(weights, keep, strict=True)])
    torch.testing.assert_close(probabilities(logits, p), want, rtol=1e-5, atol=1e-7)
    kept = {i for i, k in enumerate(keep) if k}
    assert {sample(logits, p, pos) for pos in range(50)} <= kept
    # Greedy is unchanged by min_p.
    g = SamplingParams(temperature=0, min_p=min_p)
    assert sample(logits, g, 0) == int(torch.argmax(logits))


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be > 0"),
        ({"min_p": -0.1}, "min_p must be in [0, 1]"),
        ({"logit_bias": {3: 101.0}}, "logit_bias values must be in [-100, 100]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"3": 1.0}}, "logit_bias keys must be token ids"),
    ],
)
def test_validation_names_the_field(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match=fragment.replace("[", r"\[")):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_logit_bias_past_the_vocabulary_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="past the vocabulary"):
        penalize(torch.zeros(5), SamplingParams(logit_bias={5: 1.0}), [], [])


def test_unsupported_reason() -> None:
    p = SamplingParams(min_p=0.1)
    assert unsupported_sampling_reason(SamplingParams(), "monokernel") is None
    assert unsupported_sampling_reason(p, "torch") is None
    assert unsupported_sampling_reason(p, "reference") is None
    assert unsupported_sampling_reason(SamplingParams(logprobs=2), "monokernel") is None
    why = unsupported_sampling_reason(p, "other") or ""
    assert why.startswith("min_p ") and "reference, torch, monokernel engines" in why


# ---- the engines ---------------------------------------------------------------------------

CPU = torch.device("cpu")
PROMPT = (3, 1, 4, 1, 5, 9, 2, 6)


def _run(backend: str, params: SamplingParams, n: int = 24, name: str = "odd") -> list[int]:
    cfg = CONFIGS[name]
    weights = random_weights(cfg, dtype=torch.float32, seed=5, logit_scale=4.0)
    cls = ReferenceBackend if backend == "reference" else TorchBackend
    req = DecodeRequest(PROMPT, params, n, frozenset())
    return list(cls(cfg, weights, 64, CPU).stream(req, CancelToken()))


ENGINE_CASES = [
    SamplingParams(temperature=0, frequency_penalty=1.0),
    SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5),
    SamplingParams(temperature=0.9, seed=7, min_p=0.1, top_k=20, logit_bias={7: 3.0}),
    SamplingParams(
        temperature=1.0, seed=2, frequency_penalty=-0.5, repetition_penalty=0.9, min_p=0.02
    ),
]


@pytest.mark.parametrize("params", ENGINE_CASES, ids=lambda p: ",".join(p.penalty_fields()))
def test_torch_matches_reference(params: SamplingParams) -> None:
    assert _run("torch", params) == _run("reference", params)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_greedy_logit_bias_forces_a_token(backend: str) -> None:
    assert _run(backend, SamplingParams(temperature=0, logit_bias={42: 100.0}), 6) == [42] * 6


def _repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def test_frequency_penalty_reduces_repeats() -> None:
    # 97 tokens of vocabulary, 56 generated: greedy decoding loops on this model.
    plain = _run("reference", SamplingParams(temperature=0), 56, "qwen3-qknorm")
    penalized = _run(
        "reference", SamplingParams(temperature=0, frequency_penalty=2.0), 56, "qwen3-qknorm"
    )
    assert _repeats(penalized) <= _repeats(plain) // 2, (plain, penalized)
