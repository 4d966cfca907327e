"""The monokernel at the sizes coding agents run (8B-32B shapes, hidden > 4096) against the
float32 reference on the same bf16 weights: teacher-forced logits and free-running greedy.

GPU tests (marker ``gpu``): a Hopper GPU with room for the shape's weights twice (the
checkpoint's and the kernel's repacked copy); the reference reads the weights through
``Float32View``, one layer's float32 matrices at a time.
"""

from __future__ import annotations

import pytest
import torch

from monokernel.models.shapes import SHAPES
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.sampling import SamplingParams
from monokernel.testing.gpu_models import hopper_with, random_ids
from monokernel.testing.oracle import assert_greedy_matches, assert_logits_match, peaked
from monokernel.weights.random_weights import random_weights

PROMPT, STEPS = 64, 256


def _needs(shape: str) -> pytest.MarkDecorator:
    """Skip unless a Hopper GPU holds the shape's bf16 weights twice and 8 GiB more."""
    gib = 2 * 2 * SHAPES[shape].num_parameters() / 2**30 + 8
    why = f"needs a Hopper GPU with {gib:.0f} GiB"
    return pytest.mark.skipif(not hopper_with(gib), reason=why)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", [pytest.param(s, marks=_needs(s)) for s in ("llama-3.1-8b", "qwen3-14b", "odd-wide")]
)
def test_teacher_forced_logits(shape: str) -> None:
    """Rel L2 of the logits <= 1e-2 at every one of 256 steps after a 64-token prompt."""
    from monokernel.runtime.backends.monokernel import MonokernelBackend

    cfg, dev = SHAPES[shape], torch.device("cuda")
    weights = random_weights(cfg, device=dev, seed=21)
    seq = random_ids(PROMPT + STEPS, cfg.vocab_size, seed=22)
    mk = MonokernelBackend(cfg, weights, PROMPT + STEPS, dev)
    got = mk.teacher_forced_logits(seq[:PROMPT], seq[PROMPT:])  # [STEPS, V]
    mk.close()
    del mk
    assert_logits_match(cfg, weights, seq, PROMPT, got, shape)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", [pytest.param(s, marks=_needs(s)) for s in ("llama-3.1-8b", "odd-wide")]
)
def test_greedy_matches_reference(shape: str) -> None:
    """Free-running greedy on peaked random weights: the reference's argmax at every step
    but rare near ties (oracle.assert_greedy_matches)."""
    from monokernel.runtime.backends.monokernel import MonokernelBackend

    cfg, dev = SHAPES[shape], torch.device("cuda")
    weights = peaked(cfg, random_weights(cfg, device=dev, seed=23))
    prompt = random_ids(PROMPT, cfg.vocab_size, seed=24)
    mk = MonokernelBackend(cfg, weights, PROMPT + STEPS, dev)
    request = DecodeRequest(tuple(prompt), SamplingParams(temperature=0.0), STEPS, frozenset())
    got = list(mk.stream(request, CancelToken()))
    mk.close()
    del mk
    assert len(got) == STEPS
    assert_greedy_matches(cfg, weights, prompt, got, shape)
