"""A verify pass of P positions (the MK_P pass build, verify_pass.py) computes each position
exactly as a decode step at that position: the same logits to the bit and the same token, in
passes of every length up to P, at a short context and across the context where the
attention plan changes its ranges (head units merged by stage C's reader, then by the last
unit), on the default model's shape in its own format (int4 groups of 32, rows), bf16, and
fp8 and int8 rows (whose passes deal each position of a row to its own warp, as int4's do).

GPU tests (marker ``gpu``): a Hopper GPU.
"""

from __future__ import annotations

import pytest
import torch

from monokernel.models.shapes import SHAPES
from monokernel.testing.gpu_models import hopper_with, random_ids, rows_backend
from monokernel.weights.random_weights import random_weights

POSITIONS = 4  # the pass build's P
FORCED = 12  # positions compared: whole passes of 1, 2, 3 and 4


@pytest.mark.gpu
@pytest.mark.skipif(not hopper_with(8), reason="needs a Hopper GPU, 8 GiB")
@pytest.mark.parametrize("fmt", ["int4:32", "bf16", "fp8", "int8"])
@pytest.mark.parametrize("prompt", [64, 600, 1019, 1500])
def test_each_position_of_a_pass_is_the_step_at_it(fmt: str, prompt: int) -> None:
    """Teacher-forced passes of 1 to 4 positions against teacher-forced steps: the logits of
    every position equal to the bit, the tokens equal. The default model's head units take 1
    range at 64, 2 at 600 (merged by stage C's reader), 3 at 1,500 (merged by the last unit);
    from 1,019 the positions cross 1,024, where 2 become 3."""
    from monokernel.runtime.backends.monokernel.verify_pass import PassKernel

    cfg, dev = SHAPES["smollm2-135m"], torch.device("cuda")
    weights = random_weights(cfg, device=dev, seed=41)
    seq = random_ids(prompt + FORCED, cfg.vocab_size, seed=42)
    mk = rows_backend(cfg, weights, prompt + FORCED, dev, fmt)
    assert mk.kernel.dims.weight_format == fmt.partition(":")[0]
    assert not mk.kernel.dims.weight_tiles
    step = mk.teacher_forced_logits(seq[:prompt], seq[prompt:])  # [FORCED, V]
    forced = seq[prompt - 1 : prompt + FORCED - 1]  # each position's input
    passes = PassKernel(mk.kernel, POSITIONS)
    try:
        for n in range(1, POSITIONS + 1):
            got, tokens, _ = passes.teacher_forced(prompt - 1, forced, n)  # [FORCED, V]
            assert got is not None
            bad = [i for i in range(FORCED) if not torch.equal(got[i], step[i])]
            assert not bad, f"passes of {n}: positions {bad} differ from the steps' logits"
            assert tokens == step.argmax(dim=-1).tolist(), f"passes of {n}: tokens"
    finally:
        passes.close()
        mk.close()


@pytest.mark.gpu
@pytest.mark.skipif(not hopper_with(8), reason="needs a Hopper GPU, 8 GiB")
@pytest.mark.parametrize("fmt", ["int4:32", "bf16"])
def test_passes_that_draft_draw_what_steps_draw(fmt: str) -> None:
    """Greedy passes that draft from the request's own tokens (a prompt of one random run
    three times over) and keep what their draws confirm give the tokens the step build
    draws, with and without a stop id among them; some tokens are drafted."""
    from monokernel.runtime.backends.base import CancelToken, DecodeRequest
    from monokernel.runtime.backends.monokernel.verify_pass import PassKernel
    from monokernel.runtime.sampling import SamplingParams

    cfg, dev = SHAPES["smollm2-135m"], torch.device("cuda")
    weights = random_weights(cfg, device=dev, seed=44)
    prompt = random_ids(40, cfg.vocab_size, seed=45) * 3
    steps_n = 96
    mk = rows_backend(cfg, weights, len(prompt) + steps_n, dev, fmt)
    greedy = SamplingParams(temperature=0.0)
    request = DecodeRequest(tuple(prompt), greedy, steps_n, frozenset())
    steps = list(mk.stream(request, CancelToken()))  # the first from the prefill's logits
    passes = PassKernel(mk.kernel, POSITIONS)
    try:
        got, drafted, _ = passes.generate(prompt + steps[:1], steps_n - 1)
        assert got == steps[1:]
        assert drafted > 0
        stop = steps[40]
        first = steps.index(stop, 1)
        got, _, _ = passes.generate(prompt + steps[:1], steps_n - 1, stop_ids=[stop])
        assert got == steps[1 : first + 1]
    finally:
        passes.close()
        mk.close()
