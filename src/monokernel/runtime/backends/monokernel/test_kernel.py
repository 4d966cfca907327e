"""What the host hands the kernel, on the CPU: the layer table and the build's dimensions."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from monokernel.errors import UnsupportedModelError
from monokernel.kernels import layout
from monokernel.models.shapes import SHAPES
from monokernel.runtime.backends.monokernel.kernel import kernel_dims, layer_table
from monokernel.weights.random_weights import random_weights
from monokernel.weights.repack import repack


def test_layer_table_is_each_layers_pointers_in_the_kernels_order() -> None:
    cfg = SHAPES["odd"]  # biases, q/k norms: every slot in use
    packed = repack(cfg, random_weights(cfg, seed=0), 32, fold=False)
    table = layer_table(packed)  # [L, fields]
    assert table.shape == (cfg.num_layers, len(layout.LAYER_WEIGHTS))
    assert table.dtype == torch.int64
    names = [f.name for f in layout.LAYER_WEIGHTS]
    assert names[:2] == ["wqkv", "bqkv"] and names[7] == "wdown"
    for row, lp in zip(table.tolist(), packed.layers, strict=True):
        assert row == [getattr(lp, name).data_ptr() for name in names]
        assert len(set(row)) == len(row)  # every slot a tensor of its own


def test_kernel_dims_carry_the_ranks_and_refuse_what_cannot_run() -> None:
    cfg = SHAPES["qwen2.5-coder-1.5b"]
    assert kernel_dims(cfg).tp == 1
    assert kernel_dims(cfg, tp=2) == dataclasses.replace(kernel_dims(cfg), tp=2)
    odd_head = dataclasses.replace(cfg, head_dim=100)  # not a multiple of 8
    with pytest.raises(UnsupportedModelError, match="head_dim"):
        kernel_dims(odd_head)
