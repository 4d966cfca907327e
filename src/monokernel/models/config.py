"""ModelConfig: the one description of a dense decoder every layer below reads.

Built from an HF ``config.json`` (or from GGUF metadata, see ``weights/gguf_loader.py``).
Anything we cannot run exactly is refused here, before a tensor is touched, with a message
that names what is supported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from monokernel.errors import UnsupportedModelError

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3.x frequency-dependent RoPE scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    family: str  # one of SUPPORTED_MODEL_TYPES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2; Llama with attention_bias
    o_bias: bool = False  # Llama, Qwen3 with attention_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before RoPE
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameters the forward pass reads (the embedding counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * self.head_dim
        per_layer = attn + 3 * h * i + 2 * h
        lm_head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + lm_head


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 writes ``rope_parameters`` (theta inside); older ones write
    # ``rope_theta`` beside an optional ``rope_scaling``.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _refuse_unsupported_features(cfg: dict[str, Any], model_type: str) -> None:
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported; only 'silu' is")
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported")
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if cfg.get(key):
            raise UnsupportedModelError(
                f"mixture-of-experts models ({key}={cfg[key]}) are not supported; "
                "only dense decoders are"
            )
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", model_type == "mistral")
    max_pos = int(cfg.get("max_position_embeddings", 0))
    if window and uses_window and int(window) < max_pos:
        raise UnsupportedModelError(
            f"sliding-window attention (sliding_window={window} < "
            f"max_position_embeddings={max_pos}) is not supported; only full attention is"
        )
    layer_types = cfg.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise UnsupportedModelError(
            f"layer_types other than 'full_attention' are not supported: {sorted(set(layer_types))}"
        )


def config_from_hf_dict(cfg: dict[str, Any]) -> ModelConfig:
    """Map an HF config.json dict onto ModelConfig, refusing what we cannot run exactly."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (dense decoders)"
        )
    _refuse_unsupported_features(cfg, model_type)
    theta, scaling = _rope(cfg)
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim") or hidden // heads
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        family=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=model_type in ("llama", "mistral", "qwen3") and attention_bias,  # HF: o_proj too
        qk_norm=model_type == "qwen3",
        rope_scaling=scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
    )


def load_hf_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    return config_from_hf_dict(json.loads(path.read_text()))


def hf_core_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The sizes, norm, RoPE and token fields of an HF ``config.json`` for ``cfg``, as
    ``config_from_hf_dict`` reads them back; callers add their family's extras."""
    d: dict[str, Any] = {
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_theta": cfg.rope_theta,
        "bos_token_id": cfg.bos_token_id,
    }
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        d["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return d
