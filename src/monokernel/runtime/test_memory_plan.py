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
from monokernel.weights.quantize import GroupsPlan
from monokernel.weights.shard import TensorParallelError

GPU = PlanSettings(where="cuda:0")
LLAMA8 = DENSE_SHAPES["llama-3.1-8b"]
QWEN32 = DENSE_SHAPES["qwen2.5-coder-32b"]


def _bf16_weights(cfg: ModelConfig) -> int:
    return 2 * cfg.num_parameters()


def _backend_check(cfg: ModelConfig, n: int, free_after_weights: int, s: PlanSettings) -> int:
    """What MonokernelBackend asks kv_memory once the weights are on the GPU."""
    extra = kv_memory.repack_bytes(cfg, fold=False, convert=s.dtype_bytes != 2)
    return kv_memory.check_fits(
        cfg, n, free_after_weights, s.chunk_tokens, s.precision, s.where, extra, s.graphs
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
    assert mono - torch_ >= kv_memory.repack_bytes(LLAMA8, fold=False, convert=False)
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
    layers, the embedding and its LM-head rows, so 40 GiB a GPU runs the 32B at --tp 2."""
    weights = _bf16_weights(QWEN32)
    two = PlanSettings(where="cuda:0", gpus=2)
    with pytest.raises(ContextTooLargeError, match="--tp 2 fits"):
        plan_context(QWEN32, 40 * GIB, weights, "monokernel", None, settings=two)
    plan = plan_context(QWEN32, 40 * GIB, weights, "monokernel", 32768, tp=2, settings=two)
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
    """The block graphs of the sharded prefill (every bucket's residual and partials, the
    largest bucket's pool) are counted on rank 0 where the graphs are on."""
    from dataclasses import replace

    from monokernel.models.config import ModelConfig as Cfg
    from monokernel.runtime.prefill_tp_graphs import MAX_TP_BUCKET, graph_bytes
    from monokernel.weights.shard import rank_config, shard_config

    cfg: Cfg = DENSE_SHAPES["qwen2.5-coder-1.5b"]
    weights = _bf16_weights(cfg)
    on = mp.need_bytes(cfg, 4096, weights, "monokernel", 2, GPU)
    off = mp.need_bytes(cfg, 4096, weights, "monokernel", 2, replace(GPU, graphs=False))
    rank = rank_config(shard_config(cfg, 0, 2))
    assert on - off == graph_bytes(rank, GPU.chunk_tokens, 4096, GPU.precision)
    # Buffers of every bucket up to the cap: 16 + 32 + ... + 2,048 rows, three [T, H] fp32.
    statics = 3 * 4 * rank.hidden_size * (2 * MAX_TP_BUCKET - 16)
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
# An 80 GB H100's free bytes before the weights: the bf16 count's plan for the 32B there is
# the 28,672 tokens a Q4_K_M got before its packed layers were counted.
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


def _group_check(cfg: ModelConfig, n: int, free: int, layers: LayerPacking, dense: int) -> None:
    """What MonokernelBackend asks kv_memory once what reaches the GPU before it is there: a
    GGUF's tensors but its layer matrices, or every tensor and the groups (AWQ/GPTQ)."""
    assert layers.groups is not None
    if layers.groups_on_device:
        resident = dense + kv_memory.group_bytes(cfg, layers.groups)
    else:
        resident = dense - 2 * kv_memory.layer_matrix_params(cfg)
    extra = kv_memory.repack_bytes(cfg, False, False, layers.fmt, True, layers.groups)
    kv_memory.check_fits(
        cfg, n, free - resident, GPU.chunk_tokens, GPU.precision, "cuda:0", extra, True, layers.fmt
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
    """The packed layers are among the weights; the repacking extra adds only what packing
    them takes: the total is the backend's own count to the byte."""
    dense = mp.dense_weight_bytes(QWEN32, 2)
    need = mp.need_bytes(QWEN32, 8192, dense, "monokernel", 1, _packed(Q4_K_M))
    assert Q4_K_M.groups is not None
    on_host = dense - 2 * kv_memory.layer_matrix_params(QWEN32)  # embedding, head, norms
    extra = kv_memory.repack_bytes(QWEN32, False, False, "int8", True, Q4_K_M.groups)
    backend = on_host + kv_memory.needed_bytes(
        QWEN32, 8192, GPU.chunk_tokens, GPU.precision, extra, True, "int8"
    )
    assert need == backend
    packed = kv_memory.group_pack_bytes(QWEN32, Q4_K_M.groups)
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
    # LM head in each prefill workspace, the packing's layer of groups.
    assert 0.75 * saved / token < gained < saved / token
    assert longer.max_model_len > 3 * short.max_model_len
    _group_check(long, longer.max_model_len, H100_FREE, Q4_K_M, dense)


def test_groups_read_to_the_gpu_are_counted_beside_the_dense_layers() -> None:
    """An AWQ/GPTQ checkpoint is read to the GPU and decoded there: its dense layers and its
    groups are on the device when the backend packs the groups."""
    cfg = LLAMA8
    dense = mp.dense_weight_bytes(cfg, 2)
    awq = LayerPacking("int4", GroupsPlan(("int4", 128)), groups_on_device=True)
    weights = mp.device_weight_bytes(cfg, dense, "monokernel", 1, _packed(awq))
    # 1 byte a weight and 8 bytes a group of 128 unpacked, half a byte and 8 packed.
    matrices = kv_memory.layer_matrix_params(cfg)
    assert weights == dense + matrices * (1 + 8 / 128) + matrices * (0.5 + 8 / 128)
    plan = plan_context(cfg, 40 * GIB, dense, "monokernel", None, settings=_packed(awq))
    _group_check(cfg, plan.max_model_len, 40 * GIB, awq, dense)
    with pytest.raises(InvalidRequestError):  # and refuses a longer one
        _group_check(cfg, plan.max_model_len + 1024, 40 * GIB, awq, dense)


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_quantize_counts_the_dense_source_and_its_format(fmt: str) -> None:
    """--quantize: the bf16 source is on the GPU when the backend checks its memory, one
    layer packed beside it at a time; the prefill works in the format. The chosen context
    passes that check (a bf16 count picked one it refuses on the 32B)."""
    dense = mp.dense_weight_bytes(QWEN32, 2)
    s = _packed(LayerPacking(fmt))
    assert mp.device_weight_bytes(QWEN32, dense, "monokernel", 1, s) == dense
    plan = plan_context(QWEN32, H100_FREE, dense, "monokernel", None, settings=s)
    extra = kv_memory.repack_bytes(QWEN32, False, False, fmt, True)
    args = (GPU.chunk_tokens, GPU.precision, "cuda:0", extra, True, fmt)
    kv_memory.check_fits(QWEN32, plan.max_model_len, H100_FREE - dense, *args)
    bf16 = plan_context(
        QWEN32, H100_FREE, dense, "monokernel", None, settings=_packed(LayerPacking())
    )
    with pytest.raises(InvalidRequestError):
        kv_memory.check_fits(QWEN32, bf16.max_model_len, H100_FREE - dense, *args)


def test_tp_ranks_hold_their_share_of_the_groups() -> None:
    """At --tp each rank copies its blocks of the groups to its GPU whole and packs them
    there: rank 0 holds half of the model's groups and packed layers at --tp 2, its share of
    the norms, the whole embedding and its LM-head rows. --quantize int4 makes such groups
    first (tp.py rank_tensors)."""
    from monokernel.weights.quantize import int4_group_of
    from monokernel.weights.shard import rank_config, shard_config

    cfg = QWEN32
    dense = mp.dense_weight_bytes(cfg, 2)
    plan = GroupsPlan(("int4", 32))
    rank = rank_config(shard_config(cfg, 0, 2))
    whole = kv_memory.group_bytes(cfg, plan) + kv_memory.group_pack_bytes(cfg, plan)
    mine = kv_memory.group_bytes(rank, plan) + kv_memory.group_pack_bytes(rank, plan)
    assert mine == whole // 2
    embed = 2 * cfg.vocab_size * cfg.hidden_size
    rest = dense - 2 * embed - 2 * kv_memory.layer_matrix_params(cfg)
    own_head = 2 * rank.vocab_size * cfg.hidden_size
    s = _packed(LayerPacking("int4", plan))
    assert mp.device_weight_bytes(cfg, dense, "monokernel", 2, s) == (
        rest // 2 + embed + own_head + mine
    )
    # Groups of 32 held whole (1.25 bytes a weight) beside their int4 packing (0.75): as
    # many bytes as the rank's bf16 layers.
    assert mine == 2 * kv_memory.layer_matrix_params(rank)
    int4 = _packed(LayerPacking("int4"))
    rtn = _packed(LayerPacking("int4", GroupsPlan(("int4", int4_group_of(cfg)))))
    assert mp.need_bytes(cfg, 4096, dense, "monokernel", 2, int4) == mp.need_bytes(
        cfg, 4096, dense, "monokernel", 2, rtn
    )


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
    assert weights == dense - 2 * matrices + per_weight * matrices
    need = mp.need_bytes(cfg, 1000, dense, "monokernel", 1, s)
    asked = plan_context(cfg, need, dense, "monokernel", 1000, settings=s)
    assert asked.max_model_len == 1000 and asked.need_bytes == need
    _group_check(cfg, 1000, need, layers, dense)
    with pytest.raises(ContextTooLargeError, match="--max-model-len 999 is the longest"):
        plan_context(cfg, need - 1, dense, "monokernel", 1000, settings=s)


def test_a_model_too_big_even_packed_says_so() -> None:
    dense = mp.dense_weight_bytes(QWEN32, 2)
    with pytest.raises(ContextTooLargeError) as e:
        plan_context(QWEN32, 20 * GIB, dense, "monokernel", None, settings=_packed(Q4_K_M))
    msg = str(e.value)
    assert "even with its layers packed from the checkpoint's own groups" in msg
    assert "in bf16" not in msg
    weights = mp.device_weight_bytes(QWEN32, dense, "monokernel", 1, _packed(Q4_K_M))
    assert f"({mp.gib(weights)} of weights + " in msg
