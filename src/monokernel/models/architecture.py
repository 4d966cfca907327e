"""The config-level shape of any decoder (dense, mixture-of-experts, latent attention,
sliding windows) and the storage precision of its weights: what the roofline counts bytes
from, and what the model catalogue (``models/shapes.py``) records for models the engine does
not run. A dense ``ModelConfig`` gives its ``ModelShape`` through ``shape_of``.
"""

from __future__ import annotations

from dataclasses import dataclass

from monokernel.models.config import ModelConfig

# Weight classes that can be stored at different precisions (e.g. GPT-OSS: experts in
# MXFP4, attention and embeddings in bf16).
HEAD, DENSE, EXPERTS = "head", "dense", "experts"


@dataclass(frozen=True, slots=True)
class Precision:
    """Storage dtype per weight class; ``experts``/``head`` default to ``weights``."""

    weights: str = "bf16"
    experts: str | None = None
    head: str | None = None

    def for_class(self, cls: str) -> str:
        if cls == EXPERTS and self.experts:
            return self.experts
        if cls == HEAD and self.head:
            return self.head
        return self.weights

    def label(self) -> str:
        extra = [
            f"{what} {self.for_class(cls)}"
            for what, cls in (("experts", EXPERTS), ("embed/head", HEAD))
            if self.for_class(cls) != self.weights
        ]
        return self.weights + (f" ({', '.join(extra)})" if extra else "")


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Config-level shape of a decoder; enough to count parameters per kind.

    Dense models leave the MoE fields at 0. With ``num_experts > 0`` every layer is an MoE
    layer except ``num_dense_layers`` of them (DeepSeek's first_k_dense_replace, Qwen's
    mlp_only_layers); only the count matters here, not where they sit."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (dense layers only in an MoE)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (+o for some families); tiny, but exact
    o_bias: bool = False
    qk_norm: bool = False
    gated_mlp: bool = True  # SwiGLU: gate, up, down
    # MoE
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0  # per shared expert; default moe_intermediate_size
    num_dense_layers: int = 0
    expert_bias: bool = False  # GPT-OSS experts and router carry biases
    # MLA (DeepSeek-V2/V3): kv_lora_rank > 0 switches attention to the latent form
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # attention window
    sliding_window: int = 0
    sliding_layers: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers if self.is_moe else 0

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.moe_layers


def shape_of(cfg: ModelConfig, name: str) -> ModelShape:
    """The shape of the dense decoder ``cfg``, named ``name``."""
    return ModelShape(
        name=name,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=cfg.qkv_bias,
        o_bias=cfg.o_bias,
        qk_norm=cfg.qk_norm,
    )
