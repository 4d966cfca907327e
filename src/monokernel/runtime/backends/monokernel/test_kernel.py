"""What the host hands the kernel, on the CPU: the layer table and the build's dimensions."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from monokernel.errors import UnsupportedModelError
from monokernel.kernels import layout
from monokernel.models.shapes import SHAPES
from monokernel.runtime.backends.monokernel.kernel import KernelBuild, kernel_dims, layer_table
from monokernel.weights.random_weights import random_weights
from monokernel.weights.repack import repack


def test_layer_table_is_each_layers_pointers_in_the_kernels_order() -> None:
    cfg = SHAPES["odd"]  # biases, q/k norms: every slot in use
    packed = repack(cfg, random_weights(cfg, seed=0), 32, fold=False)
    table = layer_table(packed)  # [L, words]: a matrix's view is two (rows, scales)
    matrices = [f.name for f in layout.LAYER_WEIGHTS if f.ctype is layout.MatrixView]
    assert matrices == ["wqkv", "wo", "wgu", "wdown"]
    assert table.shape == (cfg.num_layers, len(layout.LAYER_WEIGHTS) + len(matrices))
    assert table.dtype == torch.int64
    for row, lp in zip(table.tolist(), packed.layers, strict=True):
        want: list[int] = []
        for f in layout.LAYER_WEIGHTS:
            t = getattr(lp, f.name)
            want += [t.data_ptr(), 0] if f.name in matrices else [t.data_ptr()]
        assert row == want  # bf16: no scales
        pointers = [w for w in row if w]
        assert len(set(pointers)) == len(pointers) == len(layout.LAYER_WEIGHTS)


def test_a_scaled_format_puts_its_scales_beside_its_rows() -> None:
    cfg = dataclasses.replace(
        SHAPES["odd"], hidden_size=528, intermediate_size=1424, num_heads=5, head_dim=112
    )
    packed = repack(cfg, random_weights(cfg, seed=0), 32, fold=False, fmt="int8")
    row = layer_table(packed)[0].tolist()
    lp = packed.layers[0]
    assert row[:2] == [lp.wqkv.data_ptr(), lp.matrices["wqkv"].scales[0].data_ptr()]
    head = layout.matrix_view(packed.matrices["lm_head"])
    assert (head.rows, head.scales) == (packed.lm_head.data_ptr(), 0)  # the head stays bf16
    assert packed.matrices["lm_head"].format == "bf16"


def test_kernel_dims_carry_the_ranks_and_refuse_what_cannot_run() -> None:
    cfg = SHAPES["qwen2.5-coder-1.5b"]
    assert kernel_dims(cfg).tp == 1
    assert kernel_dims(cfg, tp=2) == dataclasses.replace(kernel_dims(cfg), tp=2)
    odd_head = dataclasses.replace(cfg, head_dim=100)  # not a multiple of 8
    with pytest.raises(UnsupportedModelError, match="head_dim"):
        kernel_dims(odd_head)


def test_a_one_byte_format_needs_rows_of_whole_loads() -> None:
    with pytest.raises(UnsupportedModelError, match=r"hidden 520.* not a multiple of 16"):
        kernel_dims(SHAPES["odd"], weight_format="fp8")
    cfg = dataclasses.replace(
        SHAPES["odd"], hidden_size=528, intermediate_size=1424, num_heads=5, head_dim=112
    )
    assert kernel_dims(cfg, weight_format="int8").weight_format == "int8"
    with pytest.raises(UnsupportedModelError, match="weight format 'int8x'; the kernel has"):
        kernel_dims(cfg, weight_format="int8x")
    # int4: rows of whole groups, and a group of the kernel's.
    with pytest.raises(UnsupportedModelError, match=r"hidden 528.* not a multiple of 32"):
        kernel_dims(cfg, weight_format="int4", weight_group=32)
    with pytest.raises(UnsupportedModelError, match="weight format 'int4' needs a group size"):
        kernel_dims(SHAPES["llama-3.2-1b"], weight_format="int4")
    with pytest.raises(UnsupportedModelError, match="int4's and int8's groups and fp8's"):
        kernel_dims(SHAPES["llama-3.2-1b"], weight_format="bf16", weight_group=128)
    # int8 groups (a GGUF's 5- to 8-bit blocks): 16 or 32 columns, tiles whatever the size.
    with pytest.raises(UnsupportedModelError, match=r"int8 groups of 128 .* \(16, 32\)"):
        kernel_dims(SHAPES["llama-3.2-1b"], weight_format="int8", weight_group=128)
    grouped = kernel_dims(SHAPES["llama-3.2-1b"], weight_format="int8", weight_group=16)
    assert grouped.weight_tiles and "-DMK_WEIGHT_FORMAT=Int8GroupTiles<16>" in grouped.defines()
    # fp8 block scales: tiles only (the 1B streams rows), blocks a power of two >= 64.
    with pytest.raises(UnsupportedModelError, match="fp8 block scales of 128 columns"):
        kernel_dims(SHAPES["llama-3.2-1b"], weight_format="fp8", weight_group=128)
    with pytest.raises(UnsupportedModelError, match="a power of two of at least 64"):
        kernel_dims(SHAPES["llama-3.1-8b"], weight_format="fp8", weight_group=192)
    blocks = kernel_dims(SHAPES["llama-3.1-8b"], weight_format="fp8", weight_group=128)
    assert "-DMK_WEIGHT_FORMAT=Fp8BlockTiles<128>" in blocks.defines()
    with pytest.raises(UnsupportedModelError, match="the kernel reads"):
        kernel_dims(SHAPES["llama-3.2-1b"], weight_format="int4", weight_group=96)
    dims = kernel_dims(SHAPES["llama-3.2-1b"], weight_format="int4", weight_group=128)
    assert "-DMK_WEIGHT_FORMAT=Int4Groups<128>" in dims.defines()


def test_a_build_carries_the_context_its_group_units_run_from() -> None:
    """The build without group units runs a context while head units cover it (its window x
    grid // heads positions) and it is below the build's group_from (MONOKERNEL_ATTN_GROUP_FROM
    when it was loaded), so builds with and without that setting can share one backend."""
    short, full = object(), object()  # stand-ins: only which module runs is asked
    plain = KernelBuild(full, short, attn_chunk=96, group_from=1 << 30)  # type: ignore[arg-type]
    assert plain.short_covers(288, splits=3) and not plain.short_covers(289, splits=3)
    assert not plain.short_covers(10, splits=0)  # heads outnumber the CTAs: never
    forced = dataclasses.replace(plain, group_from=100)
    assert forced.short_covers(99, splits=3) and not forced.short_covers(100, splits=3)
