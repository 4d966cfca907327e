"""Every named model shape in one table: what bench, prebuild, the tests and the roofline read.

Each entry copies its numbers from a public HF ``config.json`` and names that repository
(``source``); native precision is the released checkpoint's storage (its
quantization_config where there is one). Dense decoders carry the ``ModelConfig`` the
engine runs, and their roofline ``ModelShape`` is derived from it; the others (mixture of
experts, latent attention, sliding windows), which the engine refuses, carry only their
``ModelShape``.

``SHAPES`` holds the dense shapes the monokernel builds (``kernel=True``; today every dense
one): benchmarks, prebuild and the kernel tests read it. A dense shape the kernel cannot
build would stay in ``DENSE_SHAPES`` only, which the torch and reference engines run.
"""

from __future__ import annotations

from dataclasses import dataclass

from monokernel.models.architecture import ModelShape, Precision, shape_of
from monokernel.models.config import ModelConfig, RopeScaling

BF16 = Precision("bf16")


@dataclass(frozen=True, slots=True)
class NamedModel:
    """One catalogue entry; ``shape.name`` is its display name, its key the lower-case one."""

    shape: ModelShape
    native: Precision
    source: str  # the HF repository whose config.json the numbers come from; "" if synthetic
    config: ModelConfig | None = None  # dense decoders only: what the engine runs
    kernel: bool = False  # the monokernel builds this shape today
    aliases: tuple[str, ...] = ()  # other names the roofline accepts

    @property
    def name(self) -> str:
        return self.shape.name


def _dense(
    name: str,
    source: str,
    config: ModelConfig,
    kernel: bool = False,
    aliases: tuple[str, ...] = (),
) -> NamedModel:
    return NamedModel(shape_of(config, name), BF16, source, config, kernel, aliases)


_ENTRIES: tuple[NamedModel, ...] = (
    _dense(
        "SmolLM2-135M",  # our default model
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        ModelConfig(
            family="llama",
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_layers=30,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            rms_norm_eps=1e-5,
            rope_theta=100000.0,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
        ),
        kernel=True,
        aliases=("smollm2",),
    ),
    _dense(
        "Llama-3.2-1B",
        "meta-llama/Llama-3.2-1B",
        ModelConfig(
            family="llama",
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_layers=16,
            num_heads=32,
            num_kv_heads=8,
            head_dim=64,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            max_position_embeddings=131072,
            tie_word_embeddings=True,
            rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192),
        ),
        kernel=True,
        aliases=("llama-1b",),
    ),
    _dense(
        "Qwen2.5-Coder-1.5B",
        "Qwen/Qwen2.5-Coder-1.5B-Instruct",
        ModelConfig(
            family="qwen2",
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_layers=28,
            num_heads=12,
            num_kv_heads=2,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
            qkv_bias=True,
        ),
        kernel=True,
        aliases=("qwen-1.5b",),
    ),
    _dense(
        "Qwen3-0.6B",
        "Qwen/Qwen3-0.6B",
        ModelConfig(
            family="qwen3",
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_layers=28,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=40960,
            tie_word_embeddings=True,
            qk_norm=True,
        ),
        kernel=True,
    ),
    # The sizes coding agents run (issue 34).
    _dense(
        "Qwen3-4B",
        "Qwen/Qwen3-4B",
        ModelConfig(
            family="qwen3",
            vocab_size=151936,
            hidden_size=2560,
            intermediate_size=9728,
            num_layers=36,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=40960,
            tie_word_embeddings=True,
            qk_norm=True,
        ),
        kernel=True,
    ),
    _dense(
        "Qwen2.5-Coder-7B",  # untied, unlike the 1.5B
        "Qwen/Qwen2.5-Coder-7B-Instruct",
        ModelConfig(
            family="qwen2",
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_layers=28,
            num_heads=28,
            num_kv_heads=4,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
            tie_word_embeddings=False,
            qkv_bias=True,
        ),
        kernel=True,
        aliases=("qwen-7b",),
    ),
    _dense(
        "Mistral-7B",  # v0.3: the 32768-token vocabulary, no sliding window
        "mistralai/Mistral-7B-Instruct-v0.3",
        ModelConfig(
            family="mistral",
            vocab_size=32768,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rms_norm_eps=1e-5,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
            tie_word_embeddings=False,
        ),
        kernel=True,
    ),
    _dense(
        "Llama-3.1-8B",
        "meta-llama/Llama-3.1-8B-Instruct",
        ModelConfig(
            family="llama",
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
            rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
        ),
        kernel=True,
        aliases=("llama-8b",),
    ),
    _dense(
        "Qwen3-8B",
        "Qwen/Qwen3-8B",
        ModelConfig(
            family="qwen3",
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_layers=36,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
            qk_norm=True,
        ),
        kernel=True,
    ),
    _dense(
        "Qwen2.5-Coder-14B",
        "Qwen/Qwen2.5-Coder-14B-Instruct",
        ModelConfig(
            family="qwen2",
            vocab_size=152064,
            hidden_size=5120,
            intermediate_size=13824,
            num_layers=48,
            num_heads=40,
            num_kv_heads=8,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
            tie_word_embeddings=False,
            qkv_bias=True,
        ),
        kernel=True,
    ),
    _dense(
        "Qwen3-14B",
        "Qwen/Qwen3-14B",
        ModelConfig(
            family="qwen3",
            vocab_size=151936,
            hidden_size=5120,
            intermediate_size=17408,
            num_layers=40,
            num_heads=40,
            num_kv_heads=8,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
            qk_norm=True,
        ),
        kernel=True,
    ),
    _dense(
        "Qwen2.5-Coder-32B",
        "Qwen/Qwen2.5-Coder-32B-Instruct",
        ModelConfig(
            family="qwen2",
            vocab_size=152064,
            hidden_size=5120,
            intermediate_size=27648,
            num_layers=64,
            num_heads=40,
            num_kv_heads=8,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
            tie_word_embeddings=False,
            qkv_bias=True,
        ),
        kernel=True,
    ),
    NamedModel(
        # Every layer MoE (decoder_sparse_step 1, no mlp_only_layers), 128 experts, 8 per
        # token, no shared expert.
        ModelShape(
            name="Qwen3-Coder-30B-A3B",
            vocab_size=151936,
            hidden_size=2048,
            num_layers=48,
            num_heads=32,
            num_kv_heads=4,
            head_dim=128,
            intermediate_size=6144,
            qk_norm=True,
            num_experts=128,
            experts_per_token=8,
            moe_intermediate_size=768,
        ),
        BF16,
        "Qwen/Qwen3-Coder-30B-A3B-Instruct",
        aliases=("qwen3-coder-30b",),
    ),
    NamedModel(
        # 128 experts, 4 per token, layers alternating 128-token sliding window and full
        # attention; experts stored in MXFP4, the rest in bf16
        # (quantization_config.modules_to_not_convert).
        ModelShape(
            name="GPT-OSS-120B",
            vocab_size=201088,
            hidden_size=2880,
            num_layers=36,
            num_heads=64,
            num_kv_heads=8,
            head_dim=64,
            intermediate_size=2880,
            attention_bias=True,
            o_bias=True,
            num_experts=128,
            experts_per_token=4,
            moe_intermediate_size=2880,
            expert_bias=True,
            sliding_window=128,
            sliding_layers=18,
        ),
        Precision("bf16", experts="mxfp4"),
        "openai/gpt-oss-120b",
        aliases=("gpt-oss",),
    ),
    NamedModel(
        # MLA, 3 dense layers then 58 MoE layers of 256 routed experts (8 per token) + 1
        # shared; FP8 (e4m3, 128×128 block scales) for the linear layers, bf16
        # embeddings/head. The MTP module is not part of plain decoding and is left out
        # (671B main model).
        ModelShape(
            name="DeepSeek-V3",
            vocab_size=129280,
            hidden_size=7168,
            num_layers=61,
            num_heads=128,
            num_kv_heads=128,
            head_dim=192,
            intermediate_size=18432,
            num_experts=256,
            experts_per_token=8,
            moe_intermediate_size=2048,
            num_shared_experts=1,
            num_dense_layers=3,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
        Precision("fp8", head="bf16"),
        "deepseek-ai/DeepSeek-V3",
    ),
    # Every optional feature at once, in sizes no power of two divides: catches indexing
    # that only works for the common shapes. Not a real model.
    _dense(
        "odd",
        "",
        ModelConfig(
            family="qwen3",
            vocab_size=1003,
            hidden_size=520,
            intermediate_size=1400,
            num_layers=3,
            num_heads=5,
            num_kv_heads=1,
            head_dim=104,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            qkv_bias=True,
            o_bias=True,
            qk_norm=True,
        ),
        kernel=True,
    ),
    # The same at hidden > 4096 (the sizes of 8B-32B models): rows of 513 16-byte chunks,
    # an intermediate size no split divides evenly, head_dim 152, groups of 9 query heads.
    _dense(
        "odd-wide",
        "",
        ModelConfig(
            family="qwen3",
            vocab_size=5003,
            hidden_size=4104,
            intermediate_size=11080,
            num_layers=2,
            num_heads=27,
            num_kv_heads=3,
            head_dim=152,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            qkv_bias=True,
            o_bias=True,
            qk_norm=True,
        ),
        kernel=True,
    ),
)

CATALOGUE: dict[str, NamedModel] = {e.name.lower(): e for e in _ENTRIES}
# Dense decoders the engine runs (the torch and reference engines: any size).
DENSE_SHAPES: dict[str, ModelConfig] = {
    k: e.config for k, e in CATALOGUE.items() if e.config is not None
}
# The dense shapes the monokernel builds today: benchmarks, prebuild and the kernel tests.
SHAPES: dict[str, ModelConfig] = {
    k: e.config for k, e in CATALOGUE.items() if e.config is not None and e.kernel
}


def find_model(name: str) -> NamedModel | None:
    """The entry called ``name`` (its name or an alias, any case); None if there is none."""
    key = name.lower()
    for k, e in CATALOGUE.items():
        if key == k or key in e.aliases:
            return e
    return None
