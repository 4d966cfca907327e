"""Repack + schedule interpreter == the reference forward, on the CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from monokernel.kernels.schedule import ScheduleInterpreter
from monokernel.models.config import ModelConfig, RopeScaling
from monokernel.models.shapes import SHAPES
from monokernel.models.transformer import Transformer
from monokernel.weights.formats import UnknownWeightFormatError
from monokernel.weights.random_weights import random_weights
from monokernel.weights.repack import MATRICES, fold_gain, interleave_rows, repack

_BASE = ModelConfig(
    family="llama",
    vocab_size=97,
    hidden_size=48,
    intermediate_size=72,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
CONFIGS = {
    "llama3-tied": dataclasses.replace(
        _BASE, tie_word_embeddings=True, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64)
    ),
    "qwen2-bias": dataclasses.replace(_BASE, family="qwen2", qkv_bias=True),
    "qwen3-qknorm": dataclasses.replace(_BASE, family="qwen3", qk_norm=True, num_kv_heads=1),
    "obias-mha": dataclasses.replace(_BASE, o_bias=True, num_kv_heads=4),
    "odd": SHAPES["odd"],
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_fold_and_interleave() -> None:
    w = torch.randn(6, 4)
    g = torch.randn(4)
    x = torch.randn(4)
    assert torch.allclose(fold_gain(w, g) @ x, w @ (g * x), atol=1e-6)
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    ab = interleave_rows(a, b)
    assert torch.equal(ab[0::2], a) and torch.equal(ab[1::2], b)


@pytest.mark.parametrize("fold", [True, False], ids=["folded", "gains"])
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_schedule_matches_reference(name: str, dtype: torch.dtype, tol: float, fold: bool) -> None:
    cfg = CONFIGS[name]
    weights = random_weights(cfg, dtype=dtype, seed=3)
    seq = 20
    tokens = torch.randint(0, cfg.vocab_size, (seq,), generator=torch.Generator().manual_seed(1))
    ref_w = {k: v.float() for k, v in weights.items()}  # the reference in fp32 on the same values
    ref = Transformer(cfg, ref_w, seq)
    expected = ref.forward(tokens, 0, ref.new_cache(seq))  # [seq, V]
    interp = ScheduleInterpreter(cfg, repack(cfg, weights, seq, fold=fold), seq)
    for pos in range(seq):
        got = interp.step(int(tokens[pos]), pos)
        assert _rel(got, expected[pos]) < tol, (name, pos, _rel(got, expected[pos]))


def test_tied_head_is_a_folded_copy() -> None:
    cfg = CONFIGS["llama3-tied"]
    weights = random_weights(cfg, dtype=torch.float32)
    packed = repack(cfg, weights, 8)
    assert torch.equal(packed.embed, weights["embed"])  # the table stays unfolded
    assert torch.allclose(packed.lm_head, weights["embed"] * weights["norm"])


def test_streamed_tensors_are_the_packed_matrices_data() -> None:
    """``lp.wqkv`` etc. (what the backend hands the kernel) are the packed matrices' data, in
    the format the repack names; assigning one (``use_weights``) moves only that data."""
    cfg = CONFIGS["qwen2-bias"]
    packed = repack(cfg, random_weights(cfg, seed=4), 8)
    assert packed.format == "bf16"
    lp = packed.layers[1]
    for name in MATRICES:
        m = lp.matrices[name]
        assert getattr(lp, name) is m.data and m.format == "bf16"
        assert m.shape == tuple(m.data.shape) and m.data.dtype == torch.bfloat16
    assert lp.matrices["wqkv"].shape == (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)
    assert lp.matrices["wgu"].shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    assert packed.lm_head is packed.matrices["lm_head"].data
    moved = lp.wo.clone()
    lp.wo = moved
    assert lp.matrices["wo"].data is moved and lp.matrices["wo"].shape == tuple(moved.shape)
    head = packed.lm_head.clone()
    packed.lm_head = head
    assert packed.matrices["lm_head"].data is head


def test_an_unknown_format_is_refused() -> None:
    cfg = CONFIGS["odd"]
    with pytest.raises(UnknownWeightFormatError, match="accepted formats: bf16"):
        repack(cfg, random_weights(cfg), 8, fmt="int3")


@pytest.mark.parametrize("fold", [True, False])
def test_consume_packs_the_same_and_empties_the_layers(fold: bool) -> None:
    """repack(consume=True) gives the same tensors and leaves only what it still uses (the
    embedding, the LM head, the final norm) in the caller's dict."""
    cfg = SHAPES["odd"]
    weights = random_weights(cfg, seed=4)
    want = repack(cfg, dict(weights), 64, fold=fold)
    got = repack(cfg, weights, 64, fold=fold, consume=True)
    assert not [k for k in weights if k.startswith("layers.")]
    assert set(weights) == {"embed", "lm_head", "norm"}
    for a, b in zip(want.layers, got.layers, strict=True):
        for name in MATRICES:
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(want.lm_head, got.lm_head)


def test_consume_frees_each_layers_groups_once_packed() -> None:
    """With a mapping of groups the caller gives up (a TP rank's), consume pops each layer's
    as it pops its weights: once the repack is done nothing holds them, and the packing is
    the same as from groups kept."""
    import weakref

    from monokernel.weights.group_quant import quantize_rtn
    from monokernel.weights.quantize import is_quantized

    cfg = dataclasses.replace(_BASE, hidden_size=64, intermediate_size=128, head_dim=16)
    weights = random_weights(cfg, seed=6)
    groups = {k: quantize_rtn(w, 32) for k, w in weights.items() if is_quantized(k)}
    want = repack(cfg, dict(weights), 16, fold=False, groups=dict(groups))
    alive = [weakref.ref(g.q) for g in groups.values()]
    rest = {k: v for k, v in weights.items() if not is_quantized(k)}
    got = repack(cfg, rest, 16, fold=False, consume=True, groups=groups)
    assert groups == {} and all(ref() is None for ref in alive)
    for a, b in zip(want.layers, got.layers, strict=True):
        for name in MATRICES:
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_a_checkpoints_fp8_blocks_keep_their_values() -> None:
    """repack with an FP8 checkpoint's block scales (Checkpoint.fp8_blocks) packs each
    layer's fused matrices in fp8 tiles with every weight's own block scale: the stored
    values are the checkpoint's E4M3 values, fused and interleaved as the matrices are, and
    the dense matrices its dequantised ones. Blocks of 48 rows cut the fused QKV rows and
    the gate/up pairs anywhere."""
    from monokernel.weights.checkpoint_quant import fp8_block_checkpoint, quantize_blocks
    from monokernel.weights.formats import get_format
    from monokernel.weights.quantize import is_quantized

    cfg = dataclasses.replace(
        SHAPES["odd"], hidden_size=704, intermediate_size=1472, num_heads=5, num_kv_heads=1,
        head_dim=128, num_layers=2,
    )  # fmt: skip
    w = random_weights(cfg, dtype=torch.float32, seed=4)
    bm, bn = 48, 64
    qs = {k: quantize_blocks(v, bm, bn)[0] for k, v in w.items() if is_quantized(k)}
    dense, blocks = fp8_block_checkpoint(w, bm, bn)
    w = {k: v.bfloat16() if k in qs else v for k, v in dense.items()}  # as the loader gives
    packed = repack(cfg, w, 64, fold=False, fmt="fp8", fp8_blocks=blocks)
    fp8 = get_format("fp8")
    layer = packed.layers[1]
    p = "layers.1."
    b = {k: v.view(torch.uint8) for k, v in qs.items()}
    want = {
        "wqkv": torch.cat([b[p + k] for k in ("wq", "wk", "wv")]),
        "wo": b[p + "wo"],
        "wgu": interleave_rows(b[p + "w_gate"], b[p + "w_up"]),
        "wdown": b[p + "w_down"],
    }
    for key, q in want.items():
        m = layer.matrices[key]
        assert fp8.block_of(m) == bn and fp8.is_tiled(m), key
        assert torch.equal(fp8.stored(m).view(torch.uint8), q), key
    assert torch.equal(fp8.dense(layer.matrices["wo"], torch.bfloat16), w[p + "wo"])
