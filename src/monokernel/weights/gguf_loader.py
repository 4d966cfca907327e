"""Load a GGUF file (llama.cpp's format) into a ModelConfig and a mapping of float32 tensors.

GGUF metadata is turned into an HF-config-shaped dict and sent through
``config_from_hf_dict`` so GGUF and safetensors checkpoints meet the same refusals.
Tensors are dequantised to float32 and renamed through one explicit table into our names.
Each layer's linear weights stored as Q4_0, Q4_1 or Q4_K come back as their blocks' bits
(``GroupQuant``, weights/group_quant.py), and those stored as Q8_0, Q6_K, Q5_K, Q5_0 or Q5_1
as their values in 8 bits (weights/gguf_8bit.py), for the kernel to stream as they are; their
float32 values are made from those groups only when read (weights/lazy_weights.py), so a
model that streams its groups never holds them (a 32B Q4_K_M: 130 GB in float32). Every
block is decoded once, by our decoders where they read the type (the same bits as gguf's
dequantisation, which test_gguf_loader and test_gguf_8bit check against).

``gguf`` is imported inside functions only: the GPU machines need not have it installed.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from monokernel.errors import UnexpectedTensorError, UnsupportedModelError, WeightLoadError
from monokernel.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, config_from_hf_dict
from monokernel.weights.gguf_8bit import GGUF_8BIT_BLOCK_BYTES, from_gguf_8bit
from monokernel.weights.gguf_file import GGUFFile, TensorInfo, read_gguf
from monokernel.weights.group_quant import (
    GGUF_BLOCK_BYTES,
    GGUF_ZERO_POINTS,
    GroupQuant,
    from_gguf_blocks,
    permute_rows,
)
from monokernel.weights.lazy_weights import DenseSource, LazyWeights
from monokernel.weights.names import Weights, check_weights
from monokernel.weights.quantize import is_quantized

# GGUF architectures whose Q/K rows llama.cpp's converter permutes for its interleaved RoPE.
PERMUTED_QK_ARCHS: tuple[str, ...] = ("llama", "mistral")
SUPPORTED_TENSOR_TYPES: tuple[str, ...] = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q6_K",
    "Q5_K",
    "Q5_0",
    "Q5_1",
    "Q4_K",
    "Q4_0",
    "Q4_1",
    "Q3_K",  # dequantised only: its layers run in bf16
    "Q2_K",
)

GGUF_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "embed",
    "output_norm.weight": "norm",
    "output.weight": "lm_head",
}
GGUF_LAYER_NAMES: dict[str, str] = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_q.bias": "bq",
    "attn_k.bias": "bk",
    "attn_v.bias": "bv",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "attn_output.weight": "wo",
    "attn_output.bias": "bo",
    "ffn_norm.weight": "ffn_norm",
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
}
ROPE_FREQS = "rope_freqs.weight"
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
# Llama 3.x defaults; only used as a first guess that is then checked against rope_freqs.
_LLAMA3_LOW, _LLAMA3_HIGH, _LLAMA3_ORIG_CTX = 1.0, 4.0, 8192


def gguf_to_ours(name: str) -> str | None:
    """Our name for a GGUF tensor name; None for a name the table does not know."""
    if name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[name]
    m = _GGUF_LAYER.match(name)
    if m and m.group(2) in GGUF_LAYER_NAMES:
        return f"layers.{m.group(1)}.{GGUF_LAYER_NAMES[m.group(2)]}"
    return None


# --------------------------------------------------------------------------- metadata


def _reader(path: Path) -> GGUFFile:
    return read_gguf(Path(path))


def _meta(reader: GGUFFile, key: str, default: Any = None) -> Any:
    value = reader.get(key)
    if value is None:
        return default
    # Numeric arrays come back as numpy arrays; callers compare and convert plain values.
    return value.tolist() if isinstance(value, np.ndarray) else value


def _tensor_names(reader: GGUFFile) -> set[str]:
    return {t.name for t in reader.tensors}


def _vocab_size(reader: GGUFFile, arch: str) -> int:
    size = _meta(reader, f"{arch}.vocab_size")
    if size is not None:
        return int(size)
    # The embedding's row count is what the forward pass indexes, so it beats the token list.
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return int(t.dims[-1])
    tokens = reader.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise UnsupportedModelError(f"GGUF has no {arch}.vocab_size and no token list")
    return len(tokens)


def _rope_freqs(reader: GGUFFile) -> np.ndarray | None:
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            return _dequantize(reader, t).reshape(-1)
    return None


def _llama3_rope_from_factors(
    factors: np.ndarray, theta: float, head_dim: int, orig_ctx: int
) -> dict[str, Any]:
    """Recover llama3 rope parameters from llama.cpp's per-frequency divisors, or refuse.

    llama.cpp stores ``inv_freq / factors`` as a tensor; our RoPE wants the parameters.
    The curve depends on thresholds ``orig_ctx/low`` and ``orig_ctx/high`` only, so with
    ``orig_ctx`` fixed we fit low/high from the blended band and accept only an exact match.
    """
    from monokernel.models.config import RopeScaling
    from monokernel.models.rope import llama3_scale

    factors = factors.astype(np.float64)
    if factors.shape != (head_dim // 2,):
        raise UnsupportedModelError(
            f"{ROPE_FREQS} has {factors.size} entries, expected head_dim/2 = {head_dim // 2}"
        )
    factor = float(factors.max())
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exps)
    target = inv_freq.double().numpy() / factors
    candidates = [(_LLAMA3_LOW, _LLAMA3_HIGH)]
    # Inside the blended band 1/f = (1-s)/factor + s with s linear in 1/wavelength.
    band = (factors > 1.0 + 1e-6) & (factors < factor - 1e-6)
    if band.sum() >= 2 and factor > 1.0:
        s = (1.0 / factors[band] - 1.0 / factor) / (1.0 - 1.0 / factor)
        inv_wavelen = inv_freq.double().numpy()[band] / (2 * math.pi)
        slope, intercept = np.polyfit(inv_wavelen, s, 1)
        if slope > 0:
            low = -intercept * orig_ctx / slope
            candidates.append((low, low + orig_ctx / slope))
    for low, high in candidates:
        scaling = RopeScaling(factor, low, high, orig_ctx)
        got = llama3_scale(inv_freq, scaling).double().numpy()
        if np.allclose(got, target, rtol=1e-5, atol=0.0):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": orig_ctx,
            }
    raise UnsupportedModelError(
        f"the GGUF's {ROPE_FREQS} tensor does not match llama3 RoPE scaling; "
        "supported RoPE types: default, llama3"
    )


def _rope_scaling(reader: GGUFFile, arch: str, theta: float, head_dim: int) -> dict | None:
    kind = _meta(reader, f"{arch}.rope.scaling.type")
    orig_ctx = _meta(reader, f"{arch}.rope.scaling.original_context_length")
    factors = _rope_freqs(reader)
    if factors is not None:
        if kind not in (None, "none", "llama3"):
            raise UnsupportedModelError(
                f"rope scaling {kind!r} with a {ROPE_FREQS} tensor is not supported; "
                "supported RoPE types: default, llama3"
            )
        ctx = int(orig_ctx) if orig_ctx else _LLAMA3_ORIG_CTX
        return _llama3_rope_from_factors(factors, theta, head_dim, ctx)
    if kind in (None, "none"):
        return None
    # Hand anything else to config_from_hf_dict, which refuses it by name.
    return {
        "rope_type": str(kind),
        "factor": float(_meta(reader, f"{arch}.rope.scaling.factor", 1.0)),
    }


def _hf_dict(reader: GGUFFile) -> dict[str, Any]:
    arch = _meta(reader, "general.architecture")
    if arch not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"GGUF general.architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (dense decoders)"
        )

    def need(key: str) -> Any:
        value = _meta(reader, f"{arch}.{key}")
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(_meta(reader, f"{arch}.attention.key_length") or hidden // heads)
    value_dim = _meta(reader, f"{arch}.attention.value_length")
    if value_dim is not None and int(value_dim) != head_dim:
        raise UnsupportedModelError(
            f"attention.value_length={value_dim} differs from key_length={head_dim}"
        )
    rot_dim = _meta(reader, f"{arch}.rope.dimension_count")
    if rot_dim is not None and int(rot_dim) != head_dim:
        raise UnsupportedModelError(
            f"partial rotary embeddings (rope.dimension_count={rot_dim} < head_dim={head_dim}) "
            "are not supported"
        )
    if _meta(reader, f"{arch}.expert_count"):
        raise UnsupportedModelError("mixture-of-experts GGUF models are not supported")
    theta = float(_meta(reader, f"{arch}.rope.freq_base", 10000.0))
    names = _tensor_names(reader)
    if "blk.0.attn_q_norm.weight" in names and arch != "qwen3":
        raise UnsupportedModelError(f"per-head q/k norms are only supported for qwen3, not {arch}")
    cfg: dict[str, Any] = {
        "model_type": arch,
        "vocab_size": _vocab_size(reader, arch),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_meta(reader, f"{arch}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "max_position_embeddings": int(_meta(reader, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        # qwen2 has q/k/v bias by family; for llama-likes the bias flag also implies o bias.
        "attention_bias": arch != "qwen2" and "blk.0.attn_q.bias" in names,
        "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
    }
    window = _meta(reader, f"{arch}.attention.sliding_window")
    if window:
        cfg["sliding_window"] = int(window)
    scaling = _rope_scaling(reader, arch, theta, head_dim)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    return cfg


def load_gguf_config(path: Path) -> ModelConfig:
    """ModelConfig from a GGUF file's metadata (and which tensors it holds)."""
    return config_from_hf_dict(_hf_dict(_reader(Path(path))))


def gguf_generation_eos_ids(path: Path) -> tuple[int, ...]:
    """Token ids that end generation: eos, then end-of-turn / end-of-message if present."""
    reader = _reader(Path(path))
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _meta(reader, f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return tuple(ids)


# --------------------------------------------------------------------------- tensors


def _dequantize(reader: GGUFFile, tensor: TensorInfo) -> np.ndarray:
    """float32 array in numpy (row-major) order, i.e. GGUF's ggml shape reversed."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind = _type_name(tensor)
    # The stored bytes view a read-only memory map; copy so torch owns writable memory.
    data = np.array(reader.tensor_bytes(tensor))
    if kind in _TORCH_BLOCKS:
        return _dequantize_blocks(torch.from_numpy(data), kind, tensor.shape).numpy()
    qtype = GGMLQuantizationType[kind]
    return np.array(dequantize(data, qtype), dtype=np.float32).reshape(tensor.shape)


# Block layouts (bytes per 32 weights) of the formats dequantised in torch: an fp16 scale d,
# Q4_1 an fp16 minimum m, then the quants. gguf's numpy version works in groups of 16 rows
# and took 2.1 s of a 2-core start for the default model (Q4_1 with a Q8_0 embedding); these
# run a few whole-tensor passes on all cores (0.55 s there), with the same float32
# operations in the same order, so the same bits (test_gguf_loader checks).
_TORCH_BLOCKS: dict[str, int] = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def _dequantize_blocks(raw: torch.Tensor, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    blocks = raw.reshape(-1, _TORCH_BLOCKS[kind])
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    if kind == "Q8_0":
        out = blocks[:, 2:].contiguous().view(torch.int8).float()
        return out.mul_(d).reshape(shape)
    qs = blocks[:, 4:] if kind == "Q4_1" else blocks[:, 2:]
    # Within a block the low nibbles are weights 0-15 and the high nibbles 16-31.
    out = torch.empty(blocks.shape[0], 32, dtype=torch.float32)
    out[:, :16] = qs & 0x0F
    out[:, 16:] = qs >> 4
    if kind == "Q4_0":
        return out.sub_(8.0).mul_(d).reshape(shape)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return out.mul_(d).add_(m).reshape(shape)


def _unpermute_rows(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave so rows are in HF's rotate_half order.

    llama.cpp's converter reorders each head's rows from (first half, second half) to
    alternating pairs; this applies the inverse reorder to the first axis (weights or bias).
    A tensor of the wrong size is returned as is so ``check_weights`` can name the problem.
    """
    if w.shape[0] != n_heads * head_dim:
        return w
    split = w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:])
    return split.transpose(1, 2).reshape(w.shape).contiguous()


def load_gguf_weights(path: Path, cfg: ModelConfig) -> Weights:
    """All tensors of a GGUF file as float32, in our names and HF layout, checked vs ``cfg``."""
    return dict(load_gguf_tensors(path, cfg)[0])


# Block types our decoders read (weights/group_quant.py, weights/gguf_8bit.py).
_OUR_BLOCKS: tuple[str, ...] = (*GGUF_BLOCK_BYTES, *GGUF_8BIT_BLOCK_BYTES)


def load_gguf_tensors(path: Path, cfg: ModelConfig) -> tuple[LazyWeights, dict[str, GroupQuant]]:
    """``load_gguf_weights``'s tensors, and in the same pass over the file each layer
    linear weight stored as Q4_0, Q4_1 or Q4_K as a GroupQuant of its blocks' bits, or as Q8_0,
    Q6_K, Q5_K, Q5_0 or Q5_1 as an 8-bit one (our names, HF row order; its ``dense()`` is the
    weight, up to the sign of a Q4_0 zero and an fp32 rounding of a Q6_K value).

    The tensors come as a LazyWeights: a weight with a GroupQuant is made from it when first
    read (never at load: the monokernel streams the groups), the others are read now. Each
    block is decoded once, and the float32 values are gguf's dequantisation, bit for bit."""
    path = Path(path)
    reader = _reader(path)
    arch = _meta(reader, "general.architecture")
    entries: dict[str, torch.Tensor | DenseSource] = {}
    groups: dict[str, GroupQuant] = {}
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            continue  # folded into cfg.rope_scaling by load_gguf_config
        ours = gguf_to_ours(tensor.name)
        if ours is None:
            raise UnexpectedTensorError(f"{path}: tensor {tensor.name!r} is not one we know")
        kind = _type_name(tensor)
        if kind not in _OUR_BLOCKS or len(tensor.shape) != 2:
            entries[ours] = torch.from_numpy(_dequantize(reader, tensor))
            continue
        gq = _decode_blocks(reader, tensor, kind)
        source = DenseSource(gq, GGUF_ZERO_POINTS.get(kind))
        if is_quantized(ours):
            groups[ours] = gq
            entries[ours] = source
        else:  # the embedding or the LM head: every engine reads them
            entries[ours] = source.dense()
    if arch in PERMUTED_QK_ARCHS:
        for name, value in entries.items():
            heads = _permuted_heads(name, cfg)
            if heads is None:
                continue
            if isinstance(value, DenseSource):
                groups[name] = _unpermute_group_rows(groups[name], heads, cfg.head_dim)
                entries[name] = dataclasses.replace(value, gq=groups[name])
            else:
                entries[name] = _unpermute_rows(value, heads, cfg.head_dim)
    # Names and shapes are checked without making a matrix: a meta tensor stands in for each.
    stand_ins = {
        k: torch.empty(v.shape, device="meta") if isinstance(v, DenseSource) else v
        for k, v in entries.items()
    }
    checked = check_weights(stand_ins, cfg, source=str(path))  # drops a tied lm_head
    return LazyWeights({k: entries[k] for k in checked}), groups


def _permuted_heads(name: str, cfg: ModelConfig) -> int | None:
    """The head count of a tensor whose rows llama.cpp permuted (Q and K, weight and bias);
    None for every other tensor."""
    short = name.rsplit(".", 1)[-1]
    if short in ("wq", "bq"):
        return cfg.num_heads
    if short in ("wk", "bk"):
        return cfg.num_kv_heads
    return None


def _type_name(tensor: TensorInfo) -> str:
    """The tensor's GGUF type name, or WeightLoadError naming the supported ones."""
    from gguf import GGMLQuantizationType

    name = GGMLQuantizationType(tensor.tensor_type).name
    if name not in SUPPORTED_TENSOR_TYPES:
        raise WeightLoadError(
            f"tensor {tensor.name} has type {name}; supported GGUF tensor types: "
            f"{', '.join(SUPPORTED_TENSOR_TYPES)}"
        )
    return name


def _decode_blocks(reader: GGUFFile, tensor: TensorInfo, kind: str) -> GroupQuant:
    """A 2-D tensor of Q4_0/Q4_1/Q4_K blocks as a 4-bit GroupQuant, of Q8_0/Q6_K/Q5_K/Q5_0/
    Q5_1 blocks as an 8-bit one."""
    # The memory map's bytes are read-only: copy, as _dequantize does.
    raw = torch.from_numpy(np.array(reader.tensor_bytes(tensor))).reshape(-1)
    if kind in GGUF_8BIT_BLOCK_BYTES:
        return from_gguf_8bit(raw, kind, tensor.shape)
    return from_gguf_blocks(raw, kind, tensor.shape)


def _unpermute_group_rows(gq: GroupQuant, n_heads: int, head_dim: int) -> GroupQuant:
    """``_unpermute_rows`` for a GroupQuant: the same reorder of its rows (q, scale and
    offset alike), so its dense() stays the unpermuted weight."""
    if gq.rows != n_heads * head_dim:
        return gq  # check_weights names the misshaped weight
    return permute_rows(gq, _unpermute_rows(torch.arange(gq.rows), n_heads, head_dim))
