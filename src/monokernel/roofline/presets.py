"""Config-level shapes of models we plan for, copied from their public HF config.json.

Each entry names the repository whose config.json the numbers come from. Native precision
is the released checkpoint's storage (quantization_config where there is one).
"""

from __future__ import annotations

from monokernel.roofline.calc import ModelProfile, ModelShape, Precision, profile_from_shape

_PRESETS: tuple[tuple[ModelShape, Precision, str], ...] = (
    (
        # huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/config.json (our default model)
        ModelShape(
            name="SmolLM2-135M",
            vocab_size=49152,
            hidden_size=576,
            num_layers=30,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            intermediate_size=1536,
            tie_word_embeddings=True,
        ),
        Precision("bf16"),
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    (
        # huggingface.co/meta-llama/Llama-3.2-1B/config.json
        ModelShape(
            name="Llama-3.2-1B",
            vocab_size=128256,
            hidden_size=2048,
            num_layers=16,
            num_heads=32,
            num_kv_heads=8,
            head_dim=64,
            intermediate_size=8192,
            tie_word_embeddings=True,
        ),
        Precision("bf16"),
        "meta-llama/Llama-3.2-1B",
    ),
    (
        # huggingface.co/Qwen/Qwen2.5-Coder-1.5B-Instruct/config.json
        ModelShape(
            name="Qwen2.5-Coder-1.5B",
            vocab_size=151936,
            hidden_size=1536,
            num_layers=28,
            num_heads=12,
            num_kv_heads=2,
            head_dim=128,
            intermediate_size=8960,
            tie_word_embeddings=True,
            attention_bias=True,
        ),
        Precision("bf16"),
        "Qwen/Qwen2.5-Coder-1.5B-Instruct",
    ),
    (
        # huggingface.co/Qwen/Qwen2.5-Coder-7B-Instruct/config.json (untied, unlike the 1.5B)
        ModelShape(
            name="Qwen2.5-Coder-7B",
            vocab_size=152064,
            hidden_size=3584,
            num_layers=28,
            num_heads=28,
            num_kv_heads=4,
            head_dim=128,
            intermediate_size=18944,
            tie_word_embeddings=False,
            attention_bias=True,
        ),
        Precision("bf16"),
        "Qwen/Qwen2.5-Coder-7B-Instruct",
    ),
    (
        # huggingface.co/Qwen/Qwen3-Coder-30B-A3B-Instruct/config.json: every layer MoE
        # (decoder_sparse_step 1, no mlp_only_layers), 128 experts, 8 per token, no shared.
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
        Precision("bf16"),
        "Qwen/Qwen3-Coder-30B-A3B-Instruct",
    ),
    (
        # huggingface.co/openai/gpt-oss-120b/config.json: 128 experts, 4 per token, layers
        # alternating 128-token sliding window and full attention; experts stored in MXFP4,
        # the rest in bf16 (quantization_config.modules_to_not_convert).
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
    ),
    (
        # huggingface.co/deepseek-ai/DeepSeek-V3/config.json: MLA, 3 dense layers then 58 MoE
        # layers of 256 routed experts (8 per token) + 1 shared; FP8 (e4m3, 128×128 block
        # scales) for the linear layers, bf16 embeddings/head. The MTP module is not part of
        # plain decoding and is left out (671B main model).
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
)

PRESETS: dict[str, ModelProfile] = {
    shape.name.lower(): profile_from_shape(shape, native, source)
    for shape, native, source in _PRESETS
}
PRESET_NAMES: tuple[str, ...] = tuple(shape.name for shape, _, _ in _PRESETS)
PRESET_ALIASES: dict[str, str] = {
    "smollm2": "smollm2-135m",
    "llama-1b": "llama-3.2-1b",
    "qwen-1.5b": "qwen2.5-coder-1.5b",
    "qwen-7b": "qwen2.5-coder-7b",
    "qwen3-coder-30b": "qwen3-coder-30b-a3b",
    "gpt-oss": "gpt-oss-120b",
    "deepseek-v3": "deepseek-v3",
}


def get_preset(name: str) -> ModelProfile:
    key = PRESET_ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESET_NAMES)}")
    return PRESETS[key]
