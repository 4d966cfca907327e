"""The tensor-parallel monokernel (TP=2) against the fp32 reference and the TP=1 kernel.

GPU tests (marker ``gpu``) need 2 Hopper GPUs with peer access and nvcc; the refusals at the
bottom run anywhere.
"""

from __future__ import annotations

import functools

import pytest
import torch

from monokernel.errors import BackendUnavailableError, InvalidRequestError
from monokernel.models.shapes import SHAPES
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.sampling import SamplingParams
from monokernel.testing.oracle import assert_logits_match, peaked
from monokernel.weights.random_weights import random_weights
from monokernel.weights.shard import TensorParallelError

PROMPT, STEPS = 64, 128


def _two_hoppers() -> bool:
    return (
        torch.cuda.is_available()
        and torch.cuda.device_count() >= 2
        and all(torch.cuda.get_device_capability(i) == (9, 0) for i in range(2))
    )


needs_2_hoppers = pytest.mark.skipif(not _two_hoppers(), reason="needs 2 Hopper GPUs (sm_90)")


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _request(prompt: list[int], n: int, sampling: SamplingParams, stops=()) -> DecodeRequest:
    return DecodeRequest(tuple(prompt), sampling, n, frozenset(stops))


def _peaked(cfg, seed: int) -> dict[str, torch.Tensor]:
    """Random weights whose LM-head rows have heavy-tailed norms (testing.oracle.peaked)."""
    dev = torch.device("cuda", 0)
    return peaked(cfg, random_weights(cfg, device=dev, seed=seed))


@functools.lru_cache(maxsize=1)
def _tp_setup(shape: str):
    from monokernel.runtime.backends.monokernel.tp import MonokernelTPBackend

    cfg = SHAPES[shape]
    weights = _peaked(cfg, seed=11)
    return cfg, weights, MonokernelTPBackend(cfg, weights, 1024, torch.device("cuda", 0), 2)


@pytest.mark.gpu
@needs_2_hoppers
def test_tp2_teacher_forced_logits() -> None:
    cfg, weights, tp = _tp_setup("qwen2.5-coder-1.5b")
    seq = _tokens(PROMPT + STEPS, cfg.vocab_size, seed=1)
    got = tp.teacher_forced_logits(seq[:PROMPT], seq[PROMPT:])  # [STEPS, V], shards joined
    assert_logits_match(cfg, weights, seq, PROMPT, got, "TP=2 qwen2.5-coder-1.5b")


@pytest.mark.gpu
@needs_2_hoppers
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_tp2_quantized_teacher_forced_logits(fmt: str) -> None:
    """--quantize at TP=2: each rank packs its blocks with TP=1's scales, so the reference on
    the dequantised whole weights is the oracle, as at TP=1."""
    from monokernel.runtime.backends.monokernel.tp import MonokernelTPBackend
    from monokernel.weights.quantize import DequantizedView

    cfg = SHAPES["llama-3.2-1b"]
    weights = random_weights(cfg, device=torch.device("cuda", 0), seed=12)
    tp = MonokernelTPBackend(cfg, weights, 512, torch.device("cuda", 0), 2, quantize=fmt)
    seq = _tokens(PROMPT + STEPS, cfg.vocab_size, seed=3)
    got = tp.teacher_forced_logits(seq[:PROMPT], seq[PROMPT:])
    tp.close()
    assert_logits_match(
        cfg, DequantizedView(weights, fmt), seq, PROMPT, got, f"TP=2 llama-3.2-1b {fmt}"
    )


@pytest.mark.gpu
@needs_2_hoppers
def test_tp2_greedy_matches_tp1() -> None:
    from monokernel.runtime.backends.monokernel import MonokernelBackend

    cfg, weights, tp = _tp_setup("qwen2.5-coder-1.5b")
    prompt = _tokens(PROMPT, cfg.vocab_size, seed=2)
    greedy = SamplingParams(temperature=0.0)
    got = list(tp.stream(_request(prompt, STEPS, greedy), CancelToken()))
    one = MonokernelBackend(cfg, weights, 1024, torch.device("cuda", 0))
    want = list(one.stream(_request(prompt, STEPS, greedy), CancelToken()))
    one.close()
    assert len(got) == STEPS
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    assert got == want, f"TP=2 and TP=1 greedy tokens differ first at step {first}"


@pytest.mark.gpu
@needs_2_hoppers
def test_tp2_sampling_stops_cancel_and_next_request() -> None:
    cfg, _, tp = _tp_setup("qwen2.5-coder-1.5b")
    prompt = _tokens(12, cfg.vocab_size, seed=6)
    greedy = SamplingParams(temperature=0.0)
    want = list(tp.stream(_request(prompt, 40, greedy), CancelToken()))
    assert len(want) == 40
    # Temperature sampling: the same seed draws the same tokens, another seed others.
    sp = SamplingParams(temperature=0.8, seed=123)
    runs = [list(tp.stream(_request(prompt, 32, sp), CancelToken())) for _ in range(2)]
    assert runs[0] == runs[1]
    other = SamplingParams(temperature=0.8, seed=124)
    assert list(tp.stream(_request(prompt, 32, other), CancelToken())) != runs[0]
    # A stop id ends the stream right after it is yielded, on every rank at once.
    stop_at = want[10]
    got = list(tp.stream(_request(prompt, 40, greedy, stops=[stop_at]), CancelToken()))
    assert got == want[: want.index(stop_at) + 1]
    # Cancel mid-stream: the stream ends, both kernels are gone, the next request is right.
    cancel = CancelToken()
    it = tp.stream(_request(prompt, 900, greedy), cancel)
    head = [next(it) for _ in range(5)]
    cancel.set()
    assert head == want[:5] and list(it) == []
    assert list(tp.stream(_request(prompt, 40, greedy), CancelToken())) == want
    it = tp.stream(_request(prompt, 900, greedy), CancelToken())
    next(it)
    it.close()
    assert list(tp.stream(_request(prompt, 40, greedy), CancelToken())) == want
    # top-k / top-p are refused under TP, with the reason.
    with pytest.raises(InvalidRequestError, match="top-k / top-p"):
        list(
            tp.stream(
                _request(prompt, 4, SamplingParams(temperature=1.0, top_k=5, seed=1)), CancelToken()
            )
        )


def test_tp_that_does_not_divide_the_heads_is_refused() -> None:
    from monokernel.runtime.backends.monokernel.tp import MonokernelTPBackend

    cfg = SHAPES["qwen2.5-coder-1.5b"]  # 2 KV heads: only 1 and 2 are valid
    with pytest.raises(TensorParallelError, match="valid sizes for this model: 1, 2"):
        MonokernelTPBackend(cfg, {}, 128, torch.device("cuda", 0), 4)


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() >= 8, reason="has 8 GPUs"
)
def test_more_ranks_than_gpus_is_refused() -> None:
    from monokernel.runtime.backends.monokernel.tp import MonokernelTPBackend

    cfg = SHAPES["llama-3.2-1b"]
    with pytest.raises(BackendUnavailableError, match="--tp 8 needs"):
        MonokernelTPBackend(cfg, {}, 128, torch.device("cuda", 0), 8)
