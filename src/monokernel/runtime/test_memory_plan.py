"""Planning the context before the weights load: real shapes on made-up free memory, the
agreement with the monokernel backend's own check, and the advice when nothing fits."""

from __future__ import annotations

import re

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
    PlanSettings,
    plan_context,
)
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
