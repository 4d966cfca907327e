"""Bytes that must move per decoded token, and the speed ceiling they imply.

At batch 1 a decode step reads every *active* weight once plus the KV cache written so far;
nothing is reused between tokens, so ``bandwidth / bytes_per_token`` bounds tokens/s.
Everything here is a pure function of frozen descriptions, so the arithmetic can be checked
by hand in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from monokernel.models.architecture import DENSE, EXPERTS, HEAD, ModelShape, Precision

# Bits per weight as stored, scales counted. int4 is the kernel's (weights/formats/int4.py):
# a float32 scale and offset a group of 128 columns, half a bit a weight (at groups of 32,
# a GGUF Q4_0/Q4_1's, 6 bits a weight).
DTYPE_BITS: dict[str, float] = {
    "fp32": 32.0,
    "bf16": 16.0,
    "fp16": 16.0,
    "fp8": 8.0,
    "int8": 8.0,
    "mxfp4": 4.25,  # 32 fp4 values + one 8-bit shared exponent
    "nvfp4": 4.5,  # 16 fp4 values + one fp8 scale
    "int4": 4.5,
}
DTYPE_ALIASES: dict[str, str] = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "e4m3": "fp8",
    "float8_e4m3fn": "fp8",
    "fp4": "mxfp4",
    "q4": "int4",
}


def dtype_bytes(name: str) -> float:
    key = DTYPE_ALIASES.get(name.lower(), name.lower())
    if key not in DTYPE_BITS:
        known = ", ".join(sorted(DTYPE_BITS))
        raise ValueError(f"unknown dtype {name!r}; known: {known}")
    return DTYPE_BITS[key] / 8


def canonical_dtype(name: str) -> str:
    dtype_bytes(name)  # validates
    return DTYPE_ALIASES.get(name.lower(), name.lower())


@dataclass(frozen=True, slots=True)
class WeightGroup:
    """Parameters of one kind: how many the model holds, how many one token reads."""

    name: str
    total_params: int
    active_params: int
    weight_class: str  # HEAD | DENSE | EXPERTS
    stored_bytes: float | None = None  # actual bytes of the active part (GGUF), if known


@dataclass(frozen=True, slots=True)
class KVShape:
    """KV-cache elements appended per token per layer, and which layers see how much."""

    elems_per_token_per_layer: int  # kv_heads*(k_dim+v_dim); MLA: kv_lora_rank+rope_dim
    full_layers: int
    window_layers: int = 0  # sliding-window layers read at most `window` positions
    window: int = 0

    def positions_read(self, context: int) -> int:
        return self.full_layers * context + self.window_layers * min(context, self.window)


def attention_params(s: ModelShape) -> int:
    """Attention weights of one layer (projections, biases, per-head norms)."""
    h = s.hidden_size
    if s.is_mla:
        qk_dim = s.qk_nope_head_dim + s.qk_rope_head_dim
        if s.q_lora_rank:
            q = h * s.q_lora_rank + s.q_lora_rank + s.q_lora_rank * s.num_heads * qk_dim
        else:
            q = h * s.num_heads * qk_dim
        kv_a = h * (s.kv_lora_rank + s.qk_rope_head_dim) + s.kv_lora_rank
        kv_b = s.kv_lora_rank * s.num_heads * (s.qk_nope_head_dim + s.v_head_dim)
        o = s.num_heads * s.v_head_dim * h
        return q + kv_a + kv_b + o
    q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    n = h * (q_size + 2 * kv_size) + q_size * h
    if s.attention_bias:
        n += q_size + 2 * kv_size
    if s.o_bias:
        n += h
    if s.qk_norm:
        n += 2 * s.head_dim
    return n


def mlp_params(hidden: int, inner: int, gated: bool = True, bias: bool = False) -> int:
    mats = 3 if gated else 2
    n = mats * hidden * inner
    if bias:
        n += (mats - 1) * inner + hidden
    return n


def weight_groups(s: ModelShape) -> tuple[WeightGroup, ...]:
    """Every parameter of ``s`` in a group, with the part one decoded token reads."""
    h, v = s.hidden_size, s.vocab_size
    table = v * h
    groups = [
        # The input embedding is a gather: one row per token, whatever the table's size.
        WeightGroup("embedding", 0 if s.tie_word_embeddings else table, h, HEAD),
        # The LM head is a full GEMV every token; tied, it is the same table read in full.
        WeightGroup("lm_head", table, table, HEAD),
    ]
    attn = attention_params(s) * s.num_layers
    groups.append(WeightGroup("attention", attn, attn, DENSE))
    dense = mlp_params(h, s.intermediate_size, s.gated_mlp) * s.dense_layers
    if dense:
        groups.append(WeightGroup("dense_mlp", dense, dense, DENSE))
    if s.is_moe:
        per_expert = mlp_params(h, s.moe_intermediate_size, s.gated_mlp, s.expert_bias)
        layers = s.moe_layers
        groups.append(
            WeightGroup(
                "routed_experts",
                per_expert * s.num_experts * layers,
                per_expert * s.experts_per_token * layers,
                EXPERTS,
            )
        )
        if s.num_shared_experts:
            inner = s.shared_intermediate_size or s.moe_intermediate_size
            shared = mlp_params(h, inner, s.gated_mlp) * s.num_shared_experts * layers
            groups.append(WeightGroup("shared_experts", shared, shared, EXPERTS))
        # The router scores every expert, so its whole matrix is read each token.
        router = (h * s.num_experts + (s.num_experts if s.expert_bias else 0)) * layers
        groups.append(WeightGroup("router", router, router, DENSE))
    # Two RMSNorm gains per layer plus the final one; MLA adds its latent norms above.
    norms = 2 * h * s.num_layers + h
    groups.append(WeightGroup("norms", norms, norms, DENSE))
    return tuple(groups)


def kv_shape(s: ModelShape) -> KVShape:
    # MLA caches one compressed latent plus the shared RoPE key per token per layer.
    mla_elems = s.kv_lora_rank + s.qk_rope_head_dim
    elems = mla_elems if s.is_mla else 2 * s.num_kv_heads * s.head_dim
    window_layers = s.sliding_layers if s.sliding_window else 0
    return KVShape(elems, s.num_layers - window_layers, window_layers, s.sliding_window)


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """What the roofline needs: weight groups, KV shape, and the checkpoint's precision."""

    name: str
    groups: tuple[WeightGroup, ...]
    kv: KVShape
    native: Precision
    source: str = ""  # where the numbers come from

    @property
    def total_params(self) -> int:
        return sum(g.total_params for g in self.groups)

    @property
    def active_params(self) -> int:
        return sum(g.active_params for g in self.groups)


def profile_from_shape(s: ModelShape, native: Precision, source: str = "") -> ModelProfile:
    return ModelProfile(s.name, weight_groups(s), kv_shape(s), native, source)


def weight_bytes(groups: tuple[WeightGroup, ...], precision: Precision | None) -> float:
    """Active weight bytes; ``precision`` None uses the stored sizes (GGUF)."""
    total = 0.0
    for g in groups:
        if precision is None and g.stored_bytes is not None:
            total += g.stored_bytes
        else:
            dtype = (precision or Precision()).for_class(g.weight_class)
            total += g.active_params * dtype_bytes(dtype)
    return total


def kv_bytes(kv: KVShape, context: int, kv_dtype: str) -> float:
    return kv.elems_per_token_per_layer * kv.positions_read(context) * dtype_bytes(kv_dtype)


@dataclass(frozen=True, slots=True)
class RooflineInputs:
    gpu: str
    bandwidth_per_gpu: float  # bytes/s
    bandwidth_source: str  # "datasheet" | "measured"
    tp: int = 1
    context: int = 0
    kv_dtype: str = "bf16"
    precision: Precision | None = None  # None: the model's native precision
    mbu: float | None = None


@dataclass(frozen=True, slots=True)
class Roofline:
    model: str
    total_params: int
    active_params: int
    precision: str
    weight_bytes: float
    kv_bytes: float
    bytes_per_token: float
    bandwidth_bytes_per_s: float
    ceiling_tok_s: float
    estimate_tok_s: float | None
    inputs: RooflineInputs

    @property
    def floor_us(self) -> float:
        return 1e6 / self.ceiling_tok_s


def roofline(profile: ModelProfile, inputs: RooflineInputs) -> Roofline:
    """Ceiling tokens/s: per-token bytes over aggregate bandwidth.

    With tensor parallelism each GPU streams its shard at the same time, so the aggregate
    is ``tp`` times one GPU's; replicated pieces (norms, KV heads when kv_heads < tp) and the
    all-reduces are ignored, which keeps this an upper bound."""
    if inputs.tp < 1:
        raise ValueError(f"tp must be >= 1, got {inputs.tp}")
    if inputs.context < 0:
        raise ValueError(f"context must be >= 0, got {inputs.context}")
    if inputs.mbu is not None and not 0 < inputs.mbu <= 1:
        raise ValueError(f"mbu must be in (0, 1], got {inputs.mbu}")
    precision = inputs.precision
    if precision is None and not any(g.stored_bytes is not None for g in profile.groups):
        precision = profile.native
    w = weight_bytes(profile.groups, precision)
    kv = kv_bytes(profile.kv, inputs.context, inputs.kv_dtype)
    total = w + kv
    bandwidth = inputs.bandwidth_per_gpu * inputs.tp
    ceiling = bandwidth / total
    if precision is not None:
        label = precision.label()
    else:
        label = f"as stored ({8 * w / max(profile.active_params, 1):.2f} bits/weight)"
    return Roofline(
        model=profile.name,
        total_params=profile.total_params,
        active_params=profile.active_params,
        precision=label,
        weight_bytes=w,
        kv_bytes=kv,
        bytes_per_token=total,
        bandwidth_bytes_per_s=bandwidth,
        ceiling_tok_s=ceiling,
        estimate_tok_s=ceiling * inputs.mbu if inputs.mbu is not None else None,
        inputs=inputs,
    )
