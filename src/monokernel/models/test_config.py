"""ModelConfig from HF config dicts: every family maps, and what we cannot run is refused."""

from __future__ import annotations

from typing import Any

import pytest

from monokernel.errors import UnsupportedModelError
from monokernel.models.config import config_from_hf_dict
from monokernel.testing.tiny_models import TINY_FAMILIES, tiny_hf_config


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_families_map(family: str) -> None:
    hf = tiny_hf_config(family)
    cfg = config_from_hf_dict(hf.to_dict())
    assert cfg.num_heads == 6 and cfg.num_kv_heads == 2
    assert cfg.head_dim == (24 if family == "qwen3" else 12)
    assert cfg.qkv_bias == (family in ("qwen2", "llama-bias"))
    assert cfg.o_bias == (family == "llama-bias")
    assert cfg.qk_norm == (family == "qwen3")
    assert (cfg.rope_scaling is not None) == (family == "llama3")


def _llama(**extra: Any) -> dict[str, Any]:
    return tiny_hf_config("llama-tied").to_dict() | extra


def test_old_style_rope_fields() -> None:
    d = _llama()
    d.pop("rope_parameters", None)
    d |= {
        "rope_theta": 1234.0,
        "rope_scaling": {
            "type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    }
    cfg = config_from_hf_dict(d)
    assert cfg.rope_theta == 1234.0 and cfg.rope_scaling and cfg.rope_scaling.factor == 4.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported; supported: llama"),
        ({"model_type": "mixtral"}, "not supported"),
        ({"num_local_experts": 8}, "mixture-of-experts"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"model_type": "mistral", "sliding_window": 64}, "sliding-window"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope_type 'yarn'"),
        ({"num_key_value_heads": 4}, "not a multiple"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_unsupported_is_refused_by_name(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        config_from_hf_dict(_llama(**overrides))
