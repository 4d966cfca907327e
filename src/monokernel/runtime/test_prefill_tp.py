"""The sharded prefill (prefill_tp.py) against the one-rank prefill, on the CPU: every rank's
cache holds its KV heads of the whole model's, for N = 2 and 3, with biases, q/k norms and
an odd shape, in chunks and from a start offset."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from monokernel.models.config import ModelConfig
from monokernel.models.shapes import SHAPES
from monokernel.models.transformer import KVCache
from monokernel.runtime.prefill import Prefiller
from monokernel.runtime.prefill_tp import ShardedPrefill
from monokernel.runtime.test_prefill import CONFIGS
from monokernel.weights.random_weights import random_weights
from monokernel.weights.repack import repack
from monokernel.weights.shard import rank_config, shard_config, shard_weights

CASES: dict[str, tuple[ModelConfig, int]] = {
    "llama-tied-bias tp2": (CONFIGS["llama-tied-bias"], 2),
    "qwen3 tp2": (CONFIGS["qwen3"], 2),
    "mha tp3": (dataclasses.replace(CONFIGS["mha"], intermediate_size=138), 3),
    "odd tp3": (
        dataclasses.replace(SHAPES["odd"], num_heads=6, num_kv_heads=3, intermediate_size=1299),
        3,
    ),
}


def _prefiller(cfg: ModelConfig, weights: dict, max_len: int, precision: str, chunk: int):
    packed = repack(cfg, weights, max_len, fold=False)
    cache = KVCache.allocate(cfg, max_len, torch.float32, "cpu")
    return Prefiller(cfg, packed, cache.k, cache.v, chunk, precision)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("precision", ["fp32", "split-qkv"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_rank_holds_its_heads_of_the_whole_prefill(case: str, precision: str) -> None:
    cfg, tp = CASES[case]
    weights = random_weights(cfg, dtype=torch.float32, seed=5)
    tokens = torch.randint(0, cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(6))
    whole = _prefiller(cfg, weights, 40, precision, 16)
    want_logits = whole.run(tokens, 0, logits=True)
    assert want_logits is not None
    ranks = []
    for r in range(tp):
        sc = shard_config(cfg, r, tp)
        shard = {k: v.clone() for k, v in shard_weights(cfg, weights, r, tp).items()}
        ranks.append(_prefiller(rank_config(sc), shard, 40, precision, 16))
    sharded = ShardedPrefill(ranks)
    sharded.run(tokens[:20], 0)  # two calls, the second from an offset, in chunks of 16
    got_logits = sharded.run(tokens[20:], 20, logits=True)
    tol = 1e-5 if precision == "fp32" else 1e-2
    # The last token's logits: each rank's vocabulary range, side by side in rank order.
    assert got_logits is not None and got_logits.shape == want_logits.shape
    assert _rel(got_logits, want_logits) < tol
    for r, pf in enumerate(ranks):
        h = cfg.num_kv_heads // tp
        k_want = whole.k[:, r * h : (r + 1) * h, :37]
        v_want = whole.v[:, r * h : (r + 1) * h, :37]
        assert _rel(pf.k[:, :, :37], k_want) < tol, f"rank {r} keys"
        assert _rel(pf.v[:, :, :37], v_want) < tol, f"rank {r} values"
        assert not pf.k[:, :, 37:].any(), "wrote past the prompt"
    # One call in one chunk fills the same caches as two calls in chunks of 16.
    again = [
        _prefiller(
            rank_config(shard_config(cfg, r, tp)),
            {k: v.clone() for k, v in shard_weights(cfg, weights, r, tp).items()},
            40,
            precision,
            64,
        )
        for r in range(tp)
    ]
    again_logits = ShardedPrefill(again).run(tokens, 0, logits=True)
    for a, b in zip(ranks, again, strict=True):
        assert _rel(a.k[:, :, :37], b.k[:, :, :37]) < tol
    assert again_logits is not None and _rel(again_logits, want_logits) < tol


def test_refuses_bad_arguments() -> None:
    cfg, tp = CASES["qwen3 tp2"]
    weights = random_weights(cfg, dtype=torch.float32, seed=5)
    ranks = [
        _prefiller(
            rank_config(shard_config(cfg, r, tp)),
            dict(shard_weights(cfg, weights, r, tp)),
            8,
            "fp32",
            4 + r,
        )
        for r in range(tp)
    ]
    with pytest.raises(ValueError, match="chunks differ"):
        ShardedPrefill(ranks)
    with pytest.raises(ValueError, match="at least one"):
        ShardedPrefill([])
    same = ShardedPrefill(ranks[:1])
    with pytest.raises(ValueError, match="exceeds the cache"):
        same.run([1, 2, 3], 6)
    with pytest.raises(ValueError, match="at least one token"):
        same.run([], 0)


def test_a_ranks_block_graphs_count_its_packed_format() -> None:
    """A TP rank's prefill graphs run its prefill on its packed layers: in a quantised format
    their pool holds the bf16 copy of the rank's largest layer matrix (gate/up's share on the
    8B shape), which a bf16 rank does not."""
    from monokernel.runtime.prefill_tp_graphs import graph_bytes

    rank = rank_config(shard_config(SHAPES["llama-3.1-8b"], 0, 2))
    gate_up = 2 * rank.intermediate_size * rank.hidden_size
    bf16 = graph_bytes(rank, 8192, 32768, "split-qkv")
    assert graph_bytes(rank, 8192, 32768, "split-qkv", "int4") - bf16 == 2 * gate_up
