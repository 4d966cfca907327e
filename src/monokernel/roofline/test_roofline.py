"""Roofline arithmetic checked against numbers worked out by hand (in the comments)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from monokernel.bench.hf import hf_config_dict
from monokernel.errors import UnsupportedModelError
from monokernel.models.config import config_from_hf_dict
from monokernel.models.shapes import CATALOGUE, DENSE_SHAPES
from monokernel.roofline.calc import (
    KVShape,
    ModelShape,
    Precision,
    RooflineInputs,
    attention_params,
    kv_bytes,
    kv_shape,
    profile_from_shape,
    roofline,
    weight_bytes,
    weight_groups,
)
from monokernel.roofline.cli import main
from monokernel.roofline.sources import (
    PRESET_NAMES,
    get_preset,
    profile_from_gguf,
    profile_from_hf_dict,
    shape_from_hf_dict,
)

# vocab 10, hidden 4, 2 layers, 2 heads of dim 2 sharing 1 KV head, MLP width 6.
DENSE = ModelShape(
    name="dense",
    vocab_size=10,
    hidden_size=4,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=2,
    intermediate_size=6,
)


def _groups(shape: ModelShape) -> dict[str, tuple[int, int]]:
    return {g.name: (g.total_params, g.active_params) for g in weight_groups(shape)}


def test_dense_untied_by_hand() -> None:
    # attention/layer: q 4x4 + k,v 4x2 each + o 4x4 = 16+8+8+16 = 48; MLP 3*4*6 = 72;
    # norms 2*4 per layer + 4 final = 20; table 10x4 = 40.
    assert attention_params(DENSE) == 48
    assert _groups(DENSE) == {
        "embedding": (40, 4),  # a gather: one 4-wide row per token
        "lm_head": (40, 40),  # a full GEMV
        "attention": (96, 96),
        "dense_mlp": (144, 144),
        "norms": (20, 20),
    }
    p = profile_from_shape(DENSE, Precision("bf16"))
    assert (p.total_params, p.active_params) == (340, 304)
    assert weight_bytes(p.groups, Precision("bf16")) == 608
    assert weight_bytes(p.groups, Precision("fp8")) == 304


def test_tied_reads_the_table_once_as_the_head() -> None:
    tied = profile_from_shape(
        ModelShape(**{**_fields(DENSE), "tie_word_embeddings": True}), Precision("bf16")
    )
    # Holds the table once (340 - 40), but a token still reads the full head + one row.
    assert (tied.total_params, tied.active_params) == (300, 304)


def _fields(shape: ModelShape) -> dict[str, Any]:
    return {name: getattr(shape, name) for name in shape.__slots__}


def test_kv_bytes_at_context() -> None:
    # 2 layers x (K + V) x 1 kv head x dim 2 = 4 elements per layer per token.
    kv = kv_shape(DENSE)
    assert kv == KVShape(4, 2)
    assert kv_bytes(kv, 100, "bf16") == 2 * 4 * 100 * 2  # 1600
    assert kv_bytes(kv, 100, "fp8") == 800
    assert kv_bytes(kv, 0, "bf16") == 0


def test_sliding_window_layers_read_at_most_the_window() -> None:
    kv = KVShape(4, full_layers=1, window_layers=1, window=8)
    assert kv.positions_read(100) == 100 + 8
    assert kv.positions_read(5) == 5 + 5


def test_moe_with_shared_expert_and_dense_layer() -> None:
    moe = ModelShape(
        **{
            **_fields(DENSE),
            "num_layers": 3,
            "num_experts": 8,
            "experts_per_token": 2,
            "moe_intermediate_size": 3,
            "num_shared_experts": 1,
            "shared_intermediate_size": 5,
            "num_dense_layers": 1,
        }
    )
    # expert = 3*4*3 = 36; 2 MoE layers: routed 36*8*2 = 576 held, 36*2*2 = 144 read;
    # shared 3*4*5 = 60 per layer, always read; router 4x8 per MoE layer, read in full;
    # one dense MLP layer 72; attention 48*3; norms 2*4*3 + 4 = 28.
    assert _groups(moe) == {
        "embedding": (40, 4),
        "lm_head": (40, 40),
        "attention": (144, 144),
        "dense_mlp": (72, 72),
        "routed_experts": (576, 144),
        "shared_experts": (120, 120),
        "router": (64, 64),
        "norms": (28, 28),
    }
    p = profile_from_shape(moe, Precision("bf16"))
    assert p.active_params == 616
    # Experts (routed + shared = 264 params) in int4 (4.5 bits with its scales), the other
    # 352 in bf16.
    assert weight_bytes(p.groups, Precision("bf16", experts="int4")) == 264 * 4.5 / 8 + 352 * 2


def test_mla_counts_latent_projections_and_caches_the_latent() -> None:
    mla = ModelShape(
        name="mla",
        vocab_size=10,
        hidden_size=8,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        head_dim=3,
        intermediate_size=6,
        q_lora_rank=4,
        kv_lora_rank=3,
        qk_nope_head_dim=2,
        qk_rope_head_dim=1,
        v_head_dim=2,
    )
    # q: 8x4 down + norm 4 + 4x(2 heads x 3) up = 60; kv_a: 8x(3+1) + norm 3 = 35;
    # kv_b: 3x(2 x (2+2)) = 24; o: (2x2)x8 = 32.
    assert attention_params(mla) == 60 + 35 + 24 + 32
    # The cache holds the latent (3) + the shared rope key (1), not 2 x heads x dim = 12.
    assert kv_shape(mla) == KVShape(4, 1)
    assert kv_bytes(kv_shape(mla), 10, "bf16") == 4 * 10 * 2


def test_ceiling_tp_and_mbu() -> None:
    p = profile_from_shape(DENSE, Precision("bf16"))
    base = RooflineInputs(gpu="x", bandwidth_per_gpu=6080.0, bandwidth_source="datasheet")
    one = roofline(p, base)
    assert one.bytes_per_token == 608
    assert one.ceiling_tok_s == pytest.approx(10.0)
    four = roofline(p, RooflineInputs("x", 6080.0, "datasheet", tp=4, context=100, mbu=0.5))
    # 4 GPUs; bytes 608 weights + 1600 KV.
    assert four.bandwidth_bytes_per_s == 4 * 6080
    assert four.bytes_per_token == 608 + 1600
    assert four.ceiling_tok_s == pytest.approx(24320 / 2208)
    assert four.estimate_tok_s == pytest.approx(0.5 * 24320 / 2208)
    with pytest.raises(ValueError, match="mbu"):
        roofline(p, RooflineInputs("x", 1.0, "datasheet", mbu=1.5))


def test_presets_match_published_totals() -> None:
    llama = get_preset("Llama-3.2-1B")
    assert weight_bytes(llama.groups, llama.native) == pytest.approx(2.47e9, rel=2e-3)  # DESIGN
    qwen = get_preset("qwen2.5-coder-1.5b")
    assert weight_bytes(qwen.groups, qwen.native) == pytest.approx(3.09e9, rel=2e-3)
    oss = get_preset("gpt-oss-120b")  # model card: 116.83B total, 5.13B active
    assert oss.total_params == pytest.approx(116.83e9, rel=1e-3)
    assert oss.active_params == pytest.approx(5.13e9, rel=2e-3)
    ds = get_preset("deepseek-v3")  # 671B total, ~37B active
    assert ds.total_params == pytest.approx(671e9, rel=2e-3)
    assert 36e9 < ds.active_params < 38e9
    assert ds.kv.elems_per_token_per_layer == 512 + 64
    q3 = get_preset("qwen3-coder-30b-a3b")
    assert q3.total_params == pytest.approx(30.5e9, rel=5e-3)


@pytest.mark.parametrize("key", sorted(DENSE_SHAPES))
def test_dense_catalogue_shapes_agree_with_their_config(key: str) -> None:
    """The roofline's shape of a dense entry is what its raw config.json reads as, and both
    parameter counts (the roofline's groups, ModelConfig's own) agree."""
    entry, cfg = CATALOGUE[key], DENSE_SHAPES[key]
    assert shape_from_hf_dict(hf_config_dict(cfg), entry.name) == entry.shape
    profile = profile_from_shape(entry.shape, entry.native)
    assert profile.total_params == cfg.num_parameters()
    assert profile.kv.elems_per_token_per_layer == 2 * cfg.kv_size


def test_presets_are_the_catalogues_real_models() -> None:
    assert "odd" not in {n.lower() for n in PRESET_NAMES}  # synthetic: no source to cite
    assert all(get_preset(n).source == CATALOGUE[n.lower()].source for n in PRESET_NAMES)
    assert get_preset("llama-1b") == get_preset("LLAMA-3.2-1B")  # an alias, any case
    with pytest.raises(ValueError, match="unknown preset 'odd'"):
        get_preset("odd")


@pytest.mark.parametrize(
    ("name", "billions"),
    # The model cards' parameter counts, embeddings included (Qwen2.5-Coder-32B: the hub's
    # count of its safetensors; the card rounds to 32.5B).
    [
        ("llama-3.1-8b", 8.03),
        ("mistral-7b", 7.25),
        ("qwen2.5-coder-7b", 7.62),
        ("qwen2.5-coder-14b", 14.7),
        ("qwen2.5-coder-32b", 32.8),
        ("qwen3-4b", 4.02),
        ("qwen3-8b", 8.19),
        ("qwen3-14b", 14.8),
    ],
)
def test_issue_34_presets_match_their_model_cards(name: str, billions: float) -> None:
    assert get_preset(name).total_params == pytest.approx(billions * 1e9, rel=5e-3)


DEEPSEEK_V3_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
}


def test_raw_moe_config_matches_the_preset() -> None:
    with pytest.raises(UnsupportedModelError):
        config_from_hf_dict(DEEPSEEK_V3_CONFIG)  # the engine refuses it; the roofline reads it
    p = profile_from_hf_dict(DEEPSEEK_V3_CONFIG, "DeepSeek-V3")
    preset = get_preset("DeepSeek-V3")
    assert p.groups == preset.groups
    assert p.kv == preset.kv
    assert p.native == preset.native


def test_qwen3_moe_and_gpt_oss_configs() -> None:
    qwen3 = {
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
    }
    assert weight_groups(shape_from_hf_dict(qwen3)) == get_preset("qwen3-coder-30b-a3b").groups
    oss = {
        "model_type": "gpt_oss",
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 36,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 18,
        "attention_bias": True,
        "quantization_config": {"quant_method": "mxfp4"},
        "torch_dtype": "bfloat16",
    }
    p, preset = profile_from_hf_dict(oss, "GPT-OSS-120B"), get_preset("gpt-oss-120b")
    assert (p.groups, p.kv, p.native) == (preset.groups, preset.kv, preset.native)
    assert p.kv == KVShape(2 * 8 * 64, full_layers=18, window_layers=18, window=128)


def test_gguf_counts_stored_bytes(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "moe.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(4)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(2)
    w.add_value_length(2)
    w.add_expert_count(4)
    w.add_expert_used_count(1)
    w.add_tensor("token_embd.weight", np.zeros((10, 4), np.float32))  # tied: no output.weight
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 4), np.float16))
    w.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((4, 3, 4), np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    p = profile_from_gguf(path)
    by_name = {g.name: g for g in p.groups}
    assert by_name["lm_head"].stored_bytes == 160  # the tied f32 table, read in full
    assert by_name["embedding"].stored_bytes == 16  # one f32 row
    assert by_name["attention"].stored_bytes == 32  # f16 4x4
    assert by_name["routed_experts"].active_params == 12  # 1 of 4 experts of 3x4
    assert by_name["routed_experts"].stored_bytes == 48
    assert p.kv == KVShape(1 * (2 + 2), 1)
    r = roofline(p, RooflineInputs("x", 1e3, "datasheet"))
    assert r.weight_bytes == 160 + 16 + 32 + 48 + 16
    assert r.precision.startswith("as stored")


def _run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> Any:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_json(["--preset", "llama-3.2-1b", "--bandwidth", "measured"], capsys)
    p = get_preset("llama-3.2-1b")
    assert out["bytes_per_token"] == round(weight_bytes(p.groups, p.native))
    assert out["bandwidth_bytes_per_s"] == 2.96e12
    assert out["ceiling_tok_s"] == pytest.approx(1198, abs=1)  # DESIGN's floor: 835 µs
    assert out["inputs"]["bandwidth_source"] == "measured"
    out = _run_json(
        ["--preset", "llama-3.2-1b", "--gpu", "h200", "--tp", "8", "--context", "4096"], capsys
    )
    # KV: 16 layers x 2 x 8 heads x 64 x 4096 tokens x 2 bytes.
    assert out["inputs"]["context"] == 4096
    assert out["bytes_per_token"] - round(weight_bytes(p.groups, p.native)) == pytest.approx(
        16 * 2 * 8 * 64 * 4096 * 2, abs=1
    )
    assert out["bandwidth_bytes_per_s"] == 8 * 4.8e12
    assert out["ceiling_tok_s"] == pytest.approx(8 * 4.8e12 / out["bytes_per_token"], rel=1e-6)


def test_cli_model_dir_dtype_and_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "ds"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(DEEPSEEK_V3_CONFIG))
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps([{"model": "ds", "gpu": "h200", "tp": 8, "tok_s": 300.0}]))
    out = _run_json(
        [str(model), "--gpu", "h200", "--tp", "8", "--dtype", "int4", "--measured", str(measured)],
        capsys,
    )
    p = get_preset("deepseek-v3")
    assert out["bytes_per_token"] == round(p.active_params * 4.5 / 8)
    assert out["measured_tok_s"] == 300.0
    assert out["measured_fraction_of_ceiling"] == pytest.approx(300 / out["ceiling_tok_s"], 1e-3)
    # The table shows the measurement beside the ceiling.
    assert main([str(model), "--gpu", "h200", "--tp", "8", "--measured", str(measured)]) == 0
    table = capsys.readouterr().out
    assert "measured tok/s" in table and "300 (" in table


def test_cli_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--preset", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err
    assert main(["--preset", "llama-3.2-1b", "--gpu", "b200", "--bandwidth", "measured"]) == 2
    assert "no measured bandwidth" in capsys.readouterr().err


def test_cli_dtype_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    oss = get_preset("gpt-oss-120b")
    experts = next(g.active_params for g in oss.groups if g.name == "routed_experts")
    rest = oss.active_params - experts
    out = _run_json(["--preset", "gpt-oss-120b", "--dtype", "bf16"], capsys)
    assert out["bytes_per_token"] == oss.active_params * 2
    # Native storage, experts re-quantised to fp8: the rest stays bf16.
    out = _run_json(["--preset", "gpt-oss-120b", "--expert-dtype", "fp8"], capsys)
    assert out["bytes_per_token"] == experts * 1 + rest * 2
    assert out["inputs"]["precision"] == "bf16 (experts fp8)"


def test_dense_layer_counts_from_config() -> None:
    base = {**DEEPSEEK_V3_CONFIG, "num_hidden_layers": 10, "moe_layer_freq": 2}
    # Layers 0-2 dense, then every second layer (3, 5, 7, 9) MoE: 10 - 4 = 6 dense.
    assert shape_from_hf_dict(base).num_dense_layers == 6
    qwen = {"model_type": "qwen2_moe", "vocab_size": 10, "hidden_size": 4}
    qwen |= {"num_hidden_layers": 4, "num_attention_heads": 2, "num_experts": 4}
    qwen |= {"num_experts_per_tok": 2, "decoder_sparse_step": 2, "mlp_only_layers": [1]}
    qwen |= {"shared_expert_intermediate_size": 8, "moe_intermediate_size": 3}
    # step 2: layers 1 and 3 are MoE, but layer 1 is listed dense; one shared expert of 8.
    shape = shape_from_hf_dict(qwen)
    assert (shape.num_dense_layers, shape.moe_layers) == (3, 1)
    assert (shape.num_shared_experts, shape.shared_intermediate_size) == (1, 8)


# ---- TP projection from a measured stage profile (tp_projection.py) -----------------------


def _profile(us: dict[str, float]) -> dict[str, float]:
    return {f"{s}.work": v for s, v in us.items()} | {"A.wait": 1.0}


def test_tp_projection_keeps_the_fixed_cost_and_splits_the_bytes() -> None:
    from monokernel.models.shapes import SHAPES
    from monokernel.roofline.tp_projection import project, stage_bytes

    cfg = SHAPES["odd"]
    bw = 1e12
    sizes = stage_bytes(cfg, context=100)
    # Each stage: its bytes' time at bw plus 5 µs (A: 4 + its 1 µs wait), S 2 µs of work.
    us = {s: b / bw * 1e6 + 5.0 for s, b in sizes.items()} | {"S": 2.0}
    us["A"] -= 1.0
    one = project(cfg, _profile(us), bw, 1, 3.0, 100)
    assert one.total_us == pytest.approx(one.measured_tp1_us) and one.collective_us == 0
    two = project(cfg, _profile(us), bw, 2, 3.0, 100)
    streamed = sum(sizes.values()) / bw * 1e6
    fixed = 5.0 * 6 + 2.0
    assert two.allreduces == 2 * cfg.num_layers + 1
    assert two.total_us == pytest.approx(fixed + streamed / 2 + 3.0 * two.allreduces)
    assert two.speedup == pytest.approx((fixed + streamed) / two.total_us)
    # A stage faster than its bytes allow (clock noise) has no fixed cost, not a negative one.
    fast = project(cfg, _profile(us | {"D": 0.0}), bw, 2, 0.0, 100)
    assert {s.stage: s.fixed_us for s in fast.stages}["D"] == 0.0


def test_tp_projection_reads_a_bench_json_and_refuses_one_without_a_profile(
    tmp_path: Path,
) -> None:
    from monokernel.models.shapes import SHAPES
    from monokernel.roofline.tp_projection import from_bench_json

    cfg = SHAPES["odd"]
    prof = _profile({s: 10.0 for s in "ABCDEFS"})
    cell = {"engine": "monokernel", "prompt_tokens": 64, "gen_tokens": 32}
    doc = {"runs": [{"copy_bw_GBps": 3000.0}], "cells": [cell | {"stage_profile_us": prof}]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    proj, got = from_bench_json(path, cfg, 2, 1.0)
    assert got["stage_profile_us"] == prof and proj.measured_tp1_us == pytest.approx(71.0)
    path.write_text(json.dumps({"runs": doc["runs"], "cells": [cell]}))
    with pytest.raises(ValueError, match="no monokernel cell with a stage profile"):
        from_bench_json(path, cfg, 2, 1.0)
    assert main(["odd", "--tp", "2", "--stage-profile", str(path)]) == 2  # no --allreduce-us
