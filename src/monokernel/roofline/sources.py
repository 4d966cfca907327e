"""Model profiles from the model catalogue (``models/shapes.py``), a raw HF ``config.json``
dict or a GGUF file's tensor table.

The engine's ``config_from_hf_dict`` refuses what it cannot run (MoE, MLA, windows); the
roofline only counts bytes, so it reads those configs itself.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from monokernel.models.shapes import CATALOGUE, find_model
from monokernel.roofline.calc import (
    DENSE,
    EXPERTS,
    HEAD,
    KVShape,
    ModelProfile,
    ModelShape,
    Precision,
    WeightGroup,
    canonical_dtype,
    profile_from_shape,
)

# The catalogue's real models (every entry that names its source repository).
PRESET_NAMES: tuple[str, ...] = tuple(e.name for e in CATALOGUE.values() if e.source)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as the loader takes
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_TOPK_KEYS = ("num_experts_per_tok", "experts_per_token", "num_experts_per_token")


def _first(cfg: dict[str, Any], keys: tuple[str, ...], default: Any = 0) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _dense_layer_count(cfg: dict[str, Any], layers: int) -> int:
    if cfg.get("first_k_dense_replace") is not None:  # DeepSeek
        freq = int(cfg.get("moe_layer_freq") or 1)
        first = int(cfg["first_k_dense_replace"])
        return sum(1 for i in range(layers) if i < first or (i - first) % freq)
    only = set(cfg.get("mlp_only_layers") or [])  # Qwen MoE
    step = int(cfg.get("decoder_sparse_step") or 1)
    return sum(1 for i in range(layers) if i in only or (i + 1) % step)


def _window_layers(cfg: dict[str, Any], model_type: str, layers: int) -> tuple[int, int]:
    window = int(cfg.get("sliding_window") or 0)
    if not window:
        return 0, 0
    types = cfg.get("layer_types")
    if types:
        return window, sum(1 for t in types if "sliding" in t)
    if cfg.get("use_sliding_window") or model_type in ("mistral", "mixtral"):
        return window, layers
    return 0, 0


def shape_from_hf_dict(cfg: dict[str, Any], name: str = "model") -> ModelShape:
    """A ModelShape from any decoder config.json we know the parameter layout of."""
    cfg = cfg.get("text_config") or cfg  # multimodal wrappers keep the decoder inside
    model_type = str(cfg.get("model_type", ""))
    hidden, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    experts = int(_first(cfg, _EXPERT_KEYS))
    window, window_layers = _window_layers(cfg, model_type, layers)
    shared_count = int(cfg.get("n_shared_experts") or 0)
    shared_width = int(cfg.get("shared_expert_intermediate_size") or 0)
    if shared_width and not shared_count:
        shared_count = 1  # Qwen2-MoE: one shared expert of that width
    inter = int(cfg.get("intermediate_size") or 0)
    mla = bool(cfg.get("kv_lora_rank"))
    return ModelShape(
        name=name,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=inter,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=model_type.startswith("qwen2") or bool(cfg.get("attention_bias")),
        o_bias=bool(cfg.get("attention_bias")) and not model_type.startswith("qwen2"),
        qk_norm=model_type.startswith("qwen3"),
        num_experts=experts,
        experts_per_token=int(_first(cfg, _TOPK_KEYS)) if experts else 0,
        # Mixtral and GPT-OSS give the expert width as intermediate_size.
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or inter) if experts else 0,
        num_shared_experts=shared_count if experts else 0,
        shared_intermediate_size=shared_width,
        num_dense_layers=_dense_layer_count(cfg, layers) if experts else 0,
        expert_bias=model_type == "gpt_oss",
        q_lora_rank=int(cfg.get("q_lora_rank") or 0) if mla else 0,
        kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
        qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0),
        qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
        v_head_dim=int(cfg.get("v_head_dim") or 0),
        sliding_window=window,
        sliding_layers=window_layers,
    )


def native_precision(cfg: dict[str, Any]) -> Precision:
    """The checkpoint's storage precision as config.json declares it."""
    base_name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    try:
        base = canonical_dtype(base_name)
    except ValueError:
        base = "bf16"
    quant = cfg.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower()
    if method == "fp8":
        return Precision("fp8", head=base)
    if method == "mxfp4":  # GPT-OSS: experts only
        return Precision(base, experts="mxfp4")
    if method in ("gptq", "awq", "compressed-tensors") and int(quant.get("bits", 0)) == 4:
        return Precision("int4", head=base)
    return Precision(base)


def profile_from_hf_dict(cfg: dict[str, Any], name: str, source: str = "") -> ModelProfile:
    return profile_from_shape(shape_from_hf_dict(cfg, name), native_precision(cfg), source)


def get_preset(name: str) -> ModelProfile:
    """The catalogue's model ``name`` (any case, or an alias)."""
    entry = find_model(name)
    if entry is None or not entry.source:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESET_NAMES)}")
    return profile_from_shape(entry.shape, entry.native, entry.source)


# --------------------------------------------------------------------------- GGUF


def _meta(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _gguf_group(name: str) -> tuple[str, str]:
    if "_exps" in name:
        return "routed_experts", EXPERTS
    if "_shexp" in name:
        return "shared_experts", EXPERTS
    if "ffn_gate_inp" in name:
        return "router", DENSE
    if "norm" in name:
        return "norms", DENSE
    if "attn" in name:
        return "attention", DENSE
    if "ffn" in name:
        return "dense_mlp", DENSE
    return "other", DENSE


def _count(value: Any, layers: int) -> int:
    """Sum over layers of a GGUF value that is a scalar or a per-layer list."""
    if isinstance(value, list):
        return int(sum(value))
    return int(value) * layers


def _gguf_kv(reader: Any, arch: str, layers: int, hidden: int, heads: int) -> KVShape:
    lora = _meta(reader, f"{arch}.attention.kv_lora_rank")
    if lora:
        rope = int(_meta(reader, f"{arch}.rope.dimension_count", 64))
        return KVShape(int(lora) + rope, layers)
    head_dim = int(_meta(reader, f"{arch}.attention.key_length") or hidden // heads)
    v_dim = int(_meta(reader, f"{arch}.attention.value_length") or head_dim)
    kv_heads_total = _count(_meta(reader, f"{arch}.attention.head_count_kv") or heads, layers)
    # A per-layer head count gives a total; spread it evenly, the sum is what matters.
    elems = kv_heads_total * (head_dim + v_dim) // layers
    window = int(_meta(reader, f"{arch}.attention.sliding_window") or 0)
    if window and arch == "gpt-oss":  # alternating sliding / full layers
        return KVShape(elems, layers - layers // 2, layers // 2, window)
    if window and arch in ("llama", "mistral"):
        return KVShape(elems, 0, layers, window)
    return KVShape(elems, layers)


def profile_from_gguf(path: Path) -> ModelProfile:
    """Weight groups with their stored byte sizes, so quantised files count as stored."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = str(_meta(reader, "general.architecture"))
    layers = int(_meta(reader, f"{arch}.block_count"))
    hidden = int(_meta(reader, f"{arch}.embedding_length"))
    heads_meta = _meta(reader, f"{arch}.attention.head_count")
    heads = int(heads_meta[0] if isinstance(heads_meta, list) else heads_meta)
    experts = int(_meta(reader, f"{arch}.expert_count") or 0)
    used = int(_meta(reader, f"{arch}.expert_used_count") or 0)
    sums: dict[str, list[float]] = {}  # group -> [total params, active params, active bytes]
    classes: dict[str, str] = {}
    tied = True
    embed: tuple[int, float] | None = None
    for t in reader.tensors:
        n, nbytes = int(t.n_elements), float(t.n_bytes)
        if t.name == "token_embd.weight":
            embed = (n, nbytes)
            continue
        if t.name == "output.weight":
            tied = False
            group, cls, share = "lm_head", HEAD, 1.0
        else:
            group, cls = _gguf_group(t.name)
            share = used / experts if group == "routed_experts" and experts else 1.0
        acc = sums.setdefault(group, [0, 0, 0.0])
        acc[0] += n
        acc[1] += round(n * share)
        acc[2] += nbytes * share
        classes[group] = cls
    if embed is None:
        raise ValueError(f"{path}: no token_embd.weight tensor")
    n_embed, bytes_embed = embed
    # One row gathered per token; tied, the same table is also read in full as the head.
    row_bytes = bytes_embed * hidden / n_embed
    groups = [WeightGroup("embedding", 0 if tied else n_embed, hidden, HEAD, row_bytes)]
    if tied:
        groups.append(WeightGroup("lm_head", n_embed, n_embed, HEAD, bytes_embed))
    for group, (total, active, nbytes) in sums.items():
        groups.append(WeightGroup(group, int(total), int(active), classes[group], nbytes))
    name = path.stem  # file names carry the quantisation; general.name often does not
    kv = _gguf_kv(reader, arch, layers, hidden, heads)
    # Stored sizes are used unless --dtype asks otherwise; bf16 is what our engine
    # dequantises GGUF weights to, so it stands as the "native" precision.
    return ModelProfile(name, tuple(groups), kv, Precision("bf16"), str(path))


# --------------------------------------------------------------------------- references


def profile_from_ref(ref: str) -> ModelProfile:
    """A local HF directory, a .gguf file, a directory holding one, or an HF hub id (only
    its config.json is fetched)."""
    from monokernel.weights.loader import resolve_model_path

    path = Path(ref).expanduser()
    if not path.exists():
        path = _hub_config_dir(ref) or resolve_model_path(ref, progress=False)
    if path.is_file():
        if path.suffix == ".gguf":
            return profile_from_gguf(path)
        if path.name.endswith(".json"):
            return profile_from_hf_dict(json.loads(path.read_text()), path.parent.name, str(path))
        raise ValueError(f"{path} is neither a .gguf nor a config.json")
    config = path / "config.json"
    if config.is_file():
        return profile_from_hf_dict(json.loads(config.read_text()), path.name, str(config))
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return profile_from_gguf(ggufs[0])
    raise ValueError(f"{path} holds no config.json and not exactly one .gguf file")


def _hub_config_dir(ref: str) -> Path | None:
    """Fetch only config.json for a hub id (the roofline needs no weights); None when
    ``ref`` does not look like one."""
    from monokernel.errors import ModelNotFoundError

    if not _HUB_ID.match(ref) or ref.endswith(".gguf"):
        return None
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(ref, "config.json")).parent
    except Exception as e:  # offline, missing package, unknown repo: all end the same way
        raise ModelNotFoundError(
            f"{ref!r} is not a local path and its config.json could not be fetched from the "
            f"HF hub ({type(e).__name__}); pass a local directory, config.json or .gguf"
        ) from e
