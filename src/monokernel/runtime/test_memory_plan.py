"""Planning the context before the weights load: real shapes on made-up free memory, the
agreement with the monokernel backend's own check, and the advice when nothing fits."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from monokernel.errors import InvalidRequestError
from monokernel.models.config import ModelConfig
from monokernel.models.shapes import DENSE_SHAPES
from monokernel.runtime import kv_memory
from monokernel.runtime import memory_plan as mp
from monokernel.runtime.memory_plan import (
    DEFAULT_MAX_MODEL_LEN,
    GIB,
    ContextTooLargeError,
    LayerPacking,
    PlanSettings,
    plan_context,
)
from monokernel.runtime.prefill_graphs import MAX_SUFFIX_BUCKET
from monokernel.weights.loader import Announced
from monokernel.weights.quantize import GroupsPlan
from monokernel.weights.shard import TensorParallelError

GPU = PlanSettings(where="cuda:0")
LLAMA8 = DENSE_SHAPES["llama-3.1-8b"]
QWEN32 = DENSE_SHAPES["qwen2.5-coder-32b"]


def _bf16_weights(cfg: ModelConfig) -> int:
    return 2 * cfg.num_parameters()


def _backend_check(
    cfg: ModelConfig, n: int, free_after_weights: int, s: PlanSettings
) -> kv_memory.LoadPhases:
    """What MonokernelBackend asks kv_memory once a dense checkpoint is on the GPU (its
    layers from dense matrices: bf16 or --quantize's format)."""
    packing = kv_memory.Packing(
        s.layers.fmt, consume=s.consume, fold=False, convert=s.dtype_bytes != 2
    )
    return kv_memory.check_load_fits(
        cfg, n, free_after_weights, s.chunk_tokens, s.precision, s.where, packing, s.graphs
    )


def test_cpu_keeps_the_fixed_default_capped_by_the_model() -> None:
    plan = plan_context(LLAMA8, None, _bf16_weights(LLAMA8), "reference", None)
    assert plan.max_model_len == DEFAULT_MAX_MODEL_LEN
    assert plan.note == "context: 8192 tokens (the CPU default; model max 131072)"
    small = DENSE_SHAPES["odd"]  # model max 4096
    assert plan_context(small, None, 1, "reference", None).max_model_len == 4096
    asked = plan_context(small, None, 1, "reference", 100_000)
    assert asked.max_model_len == 4096
    assert "--max-model-len 100000 capped at the model's maximum" in asked.note
    assert plan_context(small, None, 1, "reference", 300).max_model_len == 300


def test_llama_8b_on_80_gib_gets_its_whole_context() -> None:
    weights = _bf16_weights(LLAMA8)
    plan = plan_context(LLAMA8, 80 * GIB, weights, "monokernel", None, settings=GPU)
    assert plan.max_model_len == 131072
    assert plan.note.startswith("context: 131072 tokens (the model's maximum; fits in ")
    assert "GiB of weights; model max 131072)" in plan.note
    assert plan.need_bytes is not None and plan.need_bytes <= 80 * GIB
    # The backend's later check, on what is left after the weights, agrees.
    _backend_check(LLAMA8, plan.max_model_len, 80 * GIB - weights, GPU)


@pytest.mark.parametrize(
    ("name", "free_gib"),
    [("llama-3.1-8b", 30), ("llama-3.1-8b", 40), ("qwen2.5-coder-32b", 110), ("odd", 0.6)],
)
def test_the_chosen_context_is_the_largest_and_passes_the_backend_check(
    name: str, free_gib: float
) -> None:
    cfg = DENSE_SHAPES[name]
    free, weights = int(free_gib * GIB), _bf16_weights(cfg)
    plan = plan_context(cfg, free, weights, "monokernel", None, settings=GPU)
    n = plan.max_model_len
    assert 0 < n < cfg.max_position_embeddings  # each of these needs a shorter context
    assert n % 256 == 0 or n < 256
    assert f"context: {n} tokens (the largest that fits in " in plan.note
    _backend_check(cfg, n, free - weights, GPU)  # does not raise
    # Largest up to the rounding: 256 more tokens do not fit beside the slack.
    need_more = mp.need_bytes(cfg, n + 256, weights, "monokernel", 1, GPU)
    assert need_more > free - 64 * 1024 * 1024


def test_repacking_is_counted_for_the_monokernel_only() -> None:
    weights = _bf16_weights(LLAMA8)
    mono = mp.need_bytes(LLAMA8, 8192, weights, "monokernel", 1, GPU)
    torch_ = mp.need_bytes(LLAMA8, 8192, weights, "torch", 1, GPU)
    # A caller's checkpoint (not consumed): every layer's fused QKV and gate/up copies stay.
    fused = kv_memory.repack_phase(LLAMA8, kv_memory.Packing()).weights
    assert fused > 2 * GIB and mono - torch_ >= fused
    # A float32 model on the GPU: the monokernel's bf16 copy, the torch engine's fp32 cache.
    f32 = PlanSettings(dtype_bytes=4)
    assert (
        mp.need_bytes(LLAMA8, 8192, 2 * weights, "monokernel", 1, f32)
        - (mp.need_bytes(LLAMA8, 8192, 2 * weights, "monokernel", 1, GPU))
        == 2 * LLAMA8.num_parameters()
    )
    cache16 = mp.need_bytes(LLAMA8, 8192, weights, "torch", 1, GPU)
    cache32 = mp.need_bytes(LLAMA8, 8192, weights, "torch", 1, f32)
    assert cache32 - cache16 == kv_memory.kv_bytes_per_token(LLAMA8) * 8192


def test_torch_keeps_8192_by_default_and_says_how_much_more_fits() -> None:
    plan = plan_context(LLAMA8, 80 * GIB, _bf16_weights(LLAMA8), "torch", None, settings=GPU)
    assert plan.max_model_len == 8192
    assert "the torch engine's default, as its decode step reads the whole cache" in plan.note
    assert "--max-model-len up to 131072 fits" in plan.note


def test_qwen_32b_on_72_gib_asks_for_a_shorter_context_on_torch() -> None:
    free, weights = 72 * GIB, _bf16_weights(QWEN32)
    with pytest.raises(ContextTooLargeError) as e:
        plan_context(QWEN32, free, weights, "torch", 32768, settings=GPU)
    msg = str(e.value)
    assert "\n" not in msg and "on cuda:0" in msg and "GiB of weights" in msg
    fits = int(re.search(r"--max-model-len (\d+) is the longest that fits", msg)[1])  # type: ignore[index]
    assert mp.need_bytes(QWEN32, fits, weights, "torch", 1, GPU) <= free
    assert mp.need_bytes(QWEN32, fits + 1, weights, "torch", 1, GPU) > free
    assert e.value.tokens == 32768 and e.value.free_bytes == free
    assert plan_context(QWEN32, free, weights, "torch", fits, settings=GPU).max_model_len == fits


def test_qwen_32b_on_80_gib_cannot_load_the_monokernel_and_names_torch() -> None:
    # The monokernel holds the weights and their repacked copies at once while loading.
    with pytest.raises(ContextTooLargeError, match=r"--engine torch fits up to \d+ tokens"):
        plan_context(QWEN32, 80 * GIB, _bf16_weights(QWEN32), "monokernel", None, settings=GPU)


def test_a_model_too_big_at_any_context() -> None:
    two = PlanSettings(where="cuda:0", gpus=2)
    for engine in ("torch", "monokernel"):
        with pytest.raises(InvalidRequestError) as e:
            plan_context(QWEN32, 20 * GIB, _bf16_weights(QWEN32), engine, None, settings=two)
        msg = str(e.value)
        assert msg.startswith("the model needs ") and "but 20.0 GiB is free" in msg
        assert "too large in bf16 for this GPU" in msg and "--max-model-len" not in msg
        assert "--tp 2 fits" not in msg  # half of 61 GiB does not fit in 20 either


def test_tp_is_offered_where_each_gpu_holds_its_share() -> None:
    """The sharded prefill keeps no whole model anywhere: rank 0 holds its 1/tp of the
    layers, the embedding and its LM-head rows, so 44 GiB a GPU runs the 32B at --tp 2 with
    its whole context (~31 GiB of weights, and ~10 GiB with the prefill graphs' pool for
    8,192-token chunks)."""
    weights = _bf16_weights(QWEN32)
    two = PlanSettings(where="cuda:0", gpus=2)
    with pytest.raises(ContextTooLargeError, match="--tp 2 fits"):
        plan_context(QWEN32, 44 * GIB, weights, "monokernel", None, settings=two)
    plan = plan_context(QWEN32, 44 * GIB, weights, "monokernel", 32768, tp=2, settings=two)
    assert plan.max_model_len == 32768
    shard = (weights - 4 * QWEN32.vocab_size * QWEN32.hidden_size) // 2
    # + the replicated half of the embedding, a layer being repacked, the reserve
    assert shard < mp.need_bytes(QWEN32, 1, weights, "monokernel", 2, two) < weights // 2 + 2 * GIB


def test_tp_counts_rank_zero_and_refuses_a_bad_split() -> None:
    cfg = DENSE_SHAPES["llama-3.2-1b"]
    weights = _bf16_weights(cfg)
    one = mp.need_bytes(cfg, 4096, weights, "monokernel", 1, GPU)
    two = mp.need_bytes(cfg, 4096, weights, "monokernel", 2, GPU)
    assert two < one  # its shard, its KV heads' cache
    with pytest.raises(TensorParallelError):
        plan_context(cfg, 80 * GIB, weights, "monokernel", None, tp=3, settings=GPU)


def test_tp_counts_its_prefill_graphs() -> None:
    """The graphs of the sharded prefill (the largest bucket's tokens, residual and pool,
    every bucket's RoPE tables) are counted on rank 0 where the graphs are on."""
    from dataclasses import replace

    from monokernel.models.config import ModelConfig as Cfg
    from monokernel.runtime.prefill_tp_graphs import graph_bytes
    from monokernel.weights.shard import rank_config, shard_config

    cfg: Cfg = DENSE_SHAPES["qwen2.5-coder-1.5b"]
    weights = _bf16_weights(cfg)
    on = mp.need_bytes(cfg, 4096, weights, "monokernel", 2, GPU)
    off = mp.need_bytes(cfg, 4096, weights, "monokernel", 2, replace(GPU, graphs=False))
    rank = rank_config(shard_config(cfg, 0, 2))
    assert on - off == graph_bytes(rank, GPU.chunk_tokens, 4096, GPU.precision)
    # The tokens (int64) and the residual [T, H] fp32 of the largest bucket (4,096 rows here),
    # every bucket's RoPE positions and factors (16 + 32 + ... + 4,096 rows).
    rows = 2 * 4096 - 16
    statics = (4 * rank.hidden_size + 8) * 4096 + (8 + 8 * rank.head_dim) * rows
    assert statics < on - off < statics + 4 * GIB
    # A short context caps the buckets.
    assert graph_bytes(rank, GPU.chunk_tokens, 100, GPU.precision) < on - off


def test_float32_weights_that_fit_in_bf16_say_so() -> None:
    cfg = DENSE_SHAPES["llama-3.2-1b"]
    f32 = PlanSettings(where="cuda:0", dtype_bytes=4)
    free = 4 * GIB  # 1.2B parameters: 4.6 GiB in float32, 2.3 GiB in bf16
    with pytest.raises(InvalidRequestError, match="--dtype bfloat16 fits"):
        plan_context(cfg, free, 4 * cfg.num_parameters(), "torch", None, settings=f32)


@pytest.mark.parametrize("name", ["odd", "odd-wide", "smollm2-135m"])
def test_odd_shapes_an_asked_length_is_exact(name: str) -> None:
    cfg = DENSE_SHAPES[name]
    weights = _bf16_weights(cfg)
    for engine in ("monokernel", "torch"):
        need = mp.need_bytes(cfg, 1000, weights, engine, 1, GPU)
        plan = plan_context(cfg, need, weights, engine, 1000, settings=GPU)
        assert plan.max_model_len == 1000 and plan.need_bytes == need
        assert plan.note.startswith("context: 1000 tokens (--max-model-len 1000; ")
        with pytest.raises(ContextTooLargeError, match="--max-model-len 999 is the longest"):
            plan_context(cfg, need - 1, weights, engine, 1000, settings=GPU)


# --------------------------------------------------------------------------- packed layers

# A Qwen2.5-Coder-32B Q4_K_M's stages (weights/quantize.py groups_plan): O and gate/up in
# int4 groups of 32, QKV and down (V and down in Q6_K) in int8 groups of 16.
Q4_K_M = LayerPacking("int8", GroupsPlan(("int4", 32), ("int8", 16), ("int8", 16)))
# An 80 GB H100's free bytes before the weights: the 32B in bf16 gets 30,720 tokens there
# (28,672 where a layer's fused copies were counted beside the cache too).
H100_FREE = int(79.1 * GIB)


def _packed(layers: LayerPacking) -> PlanSettings:
    return replace(GPU, consume=True, layers=layers)


def _q4_k_m_by_hand(cfg: ModelConfig) -> int:
    """The 32B Q4_K_M on the monokernel's GPU: QKV and down 1.5 bytes a weight (a byte, and
    8 bytes of scale and offset a group of 16), O and gate/up 0.75 (half a byte, 8 bytes a
    group of 32); the embedding, LM head, norms and biases in bf16."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    layer_weights = h * (q + 2 * kv) + q * h + 3 * h * i
    packed = 1.5 * (h * (q + 2 * kv) + h * i) + 0.75 * (h * q + 2 * h * i)
    rest = cfg.num_parameters() - cfg.num_layers * layer_weights
    return int(cfg.num_layers * packed + 2 * rest)


def _group_packing(layers: LayerPacking) -> kv_memory.Packing:
    """The Packing MonokernelBackend counts for a checkpoint's own groups (the engine's
    checkpoint, consumed): an AWQ/GPTQ checkpoint's groups on the GPU, a GGUF's on the
    host; either's layer matrices unread."""
    return kv_memory.Packing(
        layers.fmt,
        layers.groups,
        consume=True,
        dense_layers=False,
        groups_on_device=layers.groups_on_device,
    )


def _group_loaded(cfg: ModelConfig, layers: LayerPacking, dense: int) -> int:
    """What reaches the GPU before the backend checks: every tensor but the layer
    matrices, and for AWQ/GPTQ the groups."""
    assert layers.groups is not None
    rest = dense - 2 * kv_memory.layer_matrix_params(cfg)
    if layers.groups_on_device:
        return rest + kv_memory.group_bytes(cfg, layers.groups)
    return rest


def _group_check(
    cfg: ModelConfig, n: int, free: int, layers: LayerPacking, dense: int
) -> kv_memory.LoadPhases:
    """What MonokernelBackend asks kv_memory once what reaches the GPU before it is there."""
    return kv_memory.check_load_fits(
        cfg,
        n,
        free - _group_loaded(cfg, layers, dense),
        GPU.chunk_tokens,
        GPU.precision,
        "cuda:0",
        _group_packing(layers),
        True,
    )


def test_a_32b_q4_k_m_counts_its_packed_layers_not_bf16() -> None:
    dense = mp.dense_weight_bytes(QWEN32, 2)
    by_hand = _q4_k_m_by_hand(QWEN32)
    weights = mp.device_weight_bytes(QWEN32, dense, "monokernel", 1, _packed(Q4_K_M))
    assert abs(weights - by_hand) < 0.01 * by_hand
    assert weights < 0.55 * dense  # 35 GB against bf16's 65.5
    # The engines that compute with dense matrices hold them so whatever the checkpoint.
    for engine in ("torch", "reference"):
        assert mp.device_weight_bytes(QWEN32, dense, engine, 1, _packed(Q4_K_M)) == dense
        assert mp.need_bytes(QWEN32, 8192, dense, engine, 1, _packed(Q4_K_M)) == mp.need_bytes(
            QWEN32, 8192, dense, engine, 1, GPU
        )


def test_packed_groups_are_counted_once() -> None:
    """The packed layers are among the weights the plan reports, and the backend's check
    counts them as its repack makes them: the plan's total is the check's to the byte."""
    dense = mp.dense_weight_bytes(QWEN32, 2)
    need = mp.need_bytes(QWEN32, 8192, dense, "monokernel", 1, _packed(Q4_K_M))
    assert Q4_K_M.groups is not None
    on_host = dense - 2 * kv_memory.layer_matrix_params(QWEN32)  # embedding, head, norms
    phases = _group_check(QWEN32, 8192, need, Q4_K_M, dense)
    assert need == on_host + phases.peak
    with pytest.raises(InvalidRequestError):
        _group_check(QWEN32, 8192, need - 1, Q4_K_M, dense)
    packed = kv_memory.group_pack_bytes(QWEN32, Q4_K_M.groups)
    assert (
        on_host + packed
        < mp.device_weight_bytes(QWEN32, dense, "monokernel", 1, _packed(Q4_K_M))
        < on_host + packed + 16 * 1024 * 1024
    )  # and the layers' float32 gains and biases
    assert need - packed < mp.need_bytes(QWEN32, 8192, dense, "monokernel", 1, GPU) - dense


def test_a_32b_q4_k_m_gets_a_longer_context_on_an_80_gb_h100() -> None:
    dense = mp.dense_weight_bytes(QWEN32, 2)
    bf16 = plan_context(
        QWEN32, H100_FREE, dense, "monokernel", None, settings=_packed(LayerPacking())
    )
    q4 = plan_context(QWEN32, H100_FREE, dense, "monokernel", None, settings=_packed(Q4_K_M))
    assert bf16.max_model_len < QWEN32.max_position_embeddings == q4.max_model_len
    assert "the model's maximum; fits in" in q4.note
    _group_check(QWEN32, q4.max_model_len, H100_FREE, Q4_K_M, dense)
    # Up to a longer maximum (YaRN's 131,072), the longest that fits: the weight bytes the
    # groups save, each token costing its K and V (64 layers x 8 heads x 128 x 2 x 2 bytes),
    # its RoPE tables (3 x 64 x 4), the GQA-expanded K and V in the prefill's and the turn
    # graph's workspace (2 x 2 x 40 heads x 128 x 2) and the turn graph's masks (5 x 1,024).
    long = replace(QWEN32, max_position_embeddings=131072)
    d, layers = QWEN32.head_dim, QWEN32.num_layers
    token = 2 * layers * QWEN32.num_kv_heads * d * 2 + 3 * (d // 2) * 4
    token += 2 * 2 * QWEN32.num_heads * d * 2 + 5 * MAX_SUFFIX_BUCKET
    saved = dense - _q4_k_m_by_hand(QWEN32)
    short = plan_context(
        long, H100_FREE, dense, "monokernel", None, settings=_packed(LayerPacking())
    )
    longer = plan_context(long, H100_FREE, dense, "monokernel", None, settings=_packed(Q4_K_M))
    assert short.max_model_len == bf16.max_model_len
    gained = longer.max_model_len - short.max_model_len
    # Less a few GiB that do not grow with the context: the int8 format's dense copy of the
    # largest layer matrix in each prefill workspace, the packing's layer of groups.
    assert 0.75 * saved / token < gained < saved / token
    assert longer.max_model_len > 3 * short.max_model_len
    _group_check(long, longer.max_model_len, H100_FREE, Q4_K_M, dense)


def test_a_32b_awq_is_planned_from_its_config_as_groups() -> None:
    """Before its weights are read, a 32B AWQ checkpoint (int4 groups of 128) is planned as
    its groups: a context fits 60 GiB free, where its bf16 count (65.5 GB of weights)
    refused the model; the same plan the engine makes once the groups are read."""
    awq = mp.announced_packing(QWEN32, None, Announced("int4", 128), 1, on_device=True)
    assert awq == LayerPacking("int4", GroupsPlan(("int4", 128)), groups_on_device=True)
    dense = mp.dense_weight_bytes(QWEN32, 2)
    free = 60 * GIB
    plan = plan_context(QWEN32, free, dense, "monokernel", None, settings=_packed(awq))
    assert plan.max_model_len >= 4096
    _group_check(QWEN32, plan.max_model_len, free, awq, dense)
    with pytest.raises(ContextTooLargeError):
        plan_context(QWEN32, free, dense, "monokernel", None, settings=_packed(LayerPacking()))
    # --quantize of another method re-quantises: planned as that format, without groups.
    fp8 = mp.announced_packing(QWEN32, "fp8", Announced("int4", 128), 1, on_device=True)
    assert fp8 == LayerPacking("fp8")
    # A TP rank's groups are sharded on the host, not read to a GPU whole.
    assert not mp.announced_packing(QWEN32, None, Announced("int4", 128), 2, True).groups_on_device


def test_groups_read_to_the_gpu_are_counted_without_dense_layers() -> None:
    """An AWQ/GPTQ checkpoint is read to the GPU as its groups, its layer matrices never
    made (weights/lazy_weights.py): the groups and the other tensors are on the device when
    the backend packs the groups, and a context that needed room for dense layers too fits."""
    cfg = LLAMA8
    dense = mp.dense_weight_bytes(cfg, 2)
    awq = LayerPacking("int4", GroupsPlan(("int4", 128)), groups_on_device=True)
    weights = mp.device_weight_bytes(cfg, dense, "monokernel", 1, _packed(awq))
    # 1 byte a weight and 8 bytes a group of 128 unpacked, half a byte and 8 packed; the
    # engine's own checkpoint, so each layer's dense matrices go once it is packed (the
    # groups stay: the engine holds them), and each layer keeps its gains in float32.
    matrices = kv_memory.layer_matrix_params(cfg)
    gains = cfg.num_layers * 2 * cfg.hidden_size * 4
    assert weights == dense - 2 * matrices + matrices * (1 + 8 / 128 + 0.5 + 8 / 128) + gains
    plan = plan_context(cfg, 32 * GIB, dense, "monokernel", None, settings=_packed(awq))
    assert plan.max_model_len < cfg.max_position_embeddings  # memory, not the model, binds
    _group_check(cfg, plan.max_model_len, 32 * GIB, awq, dense)
    with pytest.raises(InvalidRequestError):  # and refuses a longer one
        _group_check(cfg, plan.max_model_len + 1024, 32 * GIB, awq, dense)
    loaded = mp._loaded_bytes(cfg, dense, 1, _packed(awq))
    assert loaded == dense - 2 * matrices + kv_memory.group_bytes(cfg, awq.groups)
    assert loaded < dense  # the dense layers (2 bytes a weight) are not among them


# --------------------------------------------------------------------------- --quantize

# Packing one weight of a layer's largest matrix (the fused gate/up) from bf16 holds, beside
# its source: the fused copy (2 bytes) and the format's working memory. fp8: float32 copy,
# scaled, clamped (12); int8: float32 copy, scaled, rounded, clamped (16); int4 (groups of
# 128 in tiles on the 32B): the GroupQuant (1 byte + 8 a group), then the tile packing's
# int32 quants, fragments and shifted words and its int64 words (13).
_GATE_UP_TRANSIENT = {"fp8": 2 + 12, "int8": 2 + 16, "int4": 2 + 1 + 8 / 128 + 13}


def _packed_matrix(fmt: str, rows: int, cols: int) -> float:
    """A packed matrix's bytes: fp8 and int8 a byte a weight and a float32 scale a row;
    int4 half a byte a weight and 8 bytes (scale and offset) a group of 128."""
    return rows * cols / 2 + rows * cols / 16 if fmt == "int4" else rows * cols + 4 * rows


def _quantize_by_hand(cfg: ModelConfig, fmt: str) -> tuple[float, float]:
    """(the first layer's packing beyond the bf16 checkpoint, the weights once all are
    packed): each layer's packed matrices and float32 vectors (QKV bias, norm gains), its
    gate/up's transient; every layer's bf16 matrices freed once packed."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    shapes = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]
    layer = sum(_packed_matrix(fmt, r, c) for r, c in shapes) + 4 * (q + 2 * kv + 2 * h)
    freed = 2 * sum(r * c for r, c in shapes)
    first = layer + _GATE_UP_TRANSIENT[fmt] * 2 * i * h
    return first, mp.dense_weight_bytes(cfg, 2) + cfg.num_layers * (layer - freed)


def _quantize_phases_by_hand(cfg: ModelConfig, fmt: str, n: int) -> tuple[float, float]:
    """The 32B's load under --quantize ``fmt`` for ``n`` tokens, absolute bytes on the GPU:
    (a) while repacking, the whole bf16 checkpoint, the RoPE tables, the first layer's packed
    matrices and float32 vectors (QKV bias, norm gains) and its gate/up's transient, the
    reserve (each later layer frees more bf16 than it packs); (b) serving, the checkpoint
    less every layer's bf16 matrices plus their packed ones, then the cache, RoPE tables,
    prefill workspace and graphs and reserve (kv_memory.needed_bytes, the count the torch
    engine shares)."""
    first, served = _quantize_by_hand(cfg, fmt)
    rope = 3 * (cfg.head_dim // 2) * 4 * n
    a = mp.dense_weight_bytes(cfg, 2) + rope + first + kv_memory.RESERVE_BYTES
    after = GPU.chunk_tokens, GPU.precision, 0, True, fmt
    return a, served + kv_memory.needed_bytes(cfg, n, *after)


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_a_32b_quantized_on_an_80_gb_h100_gets_the_context_its_packed_layers_leave(
    fmt: str,
) -> None:
    """--quantize on a bf16 32B: the check came while the bf16 source was on the GPU and
    wanted the whole cache beside it (11,520 tokens of fp8, 13,312 of int4). Counted by
    phases, repacking peaks at ~66 of 79 GiB and serving holds half the bytes: the model's
    whole 32,768 tokens, and up to YaRN's 131,072 the largest where both phases fit."""
    dense = mp.dense_weight_bytes(QWEN32, 2)
    s = _packed(LayerPacking(fmt))
    plan = plan_context(QWEN32, H100_FREE, dense, "monokernel", None, settings=s)
    assert plan.max_model_len == QWEN32.max_position_embeddings == 32768
    a, b = _quantize_phases_by_hand(QWEN32, fmt, 32768)
    assert max(a, b) == mp.need_bytes(QWEN32, 32768, dense, "monokernel", 1, s) <= H100_FREE
    assert a > b  # at 32,768 tokens the repacking is the peak
    # The weights it serves with: the checkpoint less its layers' bf16 bytes, plus theirs.
    served = mp.device_weight_bytes(QWEN32, dense, "monokernel", 1, s)
    assert served == _quantize_by_hand(QWEN32, fmt)[1]
    assert served < 0.55 * dense
    assert f"after {mp.gib(served)} of weights" in plan.note

    long = replace(QWEN32, max_position_embeddings=131072)
    free = H100_FREE - 64 * 1024 * 1024  # the plan's slack

    def fits(n: int) -> bool:
        return max(_quantize_phases_by_hand(long, fmt, n)) <= free

    longer = plan_context(long, H100_FREE, dense, "monokernel", None, settings=s).max_model_len
    if longer < 131072:
        assert longer % 256 == 0 and fits(longer) and not fits(longer + 256)
        a, b = _quantize_phases_by_hand(long, fmt, longer + 256)
        assert b > free >= a  # the serving phase is what stops it
    else:
        assert fits(131072)
    assert longer > 3 * 32768


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("n", [1, 4096, 32768])
def test_quantize_plan_is_the_backends_check(fmt: str, n: int) -> None:
    """The plan's bytes are the backend's check on what is left once the bf16 checkpoint is
    on the GPU, to the byte, whichever phase is the peak: the plan fits exactly where the
    check passes."""
    dense = mp.dense_weight_bytes(QWEN32, 2)
    s = _packed(LayerPacking(fmt))
    need = mp.need_bytes(QWEN32, n, dense, "monokernel", 1, s)
    assert need == dense + _backend_check(QWEN32, n, need - dense, s).peak
    assert plan_context(QWEN32, need, dense, "monokernel", n, settings=s).need_bytes == need
    with pytest.raises(InvalidRequestError):
        _backend_check(QWEN32, n, need - dense - 1, s)
    with pytest.raises(ContextTooLargeError):
        plan_context(QWEN32, need - 1, dense, "monokernel", n, settings=s)


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_a_gpu_too_small_to_repack_is_refused_naming_the_phase(fmt: str) -> None:
    """2 GiB beside the 32B's bf16 checkpoint: the cache would fit beside the packed layers,
    but packing the first layer (its fused gate/up and the format's working memory: 4 to
    5 GiB) does not."""
    dense = mp.dense_weight_bytes(QWEN32, 2)
    s = _packed(LayerPacking(fmt))
    free = dense + 2 * GIB
    a, b = _quantize_phases_by_hand(QWEN32, fmt, 4096)
    assert b < free < a
    with pytest.raises(ContextTooLargeError) as e:
        plan_context(QWEN32, free, dense, "monokernel", 4096, settings=s)
    msg = str(e.value)
    assert "a context of 4096 tokens needs" in msg and "while the layers are repacked" in msg
    assert f"({mp.gib(dense)} loaded + " in msg and "one layer's copies and working memory" in msg
    assert "--max-model-len" not in msg  # no shorter context helps
    assert e.value.need_bytes == mp.need_bytes(QWEN32, 4096, dense, "monokernel", 1, s)
    with pytest.raises(InvalidRequestError) as checked:
        _backend_check(QWEN32, 4096, free - dense, s)
    msg = str(checked.value)
    assert msg.startswith(f"repacking the layers in {fmt} needs ")
    assert "no context fits" in msg and f"{free - dense:,} bytes are free" in msg
    # A GPU where the cache is what does not fit says so, and what would.
    with pytest.raises(ContextTooLargeError, match="once the layers are repacked"):
        plan_context(
            replace(QWEN32, max_position_embeddings=1 << 20),
            H100_FREE,
            dense,
            "monokernel",
            1 << 20,
            settings=s,
        )


# int4 needs inputs in whole groups of 32: the odd shapes' 520 and 4104 are not.
@pytest.mark.parametrize(
    ("name", "fmt"),
    [(n, f) for n in ("odd", "odd-wide", "smollm2-135m") for f in ("fp8", "int8")]
    + [("smollm2-135m", "int4")],
)
def test_odd_shapes_quantized_an_asked_length_is_exact(name: str, fmt: str) -> None:
    cfg = DENSE_SHAPES[name]
    dense = mp.dense_weight_bytes(cfg, 2)
    s = _packed(LayerPacking(fmt))
    need = mp.need_bytes(cfg, 1000, dense, "monokernel", 1, s)
    assert need == dense + _backend_check(cfg, 1000, need - dense, s).peak
    asked = plan_context(cfg, need, dense, "monokernel", 1000, settings=s)
    assert asked.max_model_len == 1000 and asked.need_bytes == need
    with pytest.raises(ContextTooLargeError, match="--max-model-len 999 is the longest"):
        plan_context(cfg, need - 1, dense, "monokernel", 1000, settings=s)
    with pytest.raises(InvalidRequestError, match="at most 999 tokens fit"):
        _backend_check(cfg, 1000, need - dense - 1, s)
    # Packed, the layers take less than their bf16 bytes.
    assert mp.device_weight_bytes(cfg, dense, "monokernel", 1, s) < dense


def test_tp_ranks_free_their_groups_once_packed() -> None:
    """At --tp each rank copies its blocks of the groups to its GPU whole and packs them
    there, then frees each layer's once packed (tp.py Rank; nothing after the repack reads
    them) and only then allocates its cache: rank 0 serves with half of the model's packed
    layers, its share of the norms, the whole embedding and its LM-head rows. Held beside
    the packed layers, a 32B's groups of 32 (1.25 bytes a weight) with their int4 packing
    (0.75) took as many bytes as the rank's bf16 layers. --quantize int4 makes such groups
    first (tp.py rank_tensors)."""
    from monokernel.weights.quantize import int4_group_of
    from monokernel.weights.shard import rank_config, shard_config

    cfg = QWEN32
    dense = mp.dense_weight_bytes(cfg, 2)
    plan = GroupsPlan(("int4", 32))
    rank = rank_config(shard_config(cfg, 0, 2))
    groups, packed = kv_memory.group_bytes(rank, plan), kv_memory.group_pack_bytes(rank, plan)
    assert groups + packed == 2 * kv_memory.layer_matrix_params(rank)
    assert groups == kv_memory.group_bytes(cfg, plan) // 2
    embed = 2 * cfg.vocab_size * cfg.hidden_size
    rest = dense - 2 * embed - 2 * kv_memory.layer_matrix_params(cfg)
    own_head = 2 * rank.vocab_size * cfg.hidden_size
    loaded = rest // 2 + embed + own_head + groups
    gains = rank.num_layers * 4 * (rank.q_size + 2 * rank.kv_size + 2 * rank.hidden_size)
    s = _packed(LayerPacking("int4", plan))
    served = mp.device_weight_bytes(cfg, dense, "monokernel", 2, s)
    assert served == rest // 2 + embed + own_head + packed + gains
    assert served < loaded < rest // 2 + embed + own_head + 2 * kv_memory.layer_matrix_params(rank)
    # The plan is the rank's own count: its groups freed as it packs, its partial sums and
    # prefill graphs beside the cache once it has.
    rank_packing = kv_memory.Packing(
        "int4", plan, consume=True, dense_layers=False, groups_on_device=True, owns_groups=True
    )
    from monokernel.runtime.prefill_exchange import exchange_bytes
    from monokernel.runtime.prefill_tp_graphs import graph_bytes as tp_graphs

    extra = exchange_bytes(4096, cfg.hidden_size)
    extra += tp_graphs(rank, GPU.chunk_tokens, 4096, GPU.precision)
    phases = kv_memory.load_phases(
        rank, 4096, 4096, GPU.precision, rank_packing, graphs=False, extra=extra
    )
    assert mp.need_bytes(cfg, 4096, dense, "monokernel", 2, s) == loaded + phases.peak
    assert phases.repack.freed == groups // rank.num_layers
    int4 = _packed(LayerPacking("int4"))
    rtn = _packed(LayerPacking("int4", GroupsPlan(("int4", int4_group_of(cfg)))))
    assert mp.need_bytes(cfg, 4096, dense, "monokernel", 2, int4) == mp.need_bytes(
        cfg, 4096, dense, "monokernel", 2, rtn
    )


def _vectors(cfg: ModelConfig) -> int:
    """Every layer's float32 vectors the repack makes: QKV bias, q/k norms, O bias, and the
    two norm gains (not folded)."""
    n = (cfg.q_size + 2 * cfg.kv_size) * cfg.qkv_bias + 2 * cfg.head_dim * cfg.qk_norm
    return cfg.num_layers * 4 * (n + cfg.hidden_size * cfg.o_bias + 2 * cfg.hidden_size)


# The odd shapes' odd vocabularies, head counts and layer counts, with the inputs whole groups
# of 32 (a checkpoint's groups divide them): 17 x 32, 15 x 32, 43 x 32; 129, 135, 346 x 32.
ODD_GROUPED = {
    "odd": replace(DENSE_SHAPES["odd"], hidden_size=544, head_dim=96, intermediate_size=1376),
    "odd-wide": replace(
        DENSE_SHAPES["odd-wide"], hidden_size=4128, head_dim=160, intermediate_size=11072
    ),
    "smollm2-135m": DENSE_SHAPES["smollm2-135m"],
}


@pytest.mark.parametrize("name", list(ODD_GROUPED))
@pytest.mark.parametrize(
    ("plan", "per_weight"),
    [(GroupsPlan(("int4", 32)), 0.5 + 8 / 32), (GroupsPlan(("int8", 16)), 1 + 8 / 16)],
    ids=["int4-g32", "int8-g16"],
)
def test_odd_shapes_with_packed_groups_an_asked_length_is_exact(
    name: str, plan: GroupsPlan, per_weight: float
) -> None:
    cfg = ODD_GROUPED[name]
    layers = LayerPacking(plan.layers[0], plan)
    dense = mp.dense_weight_bytes(cfg, 2)
    s = _packed(layers)
    weights = mp.device_weight_bytes(cfg, dense, "monokernel", 1, s)
    matrices = kv_memory.layer_matrix_params(cfg)
    assert weights == dense - 2 * matrices + per_weight * matrices + _vectors(cfg)
    need = mp.need_bytes(cfg, 1000, dense, "monokernel", 1, s)
    asked = plan_context(cfg, need, dense, "monokernel", 1000, settings=s)
    assert asked.max_model_len == 1000 and asked.need_bytes == need
    assert (
        need
        == _group_loaded(cfg, layers, dense) + _group_check(cfg, 1000, need, layers, dense).peak
    )
    with pytest.raises(ContextTooLargeError, match="--max-model-len 999 is the longest"):
        plan_context(cfg, need - 1, dense, "monokernel", 1000, settings=s)
    with pytest.raises(InvalidRequestError, match="at most 999 tokens fit"):
        _group_check(cfg, 1000, need - 1, layers, dense)


def test_a_model_too_big_even_packed_says_so() -> None:
    dense = mp.dense_weight_bytes(QWEN32, 2)
    with pytest.raises(ContextTooLargeError) as e:
        plan_context(QWEN32, 20 * GIB, dense, "monokernel", None, settings=_packed(Q4_K_M))
    msg = str(e.value)
    assert "even with its layers packed from the checkpoint's own groups" in msg
    assert "in bf16" not in msg
    # Packing the last layer, beside the 63 before it, is already more than 20 GiB.
    assert "while the layers are repacked" in msg
    assert f"({mp.gib(_group_loaded(QWEN32, Q4_K_M, dense))} loaded + " in msg
