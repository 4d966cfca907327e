"""Prefix reuse on the GPU: the same greedy tokens with reuse on and off over a multi-turn
conversation (live cache and snapshot paths) and after a cancelled request, and a prompt
over the context refused before any GPU work. Marker ``gpu``; needs Hopper.

Reuse changes which arithmetic wrote a cached position (the kernel's fp32 GEMV for
generated tokens, the prefill's bf16 GEMMs otherwise) but not the tokens: the LM head rows
get heavy-tailed norms, as in test_backend's greedy test, so the argmax is never a near
tie that rounding could flip.
"""

from __future__ import annotations

import functools

import pytest
import torch

from monokernel.errors import InvalidRequestError
from monokernel.models.shapes import SHAPES
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.sampling import SamplingParams
from monokernel.testing.gpu_models import needs_hopper
from monokernel.testing.oracle import peaked
from monokernel.weights.random_weights import random_weights

pytestmark = [
    pytest.mark.gpu,
    needs_hopper,
]

MAX_LEN = 2048


@functools.lru_cache(maxsize=1)
def _backend():  # type: ignore[no-untyped-def]
    from monokernel.runtime.backends.monokernel import MonokernelBackend

    cfg = SHAPES["llama-3.2-1b"]
    dev = torch.device("cuda")
    weights = peaked(cfg, random_weights(cfg, device=dev, seed=12))
    return cfg, MonokernelBackend(cfg, weights, MAX_LEN, dev)


def _tokens(n: int, seed: int) -> list[int]:
    vocab = SHAPES["llama-3.2-1b"].vocab_size
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(mk, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    req = DecodeRequest(tuple(prompt), SamplingParams(temperature=0.0), n, frozenset())
    out = list(mk.stream(req, CancelToken()))
    assert len(out) == n
    return out


def _spy_prefill(mk) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    """Record (start, tokens) of every prefill call from now on."""
    calls: list[tuple[int, int]] = []
    prefill = mk.kv.prefill
    run = type(prefill).run

    def spy(ids, start, logits=False):  # type: ignore[no-untyped-def]
        calls.append((start, len(ids)))
        return run(prefill, ids, start, logits=logits)

    prefill.run = spy
    return calls


def _conversation(mk) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Conversation P over two turns, then Q (sharing P's first 100 tokens, a system
    prompt), then P's third turn."""
    p1 = _tokens(300, seed=20)
    g1 = _greedy(mk, p1, 48)
    p2 = [*p1, *g1, *_tokens(200, seed=21)]
    g2 = _greedy(mk, p2, 48)
    q = [*p1[:100], *_tokens(250, seed=22)]
    h = _greedy(mk, q, 32)
    p3 = [*p2, *g2, *_tokens(50, seed=23)]
    g3 = _greedy(mk, p3, 48)
    return [g1, g2, h, g3]


def test_reuse_on_and_off_give_the_same_greedy_tokens() -> None:
    _, mk = _backend()
    mk.set_prefix_reuse(False)
    off = _conversation(mk)
    mk.set_prefix_reuse(True)  # also forgets what the reuse-off run left in the cache
    calls = _spy_prefill(mk)
    try:
        on = _conversation(mk)
    finally:
        del mk.kv.prefill.run
    assert on == off
    # P1 from scratch; P2 after P1 and 47 fed outputs (the 48th is never written); Q after
    # the shared 100 tokens; P3 from the snapshot of P2 + 47 outputs, kept while Q ran. The
    # prefill covers each prompt's last token too when it draws the first token.
    last = int(mk.first_from_prefill)
    assert calls == [(0, 299 + last), (347, 200 + last), (100, 249 + last), (595, 50 + last)]


def test_a_cancelled_request_leaves_a_reusable_cache() -> None:
    """Cancel after 5 tokens (the kernel may have run further), continue the conversation
    from what the client saw: the same tokens as without reuse."""
    _, mk = _backend()
    prompt = _tokens(200, seed=30)
    outs = {}
    for reuse in (False, True):
        mk.set_prefix_reuse(reuse)
        cancel = CancelToken()
        req = DecodeRequest(tuple(prompt), SamplingParams(temperature=0.0), 500, frozenset())
        it = mk.stream(req, cancel)
        head = [next(it) for _ in range(5)]
        cancel.set()
        assert list(it) == []
        live = mk.prefix.live
        assert len(live) >= len(prompt) + 4 and live[: len(prompt) + 4] == (*prompt, *head[:4])
        outs[reuse] = _greedy(mk, [*prompt, *head, *_tokens(20, seed=31)], 32)
    assert outs[True] == outs[False]


def test_prompt_over_the_context_is_refused_before_any_gpu_work() -> None:
    _, mk = _backend()
    mk.set_prefix_reuse(True)
    _greedy(mk, _tokens(50, seed=40), 4)
    live = mk.prefix.live
    calls = _spy_prefill(mk)
    launches: list[int] = []
    build = mk.kernels
    launch, launch_short = build.full.launch, build.short.launch
    build.full.launch = lambda *a: launches.append(1) or launch(*a)
    build.short.launch = lambda *a: launches.append(1) or launch_short(*a)
    try:
        req = DecodeRequest(
            tuple(_tokens(MAX_LEN + 1, seed=41)), SamplingParams(temperature=0.0), 4, frozenset()
        )
        with pytest.raises(InvalidRequestError, match="exceeds max_seq_len"):
            next(iter(mk.stream(req, CancelToken())))
    finally:
        del mk.kv.prefill.run, build.full.launch, build.short.launch
    assert calls == [] and launches == [] and mk.prefix.live == live
