"""``--quantize``: which tensors the other engines get dequantised, and that those are the
values the kernel multiplies by once the repack has fused and packed them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from monokernel.models.config import ModelConfig
from monokernel.weights.formats import get_format
from monokernel.weights.formats.int4 import unpack_nibbles
from monokernel.weights.quantize import (
    LINEAR_NAMES,
    QUANTIZE_METHODS,
    UnsupportedQuantizationError,
    check_method,
    fake_quantize,
    int4_group,
    is_quantized,
    method_format,
)
from monokernel.weights.random_weights import random_weights
from monokernel.weights.repack import interleave_rows

# Every optional tensor present (biases, q/k norms, an untied head); sizes in whole groups
# of 32 columns, which int4 needs, and an odd vocabulary.
CFG = ModelConfig(
    family="qwen3",
    vocab_size=53,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    qkv_bias=True,
    o_bias=True,
    qk_norm=True,
)
LINEAR = {f"layers.{n}.{short}" for n in range(CFG.num_layers) for short in LINEAR_NAMES}


def test_the_methods_are_weight_formats() -> None:
    assert QUANTIZE_METHODS == ("fp8", "int8", "int4")
    for method in QUANTIZE_METHODS:
        assert check_method(method) == method
        assert get_format(method).name == method


@pytest.mark.parametrize("method", ["int2", "FP8", "bf16", ""])
def test_an_unsupported_method_names_the_accepted_ones(method: str) -> None:
    with pytest.raises(UnsupportedQuantizationError) as e:
        check_method(method)
    assert isinstance(e.value, ValueError)
    assert str(e.value) == f"--quantize {method!r} is not supported; choose from fp8, int8, int4"
    with pytest.raises(UnsupportedQuantizationError):
        fake_quantize(random_weights(CFG), method)


def test_the_seven_names_are_the_checkpoints_matrices() -> None:
    weights = random_weights(CFG)
    assert {name for name in weights if is_quantized(name)} == LINEAR
    assert len(LINEAR) == 7 * CFG.num_layers
    assert not any(is_quantized(n) for n in ("embed", "lm_head", "norm", "layers.0.bq"))


@pytest.mark.parametrize("method", QUANTIZE_METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_the_layers_matrices_change(method: str, dtype: torch.dtype) -> None:
    weights = random_weights(CFG, dtype=dtype, seed=1)
    before = dict(weights)
    out = fake_quantize(weights, method)
    assert out is not weights and list(out) == list(weights)
    assert all(weights[k] is before[k] for k in before)  # the input is left as it was
    fmt = method_format(method, weights)
    for name, w in weights.items():
        if name in LINEAR:
            got = out[name]
            assert got is not w and got.dtype == dtype and got.shape == w.shape
            assert torch.equal(got, fmt.dense(fmt.pack(w), dtype=dtype))
            assert not torch.equal(got, w)  # random weights are not on the grid
        else:
            assert out[name] is w  # embed, lm_head, norms, biases: the same objects


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_float32_values_are_exactly_the_kernels(method: str) -> None:
    """The reference holds float32: each value is the stored byte times its row's scale,
    with no rounding on the way."""
    weights = random_weights(CFG, dtype=torch.float32, seed=2)
    out = fake_quantize(weights, method)
    fmt = get_format(method)
    for name in sorted(LINEAR):
        m = fmt.pack(weights[name])
        assert torch.equal(out[name], m.data.float() * m.scales[0][:, None])


@pytest.mark.parametrize("method", QUANTIZE_METHODS)
@pytest.mark.parametrize("n", range(CFG.num_layers))
def test_fusing_commutes_with_quantising(method: str, n: int) -> None:
    """The repack packs the fused wqkv and the interleaved gate/up: per-row scales make that
    the same matrix as the fused fake-quantised ones the reference multiplies by."""
    weights = random_weights(CFG, dtype=torch.float32, seed=3)
    out = fake_quantize(weights, method)
    fmt = method_format(method, weights)
    p = f"layers.{n}."
    qkv = torch.cat([weights[p + s] for s in ("wq", "wk", "wv")])
    want = torch.cat([out[p + s] for s in ("wq", "wk", "wv")])
    assert torch.equal(fmt.dense(fmt.pack(qkv), dtype=torch.float32), want)
    gu = interleave_rows(weights[p + "w_gate"], weights[p + "w_up"])
    want = interleave_rows(out[p + "w_gate"], out[p + "w_up"])
    assert torch.equal(fmt.dense(fmt.pack(gu), dtype=torch.float32), want)


def test_int4_float32_values_are_exactly_the_kernels() -> None:
    """Each value is its group's a * q + b, in float32, in the group int4_group picks."""
    weights = random_weights(CFG, dtype=torch.float32, seed=2)
    out = fake_quantize(weights, "int4")
    fmt = method_format("int4", weights)
    assert fmt.group == int4_group((CFG.hidden_size, CFG.q_size, CFG.intermediate_size))
    for name in sorted(LINEAR):
        m = fmt.pack(weights[name])
        q = unpack_nibbles(m.data).float().reshape(m.rows, -1, fmt.group)
        want = q * m.scales[0][:, :, 0:1] + m.scales[0][:, :, 1:2]
        assert torch.equal(out[name], want.reshape(m.rows, m.cols))


@pytest.mark.parametrize(
    ("sizes", "group"), [((4096, 4096, 14336), 128), ((576, 576, 1536), 64), ((96, 160), 32)]
)
def test_the_int4_group_divides_every_input_size(sizes: tuple[int, ...], group: int) -> None:
    assert int4_group(sizes) == group


def test_int4_refuses_sizes_no_group_divides() -> None:
    with pytest.raises(UnsupportedQuantizationError, match="not whole groups of 32"):
        int4_group((576, 520))


def test_a_tied_checkpoint_keeps_its_embedding() -> None:
    cfg = dataclasses.replace(CFG, tie_word_embeddings=True)
    weights = random_weights(cfg, dtype=torch.float32, seed=4)
    assert "lm_head" not in weights
    out = fake_quantize(weights, "fp8")
    assert out["embed"] is weights["embed"] and "lm_head" not in out


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_column_blocks_packed_with_whole_row_scales_are_the_whole_packs_blocks(
    method: str,
) -> None:
    """Tensor parallelism packs each rank's column block of wo / w_down with the whole rows'
    scales: the blocks' bytes and scales are the whole matrix's, so TP=N quantises as TP=1."""
    from monokernel.weights.formats import get_format
    from monokernel.weights.quantize import whole_row_scales

    fmt = get_format(method)
    w = torch.randn(12, 64, generator=torch.Generator().manual_seed(5))
    weights = {"layers.0.wo": w, "layers.0.w_down": w.t().contiguous()}
    scales = whole_row_scales(weights, method, num_layers=1)
    whole = fmt.pack(w)
    assert torch.equal(scales["layers.0.wo"], whole.scales[0])
    for start in (0, 32):
        block = fmt.pack(w[:, start : start + 32], scales["layers.0.wo"])
        want = whole.data[:, start : start + 32]
        assert torch.equal(block.data.view(torch.uint8), want.contiguous().view(torch.uint8))
        assert torch.equal(block.scales[0], whole.scales[0])
    with pytest.raises(ValueError, match="scales"):
        fmt.pack(w, torch.ones(3))


def test_the_dequantized_view_reads_what_the_kernel_multiplies_by() -> None:
    from monokernel.weights.formats import get_format
    from monokernel.weights.quantize import DequantizedView

    w = torch.randn(8, 32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(6))
    norm = torch.ones(32, dtype=torch.bfloat16)
    view = DequantizedView({"layers.0.wq": w, "layers.0.attn_norm": norm}, "fp8")
    fmt = get_format("fp8")
    assert torch.equal(view["layers.0.wq"], fmt.dense(fmt.pack(w), torch.float32))
    assert view["layers.0.attn_norm"].dtype == torch.float32 and len(view) == 2


def test_consuming_empties_the_input_and_gives_the_same_weights() -> None:
    """What the engine uses for a checkpoint it owns: the same values, the input dict
    emptied as it goes, so the bf16 and the dequantised matrices are never all held."""
    w = {
        "layers.0.wq": torch.randn(8, 32, generator=torch.Generator().manual_seed(7)),
        "norm": torch.ones(32),
    }
    want = fake_quantize(dict(w), "int8")
    given = dict(w)
    got = fake_quantize(given, "int8", consume=True)
    assert given == {}
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert got["norm"] is w["norm"]
