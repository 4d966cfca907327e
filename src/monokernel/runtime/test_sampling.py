"""The sampling rule: greedy, seeds, top-k/top-p exclusion, and the distribution it draws."""

from __future__ import annotations

import math

import pytest
import torch

from monokernel.errors import InvalidRequestError
from monokernel.runtime.sampling import (
    SamplingParams,
    allowed_mask,
    draw_key,
    probabilities,
    sample,
    uniforms,
)


def _logits(n: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    z = torch.tensor([0.0, 3.0, 1.0, 3.0])
    assert sample(z, SamplingParams(temperature=0.0), position=5) == 1


def test_same_seed_same_token_different_seed_varies() -> None:
    z = torch.zeros(1000)  # uniform: only the draw decides
    p = SamplingParams(temperature=1.0, seed=7)
    first = [sample(z, p, pos) for pos in range(20)]
    assert first == [sample(z, p, pos) for pos in range(20)]
    other = [sample(z, SamplingParams(temperature=1.0, seed=8), pos) for pos in range(20)]
    assert first != other
    assert len(set(first)) > 10  # positions give fresh draws


def test_uniforms_are_in_open_interval_and_flat() -> None:
    u = uniforms(seed=123, position=9, vocab_size=200_000)
    assert float(u.min()) > 0 and float(u.max()) < 1
    hist = torch.histc(u, bins=10, min=0, max=1)
    assert float(hist.min()) > 0.97 * 20_000 and float(hist.max()) < 1.03 * 20_000


def test_draw_key_uses_all_seed_bits() -> None:
    assert draw_key(1, 0) != draw_key(1 + (1 << 32), 0)
    assert draw_key(1, 0) != draw_key(1, 1)


@pytest.mark.parametrize("top_k", [1, 3, 17])
def test_top_k_never_emits_excluded(top_k: int) -> None:
    z = _logits()
    allowed = set(torch.topk(z, top_k).indices.tolist())
    p = SamplingParams(temperature=1.5, top_k=top_k, seed=11)
    assert {sample(z, p, pos) for pos in range(300)} <= allowed


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9])
def test_top_p_never_emits_excluded(top_p: float) -> None:
    z = _logits()
    probs = torch.softmax(z, -1)
    order = torch.argsort(probs, descending=True)
    cum = torch.cumsum(probs[order], 0)
    n_keep = int((cum < top_p).sum()) + 1  # the smallest prefix reaching top_p
    allowed = set(order[:n_keep].tolist())
    p = SamplingParams(temperature=1.0, top_p=top_p, seed=3)
    seen = {sample(z, p, pos) for pos in range(400)}
    assert seen <= allowed
    assert int(allowed_mask(z, 0, top_p).sum()) == n_keep


def test_top_k_keeps_ties_at_the_boundary() -> None:
    z = torch.tensor([5.0, 4.0, 4.0, 1.0])
    assert allowed_mask(z, 2, 1.0).tolist() == [True, True, True, False]


def test_draws_follow_the_restricted_softmax() -> None:
    z = _logits(12, seed=5)
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.95, seed=0)
    expected = probabilities(z, params)
    n = 6000
    counts = torch.zeros(12)
    for s in range(n):
        counts[sample(z, SamplingParams(temperature=0.8, top_k=8, top_p=0.95, seed=s), 4)] += 1
    assert float(counts[expected == 0].sum()) == 0
    kept = expected > 0
    exp = expected[kept] * n
    chi2 = float(((counts[kept] - exp) ** 2 / exp).sum())
    dof = int(kept.sum()) - 1
    # p < 0.001 critical value is below dof + 4*sqrt(2*dof) + 10 for these dof
    assert chi2 < dof + 4 * math.sqrt(2 * dof) + 10, chi2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_bad_parameters_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_with_seed_fixes_a_seed() -> None:
    assert SamplingParams(seed=None).with_seed().seed is not None
    assert SamplingParams(seed=4).with_seed().seed == 4
