"""KV cache sizing: the arithmetic and the refusal, with made-up free-memory figures."""

from __future__ import annotations

import dataclasses

import pytest

from monokernel.errors import InvalidRequestError
from monokernel.models.shapes import SHAPES
from monokernel.runtime import kv_memory
from monokernel.weights.random_weights import random_weights
from monokernel.weights.repack import repack

LLAMA = SHAPES["llama-3.2-1b"]
GIB = 1 << 30


def test_bytes_per_token() -> None:
    # 16 layers x (K and V) x 8 kv heads x 64 dims x 2 bytes
    assert kv_memory.kv_bytes_per_token(LLAMA) == 16 * 2 * 8 * 64 * 2 == 32768
    need = kv_memory.needed_bytes(LLAMA, 8192, 2048, "split-qkv")
    assert need > 8192 * 32768 + kv_memory.RESERVE_BYTES


def test_fits_returns_the_need() -> None:
    need = kv_memory.check_fits(LLAMA, 8192, 80 * GIB, 2048, "split-qkv", "cuda:0")
    assert need == kv_memory.needed_bytes(LLAMA, 8192, 2048, "split-qkv")


def test_too_long_a_context_is_refused_with_the_numbers() -> None:
    free = 3 * GIB
    with pytest.raises(InvalidRequestError) as e:
        kv_memory.check_fits(LLAMA, 131072, free, 2048, "split-qkv", "cuda:0")
    msg = str(e.value)
    need = kv_memory.needed_bytes(LLAMA, 131072, 2048, "split-qkv")
    fits = kv_memory.max_len_that_fits(LLAMA, free, 2048, "split-qkv")
    assert f"{need:,} bytes" in msg and f"{free:,} bytes are free" in msg
    assert "131072 tokens" in msg and "cuda:0" in msg
    assert f"at most {fits} tokens fit" in msg and "--max-model-len" in msg
    assert 0 < fits < 131072


def test_max_len_that_fits_is_exact() -> None:
    for free in (GIB, 5 * GIB, 40 * GIB):
        fits = kv_memory.max_len_that_fits(LLAMA, free, 2048, "split-qkv")
        assert kv_memory.needed_bytes(LLAMA, fits, 2048, "split-qkv") <= free
        assert kv_memory.needed_bytes(LLAMA, fits + 1, 2048, "split-qkv") > free


def test_nothing_fits() -> None:
    assert kv_memory.max_len_that_fits(LLAMA, 1000, 2048, "split-qkv") == 0
    with pytest.raises(InvalidRequestError, match="no context fits"):
        kv_memory.check_fits(LLAMA, 16, 1000, 2048, "split-qkv", "cuda:0")


def test_repacking_counts_toward_the_need() -> None:
    base = kv_memory.repack_bytes(LLAMA, fold=False, convert=False)
    # the fused QKV and gate/up copies of 16 layers, in bf16: ~1.2 GiB for the 1B shape
    assert 1.1 * GIB < base < 1.3 * GIB
    assert kv_memory.repack_bytes(LLAMA, fold=True, convert=False) > base
    assert kv_memory.repack_bytes(LLAMA, fold=False, convert=True) > base + 2 * GIB
    plain = kv_memory.needed_bytes(LLAMA, 8192, 2048, "split-qkv")
    assert kv_memory.needed_bytes(LLAMA, 8192, 2048, "split-qkv", extra=base) == plain + base
    with pytest.raises(InvalidRequestError, match=f"weight repacking {base:,}"):
        kv_memory.check_fits(LLAMA, 8192, plain, 2048, "split-qkv", "cuda:0", extra=base)


def test_a_huge_context_names_the_longest_that_fits() -> None:
    # Everything that grows with the context (cache, RoPE tables, prefill attention) is
    # inside the bisection, so an absurd --max-model-len still gets a usable suggestion.
    extra = kv_memory.repack_bytes(LLAMA, fold=True, convert=False)
    for graphs in (False, True):  # the prefill graphs' pool grows with the context too
        with pytest.raises(InvalidRequestError, match=r"at most \d+ tokens fit: lower --max-"):
            kv_memory.check_fits(
                LLAMA, 10**9, 80 * GIB, 2048, "split-qkv", "cuda:0", extra=extra, graphs=graphs
            )
    plain = kv_memory.needed_bytes(LLAMA, 32768, 8192, "split-qkv")
    graphed = kv_memory.needed_bytes(LLAMA, 32768, 8192, "split-qkv", graphs=True)
    assert graphed - plain == kv_memory.graph_bytes(LLAMA, 32768, 8192, "split-qkv") > 0
    fits = kv_memory.max_len_that_fits(LLAMA, 80 * GIB, 2048, "split-qkv", extra=extra)
    per_token = kv_memory.kv_bytes_per_token(LLAMA) + kv_memory.rope_bytes_per_token(LLAMA)
    assert 0 < fits < 80 * GIB // per_token


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("name", ["odd", "smollm2-135m"])
def test_repack_bytes_is_what_repack_allocates(name: str, fold: bool) -> None:
    """The streamed matrices repack makes anew (fused, folded or packed: not sharing the
    checkpoint's storage), counted from the tensors themselves."""
    cfg = SHAPES[name]
    if name != "odd":  # a real shape, shrunk to two layers to stay quick on the CPU
        cfg = dataclasses.replace(cfg, num_layers=2)
    weights = random_weights(cfg, seed=5)  # bf16, as the backend hands them over
    given = {t.untyped_storage().data_ptr() for t in weights.values()}
    packed = repack(cfg, weights, 4, fold=fold)
    mats = [m for lp in packed.layers for m in lp.matrices.values()]
    mats += packed.matrices.values()
    new = sum(m.data.nbytes for m in mats if m.data.untyped_storage().data_ptr() not in given)
    assert kv_memory.repack_bytes(cfg, fold=fold, convert=False) == new


@pytest.mark.parametrize("layout", ["auto", "tiles"])
def test_group_repack_bytes_counts_every_packed_layer(layout: str) -> None:
    """From a checkpoint's own groups (a Q4_K_M's, kept on the host) every layer's packed
    matrices are new on the device: the dense layer matrices never reach it. ``auto``: the
    small shape's int4 rows cannot sit beside int8 tiles, so all stream as int8 groups of
    16; ``tiles``: O and gate/up in int4 tiles beside them (the plan a 32B takes)."""
    from monokernel import envs
    from monokernel.weights.gguf_8bit import q4_k_m_groups
    from monokernel.weights.quantize import groups_plan, is_quantized

    cfg = dataclasses.replace(SHAPES["smollm2-135m"], num_layers=2)
    weights = random_weights(cfg, seed=5)
    with envs.overridden(MONOKERNEL_WEIGHT_LAYOUT=layout):
        plan, groups = groups_plan(cfg, q4_k_m_groups(weights))
        rest = {k: v for k, v in weights.items() if not is_quantized(k)}  # on the device
        packed = repack(cfg, rest, 4, fold=False, groups=groups)
    assert (plan.layers[0], plan.qkv) == (
        ("int8", ("", 0)) if layout == "auto" else ("int4", ("int8", 16))
    )
    mats = [m for lp in packed.layers for m in lp.matrices.values()]
    new = sum(t.nbytes for m in mats for t in (m.data, *m.scales))
    assert kv_memory.group_pack_bytes(cfg, plan) == new
    extra = kv_memory.repack_bytes(cfg, fold=False, convert=False, groups=plan)
    one_layer = sum(g.q.nbytes + 2 * g.scale.nbytes for g in groups.values()) // cfg.num_layers
    assert new + one_layer < extra < new + 2 * one_layer  # a layer's groups, fused copies
    # A bf16 copy of what is on the device: the embedding, norms and biases, no matrix.
    converted = kv_memory.repack_bytes(cfg, fold=False, convert=True, groups=plan)
    assert converted - extra == 2 * sum(v.numel() for v in rest.values())


@pytest.mark.parametrize("layout", ["auto", "tiles"])
def test_group_bytes_are_what_the_groups_hold(layout: str) -> None:
    """What a device holds of a checkpoint's groups where they are there whole (an AWQ/GPTQ
    checkpoint read to the GPU, a tensor-parallel rank's blocks), in the plan's groups; and
    the layers' matrices, the part of the model that packs from them."""
    from monokernel import envs
    from monokernel.weights.gguf_8bit import q4_k_m_groups
    from monokernel.weights.quantize import groups_plan, is_quantized

    cfg = dataclasses.replace(SHAPES["smollm2-135m"], num_layers=2)
    weights = random_weights(cfg, seed=6)
    with envs.overridden(MONOKERNEL_WEIGHT_LAYOUT=layout):
        plan, groups = groups_plan(cfg, q4_k_m_groups(weights))
    held = sum(t.nbytes for g in groups.values() for t in (g.q, g.scale, g.offset))
    assert kv_memory.group_bytes(cfg, plan) == held
    matrices = sum(w.numel() for name, w in weights.items() if is_quantized(name))
    assert kv_memory.layer_matrix_params(cfg) == matrices
    # Packing from them: the packed matrices, then one layer's groups and fused copies.
    packing = kv_memory.group_packing_bytes(cfg, plan, convert=False)
    assert held // cfg.num_layers < packing < 2 * held // cfg.num_layers
    assert kv_memory.group_repack_bytes(cfg, plan, False) == (
        kv_memory.group_pack_bytes(cfg, plan) + packing
    )


@pytest.mark.parametrize(("edge", "limit"), [(0, 10), (1, 10), (7, 10), (10, 10), (33, 1 << 40)])
def test_longest_fitting_finds_the_edge_within_the_limit(edge: int, limit: int) -> None:
    calls: list[int] = []

    def fits(n: int) -> bool:
        calls.append(n)
        return n <= edge

    assert kv_memory.longest_fitting(fits, limit) == min(edge, limit)
    assert all(1 <= n <= limit for n in calls)  # never asks outside [1, limit]


def test_longest_fitting_stops_at_the_limit_when_everything_fits() -> None:
    assert kv_memory.longest_fitting(lambda n: True, 5) == 5
    assert kv_memory.longest_fitting(lambda n: True, 0) == 0


def test_the_cache_element_size_scales_only_the_cache() -> None:
    bf16 = kv_memory.needed_bytes(LLAMA, 4096, 2048, "bf16")
    fp32 = kv_memory.needed_bytes(LLAMA, 4096, 2048, "bf16", kv_dtype_bytes=4)
    assert fp32 - bf16 == kv_memory.kv_bytes_per_token(LLAMA) * 4096
