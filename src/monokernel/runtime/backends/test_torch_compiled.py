"""The torch engine produces the reference's tokens (CPU: eager; GPU: compiled + graphs)."""

from __future__ import annotations

import pytest
import torch

from monokernel.models.shapes import SHAPES
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.backends.reference import ReferenceBackend
from monokernel.runtime.backends.torch_compiled import TorchBackend
from monokernel.runtime.sampling import SamplingParams
from monokernel.weights.random_weights import random_weights
from monokernel.weights.test_repack import CONFIGS


def _request(prompt: list[int], n: int, sampling: SamplingParams) -> DecodeRequest:
    return DecodeRequest(tuple(prompt), sampling, n, frozenset())


@pytest.mark.parametrize("name", ["llama3-tied", "qwen3-qknorm", "odd"])
def test_cpu_matches_reference(name: str) -> None:
    cfg = CONFIGS[name]
    weights = random_weights(cfg, dtype=torch.float32, seed=5, logit_scale=4.0)
    cpu = torch.device("cpu")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for sampling in (
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_k=10, top_p=0.9, seed=7),
    ):
        req = _request(prompt, 24, sampling)
        ref = list(ReferenceBackend(cfg, weights, 64, cpu).stream(req, CancelToken()))
        got = list(TorchBackend(cfg, weights, 64, cpu).stream(req, CancelToken()))
        assert got == ref


@pytest.mark.gpu
def test_gpu_compiled_greedy_matches_reference() -> None:
    cfg = SHAPES["smollm2-135m"]
    dev = torch.device("cuda")
    weights = random_weights(cfg, device=dev, dtype=torch.bfloat16, seed=2, logit_scale=8.0)
    req = _request(list(range(10, 74)), 64, SamplingParams(temperature=0.0))
    ref = list(ReferenceBackend(cfg, weights, 256, dev).stream(req, CancelToken()))
    eng = TorchBackend(cfg, weights, 256, dev)
    assert list(eng.stream(req, CancelToken())) == ref
    assert list(eng.stream(req, CancelToken())) == ref  # second request reuses the graph


@pytest.mark.gpu
def test_gpu_speculation_without_a_draft_runs_the_compiled_step() -> None:
    """A pass that drafted nothing replays the compiled step, not an eager forward: the ids
    of the run without --speculative. (A 64-token suffix never recurs in this request.)"""
    from monokernel.runtime.speculative import SpeculativeConfig

    cfg = SHAPES["smollm2-135m"]
    dev = torch.device("cuda")
    weights = random_weights(cfg, device=dev, dtype=torch.bfloat16, seed=2, logit_scale=8.0)
    req = _request(list(range(10, 74)), 48, SamplingParams(temperature=0.0))
    eng = TorchBackend(cfg, weights, 256, dev)
    plain = list(eng.stream(req, CancelToken()))
    calls: list[int] = []
    forward = eng._forward

    def counted(tokens: list[int], start: int) -> torch.Tensor:
        calls.append(start)
        return forward(tokens, start)

    eng._forward = counted  # type: ignore[method-assign]
    eng.set_speculative(SpeculativeConfig(num_tokens=4, ngram_min=64, ngram_max=64))
    assert list(eng.stream(req, CancelToken())) == plain
    assert calls == [] and eng.speculation is not None and eng.speculation.passes == 0
