"""Tensor-parallel shards: a PyTorch TP forward built from them equals the reference forward.

The TP forward below is the spec the kernel integration has to meet: per layer, the ranks'
partial O-proj outputs and partial down-proj outputs are summed in rank order (the o bias
added once after the sum), and the token is the max over ranks of each rank's best
(score, global id), ties to the lower id.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from monokernel.models.config import ModelConfig, config_from_hf_dict
from monokernel.models.shapes import SHAPES
from monokernel.models.transformer import Transformer, linear, rms_norm
from monokernel.runtime.sampling import SamplingParams, gumbel, sample
from monokernel.testing.tiny_models import TINY_FAMILIES, make_tiny_checkpoint, tiny_hf_config
from monokernel.weights.group_quant import quantize_rtn
from monokernel.weights.names import Weights
from monokernel.weights.quantize import is_quantized
from monokernel.weights.random_weights import random_weights
from monokernel.weights.safetensors_loader import load_safetensors_weights
from monokernel.weights.shard import (
    TensorParallelError,
    check_tp_groups,
    expected_shard_shapes,
    shard_config,
    shard_fp8_blocks,
    shard_groups,
    shard_weights,
    tp_blocks_stream,
    valid_tp_sizes,
)

MAX_LEN = 64


def _tiny(family: str, wide: bool) -> ModelConfig:
    cfg = config_from_hf_dict(tiny_hf_config(family).to_dict())
    # The tiny models have 2 KV heads and intermediate 100: N=4 needs 4 KV heads and 4 | i.
    return (
        dataclasses.replace(cfg, num_heads=8, num_kv_heads=4, intermediate_size=104)
        if wide
        else cfg
    )


def all_reduce(parts: list[torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
    """Sum in rank order (what every rank computes, so all ranks agree bit for bit)."""
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p.to(acc.device)
    return acc if bias is None else acc + bias.to(acc.device)


class TPForward:
    """N ranks simulated in one process; rank r's tensors may sit on ``devices[r]``."""

    def __init__(
        self, cfg: ModelConfig, weights: Weights, tp: int, devices: list[torch.device] | None = None
    ) -> None:
        devices = devices or [weights["embed"].device] * tp
        self.cfg = cfg
        self.shards = [
            {k: v.to(devices[r]) for k, v in shard_weights(cfg, weights, r, tp).items()}
            for r in range(tp)
        ]
        self.scs = [shard_config(cfg, r, tp) for r in range(tp)]
        # The reference forward's layer code on rank-local dims yields the partial outputs;
        # the o bias is left out of it and added after the reduction.
        self.ranks = [
            Transformer(sc.layer_config(), {k: v for k, v in s.items() if ".bo" not in k}, MAX_LEN)
            for sc, s in zip(self.scs, self.shards, strict=True)
        ]
        self.caches = [t.new_cache(MAX_LEN) for t in self.ranks]

    def forward(self, tokens: torch.Tensor, start: int) -> list[torch.Tensor]:
        """Per-rank logits [T, vocab_local] float32. The replicated residual stream is the
        same on every rank, so one copy (on rank 0's device) stands for all of them."""
        cfg, w0 = self.cfg, self.shards[0]
        x = w0["embed"][tokens.to(w0["embed"].device)]
        for n in range(cfg.num_layers):
            p = f"layers.{n}."
            h = rms_norm(x, w0[p + "attn_norm"], cfg.rms_norm_eps)
            parts = [
                t._attention(h.to(t.device), n, start, c)
                for t, c in zip(self.ranks, self.caches, strict=True)
            ]
            x = x + all_reduce(parts, w0.get(p + "bo"))
            h = rms_norm(x, w0[p + "ffn_norm"], cfg.rms_norm_eps)
            x = x + all_reduce([t._mlp(h.to(t.device), n) for t in self.ranks], None)
        x = rms_norm(x, w0["norm"], cfg.rms_norm_eps)
        return [linear(x.to(s["lm_head"].device), s["lm_head"]).float() for s in self.shards]


def local_best(z: torch.Tensor, start: int) -> tuple[float, int]:
    """One rank's best (score, global id); torch.argmax takes the first of equal maxima."""
    i = int(torch.argmax(z))
    return float(z[i]), start + i


def combine_best(pairs: list[tuple[float, int]]) -> int:
    """Max score over ranks, ties to the lower id."""
    return max(pairs, key=lambda si: (si[0], -si[1]))[1]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _check_against_reference(cfg: ModelConfig, weights: Weights, tp: int) -> None:
    ref = Transformer(cfg, weights, MAX_LEN)
    ref_cache = ref.new_cache(MAX_LEN)
    tpf = TPForward(cfg, weights, tp)
    tokens = torch.randint(3, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(3))
    # Prefill 9 tokens, then decode 3 one at a time through the (per-rank) KV caches.
    chunks = [(0, 9), (9, 10), (10, 11), (11, 12)]
    params = SamplingParams(temperature=0.7, seed=5)
    for a, b in chunks:
        want = ref.forward(tokens[a:b], a, ref_cache)
        parts = tpf.forward(tokens[a:b], a)
        got = torch.cat(parts, dim=-1)
        assert got.shape == want.shape
        rel = _rel(got, want)
        assert rel <= 1e-5, f"tp={tp} positions {a}..{b}: rel err {rel:.2e}"
        # Vocab-parallel greedy and Gumbel-max on the last position (the decode step).
        pos = b  # the position of the token being drawn
        g = gumbel(params.seed, pos, cfg.vocab_size)
        greedy = [local_best(z[-1], sc.vocab_start) for z, sc in zip(parts, tpf.scs, strict=True)]
        drawn = [
            local_best(
                z[-1] / params.temperature + g[sc.vocab_start : sc.vocab_end], sc.vocab_start
            )
            for z, sc in zip(parts, tpf.scs, strict=True)
        ]
        assert combine_best(greedy) == int(torch.argmax(got[-1]))
        assert combine_best(drawn) == sample(got[-1], params, pos)
        top2 = torch.topk(want[-1], 2).values
        if float(top2[0] - top2[1]) > 1e-4:  # not a near tie: the reference agrees too
            assert combine_best(greedy) == int(torch.argmax(want[-1]))


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
@pytest.mark.parametrize(("tp", "wide"), [(1, False), (2, False), (1, True), (2, True), (4, True)])
def test_tp_forward_matches_reference(family: str, tp: int, wide: bool) -> None:
    cfg = _tiny(family, wide)
    weights = random_weights(cfg, dtype=torch.float32, seed=7, logit_scale=4.0)
    _check_against_reference(cfg, weights, tp)


def test_tp_forward_on_a_saved_checkpoint(tmp_path) -> None:
    """The same through the loader, on HF tensors (qwen3: q/k norm, untied head)."""
    from monokernel.models.config import load_hf_config

    path = make_tiny_checkpoint("qwen3", tmp_path)
    cfg = load_hf_config(path)
    _check_against_reference(cfg, load_safetensors_weights(path, cfg), 2)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shards_have_their_shapes_and_rebuild_the_weights(tp: int) -> None:
    cfg = dataclasses.replace(_tiny("llama-bias", wide=True), vocab_size=131)
    w = random_weights(cfg, dtype=torch.float32, seed=1)
    shards = [shard_weights(cfg, w, r, tp) for r in range(tp)]
    for r, s in enumerate(shards):
        shapes = expected_shard_shapes(shard_config(cfg, r, tp))
        assert {k: tuple(v.shape) for k, v in s.items()} == shapes
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        for name in ("wq", "wk", "wv", "bq", "bk", "bv", "w_gate", "w_up"):
            assert torch.equal(torch.cat([s[p + name] for s in shards]), w[p + name]), name
        for name in ("wo", "w_down"):
            assert torch.equal(torch.cat([s[p + name] for s in shards], dim=1), w[p + name])
        for name in ("attn_norm", "ffn_norm", "bo"):
            assert all(torch.equal(s[p + name], w[p + name]) for s in shards), name
    assert torch.equal(torch.cat([s["lm_head"] for s in shards]), w["lm_head"])
    assert all(s["embed"] is w["embed"] for s in shards)


@pytest.mark.parametrize("tp", [2, 4])
def test_4bit_groups_split_like_the_dense_matrices(tp: int) -> None:
    """shard_groups' blocks are the blocks of the dense model, bit for bit: the 4-bit groups
    of a rank's shard dequantise to the shard of the dequantised weights."""
    cfg = dataclasses.replace(
        _tiny("llama3", wide=True), hidden_size=128, num_heads=8, head_dim=32, intermediate_size=256
    )
    w = random_weights(cfg, dtype=torch.float32, seed=2)
    groups = {k: quantize_rtn(v, 32) for k, v in w.items() if is_quantized(k)}
    dense = {k: g.dense() for k, g in groups.items()}
    for r in range(tp):
        got = shard_groups(cfg, groups, r, tp)
        want = shard_weights(cfg, w | dense, r, tp)
        assert set(got) == set(dense)
        for k, g in got.items():
            assert torch.equal(g.dense(), want[k]), k


def test_4bit_groups_a_rank_would_cut_are_refused() -> None:
    cfg = dataclasses.replace(
        _tiny("llama3", wide=True), hidden_size=128, num_heads=8, head_dim=32, intermediate_size=192
    )
    check_tp_groups(cfg, 2, 32)  # 96 intermediate columns a rank: three groups of 32
    with pytest.raises(TensorParallelError, match=r"intermediate / tp 96 is not a multiple of 64"):
        check_tp_groups(cfg, 2, 64)
    w = random_weights(cfg, dtype=torch.float32, seed=2)
    groups = {k: quantize_rtn(v, 64) for k, v in w.items() if is_quantized(k)}
    with pytest.raises(TensorParallelError, match="cannot split over --tp 2"):
        shard_groups(cfg, groups, 0, 2)


@pytest.mark.parametrize("tp", [2, 4])
def test_fp8_block_scales_split_like_the_dense_matrices(tp: int) -> None:
    """shard_fp8_blocks gives each rank the scales of its blocks of the matrices (blocks of
    48 rows that rank boundaries cut, of 64 columns that they do not): packed with them, a
    rank's shard of the dequantised weights is its shard of the checkpoint's values."""
    from monokernel.weights.checkpoint_quant import Fp8Blocks, fp8_block_checkpoint
    from monokernel.weights.formats.fp8 import Fp8Rows

    cfg = dataclasses.replace(
        _tiny("llama3", wide=True), hidden_size=256, num_heads=8, head_dim=32, intermediate_size=512
    )
    w = random_weights(cfg, dtype=torch.float32, seed=3)
    bm, bn = 48, 64
    dense, blocks = fp8_block_checkpoint(w, bm, bn)
    dense = {k: v for k, v in dense.items() if is_quantized(k)}
    fmt = Fp8Rows(tiles=True, block=bn)
    for r in range(tp):
        mine = shard_fp8_blocks(cfg, blocks, r, tp)
        want = shard_weights(cfg, w | dense, r, tp)
        assert (mine.rows, mine.cols) == (1, bn) and set(mine.scales) == set(dense)
        for k in mine.scales:
            packed = fmt.pack(want[k], mine.row_scales(k, want[k].shape[0]))
            assert torch.equal(fmt.dense(packed, torch.float32), want[k]), k
    assert tp_blocks_stream(cfg, 2, blocks) is False  # these ranks stream rows, not tiles
    with pytest.raises(TensorParallelError, match=r"FP8 block scales of 128 columns.*tp 64"):
        shard_fp8_blocks(cfg, Fp8Blocks(bm, 128, blocks.scales), 0, 4)


def test_tied_head_is_sliced_from_the_embedding() -> None:
    cfg = _tiny("qwen2", wide=False)
    w = random_weights(cfg, dtype=torch.float32)
    s1 = shard_weights(cfg, w, 1, 2)
    sc = shard_config(cfg, 1, 2)
    assert (sc.vocab_start, sc.vocab_end) == (65, 131)  # balanced split of 131
    assert torch.equal(s1["lm_head"], w["embed"][65:131])


def test_vocab_split_is_balanced_and_covers_every_id() -> None:
    cfg = dataclasses.replace(_tiny("llama3", wide=True), vocab_size=6)
    ranges = [
        (shard_config(cfg, r, 4).vocab_start, shard_config(cfg, r, 4).vocab_end) for r in range(4)
    ]
    assert ranges == [(0, 1), (1, 3), (3, 4), (4, 6)]


def test_combine_best_breaks_ties_to_the_lower_id() -> None:
    z = torch.tensor([0.1, 2.0, 0.3, 2.0, 2.0, -1.0])  # a tie spanning the rank boundary
    for tp in (1, 2, 3):
        bounds = [(r * 6 // tp, (r + 1) * 6 // tp) for r in range(tp)]
        assert combine_best([local_best(z[a:b], a) for a, b in bounds]) == 1
    assert combine_best([(1.0, 7), (1.0, 3), (0.5, 0)]) == 3


def test_valid_sizes() -> None:
    assert valid_tp_sizes(_tiny("llama3", wide=False)) == (1, 2)
    assert valid_tp_sizes(_tiny("llama3", wide=True)) == (1, 2, 4)
    assert valid_tp_sizes(SHAPES["llama-3.2-1b"]) == (1, 2, 4, 8)
    assert valid_tp_sizes(SHAPES["qwen2.5-coder-1.5b"]) == (1, 2)


def test_refuses_kv_heads_not_divisible() -> None:
    cfg = _tiny("llama3", wide=False)  # 6 heads, 2 KV heads, intermediate 100
    with pytest.raises(TensorParallelError, match="num_key_value_heads=2") as e:
        shard_config(cfg, 0, 4)
    assert "valid sizes for this model: 1, 2" in str(e.value)
    assert isinstance(e.value, ValueError)
    with pytest.raises(TensorParallelError, match=r"num_key_value_heads=2.*intermediate_size=100"):
        shard_config(cfg, 0, 3)


def test_refuses_intermediate_not_divisible() -> None:
    cfg = dataclasses.replace(_tiny("llama3", wide=True), intermediate_size=102)
    with pytest.raises(TensorParallelError, match="intermediate_size=102") as e:
        shard_weights(cfg, random_weights(cfg, dtype=torch.float32), 0, 4)
    assert "valid sizes for this model: 1, 2" in str(e.value)
    assert "num_key_value_heads" not in str(e.value)


@pytest.mark.parametrize(("rank", "tp"), [(2, 2), (-1, 2), (0, 0)])
def test_refuses_bad_rank_or_size(rank: int, tp: int) -> None:
    with pytest.raises(TensorParallelError):
        shard_config(_tiny("llama3", wide=False), rank, tp)


@pytest.mark.gpu
def test_tp_forward_real_shape_on_gpus() -> None:
    """Qwen2.5-Coder-1.5B's shape (2 layers), rank r's shard on GPU r % count, fp32."""
    cfg = dataclasses.replace(SHAPES["qwen2.5-coder-1.5b"], num_layers=2)
    dev = torch.device("cuda", 0)
    weights = random_weights(cfg, device=dev, dtype=torch.float32, seed=2, logit_scale=4.0)
    devices = [torch.device("cuda", r % torch.cuda.device_count()) for r in range(2)]
    tpf = TPForward(cfg, weights, 2, devices)
    ref = Transformer(cfg, weights, MAX_LEN)
    tokens = torch.randint(0, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(4))
    want = ref.forward(tokens.to(dev), 0, ref.new_cache(MAX_LEN))
    got = torch.cat([z.to(dev) for z in tpf.forward(tokens, 0)], dim=-1)
    rel = _rel(got, want)
    print(f"qwen2.5-coder-1.5b shape, tp=2 on {devices}: rel err {rel:.2e}")
    assert rel <= 1e-4
