"""The packed CPU step's perplexity tracks the float32 reference's on the same weights."""

from __future__ import annotations

import torch

from monokernel.runtime.backends.test_cpu_packed import SMALL, q4_1_weights
from monokernel.runtime.perplexity import perplexity
from monokernel.runtime.perplexity_packed import packed_perplexity


def test_close_to_the_reference_window_by_window() -> None:
    cfg = SMALL["int4"]
    weights = q4_1_weights(cfg, seed=8, logit_scale=2.0)
    ids = torch.randint(0, cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(2))
    want = perplexity(cfg, weights, ids.tolist(), window=20)
    got = packed_perplexity(cfg, weights, ids.tolist(), window=20)
    assert got.tokens == want.tokens == 49 - 2  # windows of 20, 20, 10: each scores n - 1
    assert abs(got.nll - want.nll) < 0.01 * want.nll
