"""Prefix reuse end to end on the CPU: a stand-in for the decode kernel (one-token prefill
steps writing the same cache) over multi-turn conversations, with reuse on and off."""

from __future__ import annotations

import pytest
import torch

from monokernel.models.transformer import KVCache
from monokernel.runtime.kv_filler import CacheFiller
from monokernel.runtime.kv_memory import kv_bytes_per_token
from monokernel.runtime.prefill import Prefiller
from monokernel.runtime.prefix_cache import PrefixCache, fed_tokens
from monokernel.runtime.test_prefill import CONFIGS
from monokernel.weights.random_weights import random_weights
from monokernel.weights.repack import repack

CFG = CONFIGS["qwen3"]
MAX_LEN = 160


def _filler(
    reuse: bool, budget_tokens: int = 0, precision: str = "fp32", can_allocate: bool = True
) -> CacheFiller:
    weights = random_weights(CFG, dtype=torch.float32, seed=7, logit_scale=4.0)
    packed = repack(CFG, weights, MAX_LEN, fold=False)
    cache = KVCache.allocate(CFG, MAX_LEN, torch.float32, "cpu")
    prefill = Prefiller(CFG, packed, cache.k, cache.v, chunk_tokens=16, precision=precision)
    bpt = kv_bytes_per_token(CFG, 4)
    prefix = PrefixCache(bpt, budget_tokens * bpt, enabled=reuse, min_snapshot_tokens=8)
    return CacheFiller(prefill, prefix, lambda _n: can_allocate)


def _generate(f: CacheFiller, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decode the way the kernel does it: positions [0, len-1) filled, then step s
    feeds one token at position len-1+s (writing its K/V) and takes the argmax."""
    f.fill(prompt, len(prompt) - 1)
    token, out, logits = prompt[-1], [], []
    for s in range(n):
        step = f.prefill.run([token], len(prompt) - 1 + s, logits=True)
        assert step is not None
        logits.append(step)
        token = int(step.argmax())
        out.append(token)
    f.prefix.finish(prompt, fed_tokens(prompt, out, n))
    return out, torch.stack(logits)


def _ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist()


def _conversation(f: CacheFiller) -> list[tuple[list[int], torch.Tensor]]:
    """Two turns of A, a different conversation B, then A again: the live cache serves
    turn 2, a snapshot (when there is a budget) serves A's return."""
    system = _ids(20, 0)
    a1 = [*system, *_ids(12, 1)]
    outs = [_generate(f, a1, 6)]
    a2 = [*a1, *outs[0][0], *_ids(9, 2)]
    outs.append(_generate(f, a2, 6))
    b = [*system, *_ids(30, 3)]
    outs.append(_generate(f, b, 6))
    a3 = [*a2, *outs[1][0], *_ids(5, 4)]
    outs.append(_generate(f, a3, 6))
    return outs


@pytest.mark.parametrize("budget_tokens", [0, 1000])
def test_reuse_gives_the_same_tokens_and_logits(budget_tokens: int) -> None:
    off = _conversation(_filler(reuse=False))
    on_filler = _filler(reuse=True, budget_tokens=budget_tokens)
    on = _conversation(on_filler)
    for (tok_off, log_off), (tok_on, log_on) in zip(off, on, strict=True):
        assert tok_on == tok_off
        assert float((log_on - log_off).norm() / log_off.norm()) < 1e-5
    if budget_tokens:
        assert on_filler.prefix.snapshots, "A's cache should have been kept while B ran"


def test_reuse_skips_the_shared_prefix() -> None:
    f = _filler(reuse=True, budget_tokens=1000)
    calls: list[tuple[int, int]] = []
    run = f.prefill.run

    def spy(tokens, start, logits=False):  # type: ignore[no-untyped-def]
        if len(tokens) > 1:  # the prompt prefills, not the one-token decode steps
            calls.append((start, len(tokens)))
        return run(tokens, start, logits=logits)

    f.prefill.run = spy  # type: ignore[method-assign]
    _conversation(f)
    a1, a2 = 20 + 12, 20 + 12 + 6 + 9
    b = 20 + 30
    # A1 from scratch; A2 after A1's prompt and its 5 fed outputs; B after the shared system
    # prompt; A3 from A's snapshot, which held A2 and its 5 fed outputs.
    assert calls == [(0, a1 - 1), (a1 + 5, a2 - 1 - (a1 + 5)), (20, b - 1 - 20), (a2 + 5, 5)]


def test_no_snapshot_when_memory_is_short() -> None:
    f = _filler(reuse=True, budget_tokens=1000, can_allocate=False)
    _conversation(f)
    assert f.prefix.snapshots == ()


def test_prefill_logits_with_reuse_match_without() -> None:
    on, off = _filler(reuse=True), _filler(reuse=False)
    prompt = _ids(40, 9)
    for f in (on, off):
        f.fill(prompt[:30], 30, logits=True)  # leaves 30 positions cached
    got, want = on.fill(prompt, 40, logits=True), off.fill(prompt, 40, logits=True)
    assert got is not None and want is not None
    assert float((got - want).norm() / want.norm()) < 1e-5
    assert on.prefix.live == tuple(prompt)


def test_default_precision_reuse_is_close() -> None:
    off = _conversation(_filler(reuse=False, precision="split-qkv"))
    on = _conversation(_filler(reuse=True, budget_tokens=1000, precision="split-qkv"))
    for (_, log_off), (_, log_on) in zip(off, on, strict=True):
        # bf16 GEMM inputs: a different chunking can flip a rounding (test_prefill.py)
        assert float((log_on - log_off).norm() / log_off.norm()) < 2e-3
