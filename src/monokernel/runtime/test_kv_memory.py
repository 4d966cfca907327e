"""KV cache sizing and the monokernel's load phases: the arithmetic, what repack really
allocates, and the refusal, with made-up free-memory figures."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from monokernel.errors import InvalidRequestError
from monokernel.models.shapes import SHAPES
from monokernel.runtime import kv_memory
from monokernel.weights.random_weights import random_weights
from monokernel.weights.repack import Repacked, repack

LLAMA = SHAPES["llama-3.2-1b"]
GIB = 1 << 30


def test_bytes_per_token() -> None:
    # 16 layers x (K and V) x 8 kv heads x 64 dims x 2 bytes
    assert kv_memory.kv_bytes_per_token(LLAMA) == 16 * 2 * 8 * 64 * 2 == 32768
    need = kv_memory.needed_bytes(LLAMA, 8192, 2048, "split-qkv")
    assert need > 8192 * 32768 + kv_memory.RESERVE_BYTES


def _peak(packing: kv_memory.Packing, max_len: int = 8192) -> int:
    return kv_memory.load_phases(LLAMA, max_len, 2048, "split-qkv", packing).peak


def test_fits_returns_the_phases() -> None:
    packing = kv_memory.Packing(consume=True)
    phases = kv_memory.check_load_fits(LLAMA, 8192, 80 * GIB, 2048, "split-qkv", "cuda:0", packing)
    repack = kv_memory.repack_phase(LLAMA, packing)
    # Serving: the cache, the prefill and the reserve beside the repacked weights' change.
    assert phases.serving == kv_memory.needed_bytes(LLAMA, 8192, 2048, "split-qkv", repack.weights)
    rope = kv_memory.rope_bytes_per_token(LLAMA) * 8192
    assert phases.repacking == rope + repack.peak + kv_memory.RESERVE_BYTES
    assert phases.peak == phases.serving > phases.repacking  # bf16 packs two of four in place


def test_too_long_a_context_is_refused_with_the_numbers() -> None:
    free, packing = 3 * GIB, kv_memory.Packing(consume=True)
    with pytest.raises(InvalidRequestError) as e:
        kv_memory.check_load_fits(LLAMA, 131072, free, 2048, "split-qkv", "cuda:0", packing)
    msg = str(e.value)
    need = _peak(packing, 131072)
    fits = kv_memory.longest_fitting(lambda n: _peak(packing, n) <= free)
    assert f"{need:,} bytes" in msg and f"{free:,} bytes are free" in msg
    assert "131072 tokens" in msg and "cuda:0" in msg and "once the layers are repacked" in msg
    assert f"at most {fits} tokens fit" in msg and "--max-model-len" in msg
    assert 0 < fits < 131072
    assert _peak(packing, fits) <= free < _peak(packing, fits + 1)  # the advice is exact


def test_nothing_fits() -> None:
    with pytest.raises(InvalidRequestError, match="no context fits"):
        kv_memory.check_load_fits(LLAMA, 16, 1000, 2048, "split-qkv", "cuda:0", kv_memory.Packing())


def test_repacking_in_bf16_makes_the_fused_copies() -> None:
    """bf16 packs O and down in place; QKV and gate/up are fused copies: consumed, their
    sources go as they are made, so the layers' bytes end where they began."""
    kept = kv_memory.repack_phase(LLAMA, kv_memory.Packing())
    consumed = kv_memory.repack_phase(LLAMA, kv_memory.Packing(consume=True))
    h, i, q, kv = LLAMA.hidden_size, LLAMA.intermediate_size, LLAMA.q_size, LLAMA.kv_size
    fused = 2 * (q + 2 * kv) * h + 2 * 2 * i * h
    vectors = 4 * 2 * h  # the norm gains in float32, not folded
    assert kept.layer == consumed.layer == fused + vectors
    assert consumed.freed == fused and kept.freed == 0
    # the fused copies of 16 layers: ~1.2 GiB for the 1B shape, none left when consumed
    assert kept.weights == 16 * kept.layer and 1.1 * GIB < kept.weights < 1.3 * GIB
    assert consumed.weights == 16 * vectors
    # The last layer's peak: what the layers before it kept (their gains), its fused copies.
    assert consumed.transient == 0
    assert consumed.peak == 15 * vectors + consumed.layer < kept.peak == 16 * kept.layer
    folded = kv_memory.repack_phase(LLAMA, kv_memory.Packing(fold=True))
    assert folded.weights - kept.weights == 2 * LLAMA.vocab_size * h - 16 * vectors  # the head
    converted = kv_memory.repack_phase(LLAMA, kv_memory.Packing(convert=True))
    assert converted.weights - kept.weights == 2 * LLAMA.num_parameters()


def test_a_huge_context_names_the_longest_that_fits() -> None:
    # Everything that grows with the context (cache, RoPE tables, prefill attention) is
    # inside the bisection, so an absurd --max-model-len still gets a usable suggestion.
    packing = kv_memory.Packing(fold=True)
    for graphs in (False, True):  # the prefill graphs' pool grows with the context too
        with pytest.raises(InvalidRequestError, match=r"at most \d+ tokens fit: lower --max-"):
            kv_memory.check_load_fits(
                LLAMA, 10**9, 80 * GIB, 2048, "split-qkv", "cuda:0", packing, graphs
            )
    plain = kv_memory.needed_bytes(LLAMA, 32768, 8192, "split-qkv")
    graphed = kv_memory.needed_bytes(LLAMA, 32768, 8192, "split-qkv", graphs=True)
    assert graphed - plain == kv_memory.graph_bytes(LLAMA, 32768, 8192, "split-qkv") > 0
    phases = kv_memory.load_phases(LLAMA, 32768, 8192, "split-qkv", packing, graphs=True)
    assert phases.serving - phases.repack.weights == graphed


def _new_bytes(packed: Repacked, given: set[int]) -> int:
    """What repack allocated that does not share the checkpoint's storage: the packed
    matrices and scales, and the layers' float32 vectors."""
    tensors = [t for m in packed.matrices.values() for t in (m.data, *m.scales)]
    for lp in packed.layers:
        tensors += [t for m in lp.matrices.values() for t in (m.data, *m.scales)]
        vectors = (lp.bqkv, lp.q_norm, lp.k_norm, lp.bo, lp.attn_gain, lp.ffn_gain)
        tensors += [v for v in vectors if v is not None]
    return sum(t.nbytes for t in tensors if t.untyped_storage().data_ptr() not in given)


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("name", ["odd", "smollm2-135m"])
def test_repack_phase_counts_what_repack_allocates(name: str, fold: bool) -> None:
    """The streamed matrices repack makes anew (fused, folded or packed: not sharing the
    checkpoint's storage) and the float32 vectors, counted from the tensors themselves."""
    cfg = SHAPES[name]
    if name != "odd":  # a real shape, shrunk to two layers to stay quick on the CPU
        cfg = dataclasses.replace(cfg, num_layers=2)
    weights = random_weights(cfg, seed=5)  # bf16, as the backend hands them over
    given = {t.untyped_storage().data_ptr() for t in weights.values()}
    packed = repack(cfg, weights, 4, fold=fold)
    assert kv_memory.repack_phase(cfg, kv_memory.Packing(fold=fold)).weights == _new_bytes(
        packed, given
    )


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_quantized_layers_replace_their_sources(fmt: str) -> None:
    """--quantize: every layer matrix is packed anew; consumed, each layer's bf16 sources
    (all seven matrices) go once it is packed, so the weights end smaller than they began
    and packing peaks at the first layer."""
    cfg = dataclasses.replace(SHAPES["smollm2-135m"], num_layers=2)
    weights = random_weights(cfg, seed=7)
    given = {t.untyped_storage().data_ptr() for t in weights.values()}
    packed = repack(cfg, dict(weights), 4, fold=False, fmt=fmt)
    kept = kv_memory.repack_phase(cfg, kv_memory.Packing(fmt))
    assert kept.weights == _new_bytes(packed, given) == 2 * kept.layer
    consumed = kv_memory.repack_phase(cfg, kv_memory.Packing(fmt, consume=True))
    assert consumed.freed == 2 * kv_memory.layer_matrix_params(cfg) // 2
    assert consumed.weights == 2 * (consumed.layer - consumed.freed) < 0
    assert consumed.peak == consumed.layer + consumed.transient
    assert kept.peak == kept.layer + consumed.peak


@pytest.mark.parametrize("layout", ["auto", "tiles"])
def test_group_packing_counts_every_packed_layer(layout: str) -> None:
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
        given = {t.untyped_storage().data_ptr() for t in rest.values()}
        packed = repack(cfg, rest, 4, fold=False, groups=groups)
        packing = kv_memory.Packing(plan.layers[0], plan, dense_layers=False)
        phase = kv_memory.repack_phase(cfg, packing)
    assert (plan.layers[0], plan.qkv) == (
        ("int8", ("", 0)) if layout == "auto" else ("int4", ("int8", 16))
    )
    mats = [m for lp in packed.layers for m in lp.matrices.values()]
    new = sum(t.nbytes for m in mats for t in (m.data, *m.scales))
    assert kv_memory.group_pack_bytes(cfg, plan) == new
    assert phase.weights == _new_bytes(packed, given) == 2 * phase.layer
    # While a layer packs: its groups copied from the host, and a fused copy of some.
    one_layer = sum(g.q.nbytes + 2 * g.scale.nbytes for g in groups.values()) // cfg.num_layers
    assert one_layer < phase.transient
    assert phase.peak == phase.weights + phase.transient
    # A bf16 copy of what is on the device: the embedding, norms and biases, no matrix.
    converted = kv_memory.repack_phase(cfg, dataclasses.replace(packing, convert=True))
    assert converted.weights - phase.weights == 2 * sum(v.numel() for v in rest.values())


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
        packing = kv_memory.Packing(plan.layers[0], plan, dense_layers=False)
        host = kv_memory.repack_phase(cfg, packing)
        on_gpu = dataclasses.replace(packing, groups_on_device=True)
        held = kv_memory.repack_phase(cfg, dataclasses.replace(on_gpu, consume=True))
        owned = kv_memory.repack_phase(
            cfg, dataclasses.replace(on_gpu, consume=True, owns_groups=True)
        )
    whole = sum(t.nbytes for g in groups.values() for t in (g.q, g.scale, g.offset))
    assert kv_memory.group_bytes(cfg, plan) == whole
    matrices = sum(w.numel() for name, w in weights.items() if is_quantized(name))
    assert kv_memory.layer_matrix_params(cfg) == matrices
    # Groups already on the device are not copied there while a layer packs; a caller's stay
    # (consume frees nothing of them), a TP rank's own go a layer at a time.
    assert host.transient - held.transient == whole // cfg.num_layers
    assert held.freed == 0 and owned.freed == whole // cfg.num_layers
    assert owned.weights == held.weights - whole


@pytest.mark.parametrize("layout", ["rows", "tiles"])
@pytest.mark.parametrize(
    ("fmt", "fold"),
    [("bf16", False), ("bf16", True), ("fp8", False), ("int8", False), ("int4", False)],
)
def test_a_layers_packing_stays_within_its_count(fmt: str, fold: bool, layout: str) -> None:
    """repack_layer's allocations, followed on the CPU through the profiler: what it keeps
    is the layer's count to the byte, and its peak (the fused copies, each format's working
    memory) stays within the count's bound, not far under it. Fails where packing a
    matrix starts to hold more than kv_memory says."""
    from monokernel import envs
    from monokernel.weights.repack import repack_layer

    cfg = dataclasses.replace(SHAPES["smollm2-135m"], num_layers=1)
    weights = random_weights(cfg, seed=8)
    with envs.overridden(MONOKERNEL_WEIGHT_LAYOUT=layout):
        peak, kept = _allocated(lambda: repack_layer(cfg, weights, 0, fold=fold, fmt=fmt))
        phase = kv_memory.repack_phase(cfg, kv_memory.Packing(fmt, fold=fold))
    assert kept == phase.layer
    assert 0.6 * (phase.layer + phase.transient) <= peak <= phase.layer + phase.transient


@pytest.mark.parametrize("layout", ["auto", "tiles"])
def test_packing_groups_stays_within_its_count(layout: str) -> None:
    from monokernel import envs
    from monokernel.weights.gguf_8bit import q4_k_m_groups
    from monokernel.weights.quantize import groups_plan
    from monokernel.weights.repack import repack_layer

    cfg = dataclasses.replace(SHAPES["smollm2-135m"], num_layers=1)
    weights = random_weights(cfg, seed=9)
    with envs.overridden(MONOKERNEL_WEIGHT_LAYOUT=layout):
        plan, groups = groups_plan(cfg, q4_k_m_groups(weights))
        peak, kept = _allocated(lambda: repack_layer(cfg, weights, 0, fold=False, groups=groups))
        # On the CPU the groups are where the layer packs: no copy, as on a GPU that holds them.
        packing = kv_memory.Packing(plan.layers[0], plan, groups_on_device=True)
        phase = kv_memory.repack_phase(cfg, packing)
    assert kept == phase.layer
    assert 0.6 * (phase.layer + phase.transient) <= peak <= phase.layer + phase.transient


def _allocated(fn: Callable[[], object]) -> tuple[int, int]:
    """(peak, kept): the CPU bytes ``fn`` allocated at most at once and still holds when it
    returns, from the profiler's allocation records in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = []
    for e in prof.events():
        # An op's own allocations (its children's are theirs), and frees outside any op.
        delta = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        if delta:
            events.append((e.time_range.start, delta))
    held = peak = 0
    for _, delta in sorted(events):
        held += delta
        peak = max(peak, held)
    del out
    return peak, held


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
