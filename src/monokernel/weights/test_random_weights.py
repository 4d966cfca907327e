"""Random weights: the checkpoint's shapes, reproducible from the seed, and the LM head's
scale where the logits come from."""

from __future__ import annotations

import dataclasses

import torch

from monokernel.models.shapes import SHAPES
from monokernel.weights.names import check_weights, expected_shapes
from monokernel.weights.random_weights import random_weights

ODD = SHAPES["odd"]


def test_every_tensor_in_its_shape_and_dtype() -> None:
    weights = random_weights(ODD)
    check_weights(weights, ODD, "random")  # no tensor missing, extra or misshapen
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected_shapes(ODD)
    assert all(v.dtype == torch.bfloat16 for v in weights.values())


def test_the_seed_decides_the_values() -> None:
    a, b = random_weights(ODD, seed=3), random_weights(ODD, seed=3)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.wq"], random_weights(ODD, seed=4)["layers.0.wq"])


def test_logit_scale_multiplies_the_head() -> None:
    one = random_weights(ODD, dtype=torch.float32, logit_scale=1.0)
    eight = random_weights(ODD, dtype=torch.float32, logit_scale=8.0)
    torch.testing.assert_close(eight["lm_head"], 8.0 * one["lm_head"])
    torch.testing.assert_close(eight["embed"], one["embed"])  # untied: the head only
    tied = dataclasses.replace(ODD, tie_word_embeddings=True)
    t1 = random_weights(tied, dtype=torch.float32, logit_scale=1.0)["embed"]
    t8 = random_weights(tied, dtype=torch.float32, logit_scale=8.0)["embed"]
    torch.testing.assert_close(t8, 8.0 * t1)
    gains = one["layers.1.attn_norm"]
    assert (gains - 1.0).abs().max() < 1.0  # gains near 1, not near 0
