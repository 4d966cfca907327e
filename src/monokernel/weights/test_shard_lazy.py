"""--tp N on a GGUF whose layer matrices are its own groups: no rank makes one dense.

A GGUF loads as a LazyWeights (weights/lazy_weights.py) that makes a layer matrix dense
only when read. Each rank packs those matrices from its blocks of the groups
(``shard_groups``), so sharding must read only what the rank holds dense (embedding, head,
norms, biases); read them all and a 32B Q4_K_M holds ~130 GB of float32 on the host. What
a rank gets is compared with what the path that read every matrix gave it, bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from monokernel.errors import TensorShapeError, UnexpectedTensorError
from monokernel.models.config import ModelConfig, config_from_hf_dict
from monokernel.runtime.backends.monokernel.tp import rank_tensors
from monokernel.testing.tiny_models import tiny_hf_config
from monokernel.weights.group_quant import GroupQuant, quantize_rtn
from monokernel.weights.lazy_weights import DenseSource, LazyWeights
from monokernel.weights.loader import Checkpoint
from monokernel.weights.names import Weights, check_weight_shapes, check_weights
from monokernel.weights.quantize import is_quantized
from monokernel.weights.random_weights import random_weights
from monokernel.weights.shard import shard_groups, shard_weights

TP = 2
CPU = torch.device("cpu")


def _tiny(family: str, **sizes: Any) -> ModelConfig:
    return dataclasses.replace(config_from_hf_dict(tiny_hf_config(family).to_dict()), **sizes)


def _q4_k_m(tmp_path: Path, arch: str) -> Checkpoint:
    """A Q4_K_M file (Q4_K layers, V and down in Q6_K, a Q4_K embedding and a Q6_K head)."""
    pytest.importorskip("gguf")
    from monokernel.weights.loader import load_checkpoint
    from monokernel.weights.test_gguf_loader import QT, k_quant_gguf

    edge = {"token_embd.weight": QT.Q4_K, "output.weight": QT.Q6_K}
    path = k_quant_gguf(tmp_path / "m.gguf", (QT.Q4_K, QT.Q6_K), arch=arch, edge=edge)
    ckpt = load_checkpoint(path, progress=False)
    assert ckpt.groups is not None and isinstance(ckpt.weights, LazyWeights)
    assert sorted(ckpt.weights.unread()) == sorted(ckpt.groups)
    return ckpt


def _old_rank_tensors(
    cfg: ModelConfig, weights: Weights, rank: int, groups: Mapping[str, GroupQuant]
) -> tuple[Weights, dict[str, GroupQuant]]:
    """What MonokernelTPBackend gave a rank before: every matrix sharded dense, then those
    packed from the groups dropped."""
    dense = shard_weights(cfg, weights, rank, TP)
    mine = dict(shard_groups(cfg, groups, rank, TP).items())
    dense = {k: v for k, v in dense.items() if not is_quantized(k)}
    return {k: v.to(dtype=torch.bfloat16) for k, v in dense.items()}, mine


def _same_groups(got: GroupQuant, want: GroupQuant) -> bool:
    return (
        (got.group, got.bits) == (want.group, want.bits)
        and torch.equal(got.q, want.q)
        and torch.equal(got.scale.view(torch.int32), want.scale.view(torch.int32))
        and torch.equal(got.offset.view(torch.int32), want.offset.view(torch.int32))
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # llama: Q/K groups unpermuted at load
def test_tp2_ranks_of_a_q4_k_m_make_no_layer_matrix(
    tmp_path: Path, arch: str, made: list[tuple[int, ...]]
) -> None:
    ckpt = _q4_k_m(tmp_path, arch)
    cfg, groups = ckpt.config, ckpt.groups
    assert groups is not None
    made.clear()  # the embedding and the head, made at load
    from monokernel.weights.safetensors_loader import cast_weights

    weights = cast_weights(ckpt.weights, torch.bfloat16, CPU)  # Engine.__init__ for --tp
    group = max(g.group for g in groups.values())
    ranks = [rank_tensors(cfg, weights, r, TP, CPU, "int8", groups, group) for r in range(TP)]
    assert made == []  # no layer matrix made dense, on any rank
    assert sorted(weights.unread()) == sorted(groups)  # type: ignore[attr-defined]
    # The path that read every matrix, on a copy of the same mapping (made there alone).
    full = dict(weights.copy())  # type: ignore[attr-defined]
    assert len(made) == len(groups)
    for r, (shard, mine) in enumerate(ranks):
        want_shard, want_mine = _old_rank_tensors(cfg, full, r, groups)
        assert list(shard) == list(want_shard)
        assert not any(is_quantized(k) for k in shard)
        for k, v in shard.items():
            assert v.dtype == torch.bfloat16 and torch.equal(v, want_shard[k]), k
        assert mine is not None and set(mine) == set(want_mine) == set(groups)
        for k, g in mine.items():
            assert _same_groups(g, want_mine[k]), k
            # The rank's blocks are those rows / columns of the matrix the old path read.
            dense = shard_weights(cfg, full, r, TP)[k]
            torch.testing.assert_close(g.dense().to(torch.bfloat16), dense, rtol=2**-7, atol=0)


def test_a_plain_dict_shards_as_before_less_the_packed_matrices() -> None:
    cfg = _tiny("qwen3", num_heads=8, num_kv_heads=4, intermediate_size=104)
    w = random_weights(cfg, dtype=torch.float32, seed=4)
    packed = {k for k in w if is_quantized(k)}
    for r in range(TP):
        old = shard_weights(cfg, w, r, TP)
        new = shard_weights(cfg, w, r, TP, packed)
        assert list(new) == [k for k in old if k not in packed]
        assert all(torch.equal(new[k], old[k]) for k in new)
        assert new["embed"] is w["embed"]  # replicated, not copied


def test_int4_and_dense_ranks_still_read_what_they_pack(made: list[tuple[int, ...]]) -> None:
    """Without a checkpoint's groups a rank packs the dense values (its bf16 copy, or
    --quantize int4 of them): those are read, and equal the old path's."""
    cfg = _tiny(
        "llama3", hidden_size=128, num_heads=8, num_kv_heads=4, head_dim=32, intermediate_size=256
    )
    w = random_weights(cfg, dtype=torch.float32, seed=5)
    lazy = LazyWeights(
        {k: DenseSource(quantize_rtn(v, 32)) if is_quantized(k) else v for k, v in w.items()}
    )
    full = dict(lazy.copy())
    made.clear()
    shard, mine = rank_tensors(cfg, lazy, 1, TP, CPU)
    assert mine is None and len(made) == 7 * cfg.num_layers
    want = shard_weights(cfg, full, 1, TP)
    assert list(shard) == list(want)
    assert all(torch.equal(shard[k], want[k].to(torch.bfloat16)) for k in shard)
    shard, mine = rank_tensors(cfg, full, 1, TP, CPU, "int4", group=32)
    assert mine is not None and set(mine) == {k for k in full if is_quantized(k)}
    for k, g in mine.items():
        assert _same_groups(g, quantize_rtn(want[k].to(torch.bfloat16), 32)), k
    assert not any(is_quantized(k) for k in shard)


def _lazy_tiny(tied: bool) -> tuple[ModelConfig, LazyWeights]:
    cfg = _tiny(
        "llama3",
        hidden_size=64,
        head_dim=16,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        tie_word_embeddings=tied,
    )
    w = random_weights(cfg, dtype=torch.float32, seed=6)
    return cfg, LazyWeights(
        {k: DenseSource(quantize_rtn(v, 32)) if is_quantized(k) else v for k, v in w.items()}
    )


def test_names_and_shapes_are_checked_without_reading(made: list[tuple[int, ...]]) -> None:
    cfg, lazy = _lazy_tiny(tied=False)
    check_weight_shapes(lazy, cfg)
    assert made == [] and len(lazy.unread()) == 7 * cfg.num_layers
    bad = lazy.copy()
    bad["layers.1.w_up"] = DenseSource(quantize_rtn(torch.randn(64, 96), 32))  # type: ignore[assignment]
    with pytest.raises(TensorShapeError, match=r"layers\.1\.w_up has shape \(64, 96\)"):
        shard_weights(cfg, bad, 0, TP, set(lazy.unread()))
    assert made == []


def test_a_tied_head_is_compared_but_left_where_it_is() -> None:
    cfg, lazy = _lazy_tiny(tied=True)
    lazy["lm_head"] = lazy["embed"].clone()
    check_weight_shapes(lazy, cfg)  # equal: accepted, and kept (shard_weights' view)
    assert "lm_head" in lazy
    assert "lm_head" not in check_weights(lazy, cfg)  # the loaders' check drops it
    lazy["lm_head"] = lazy["embed"] + 1
    with pytest.raises(UnexpectedTensorError, match="lm_head differs from embed"):
        check_weight_shapes(lazy, cfg)
    assert "lm_head" in lazy
