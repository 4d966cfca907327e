"""``--speculative`` on the monokernel (backend.py set_speculative, request.py): a greedy
request runs on the pass build, which drafts from the request's own tokens and keeps what
its draws confirm. It must stream token for token what decoding by steps streams, end where
a budget or a stop id ends it even inside an accepted run, stop on a cancel, and leave the
cache such that a later request reusing its prefix decodes as it would have. A request
sampled by temperature alone draws in passes what steps draw; one drawn by top-p, which
passes cannot serve, decodes by steps and makes no drafts.

GPU tests (marker ``gpu``): a Hopper GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import pytest
import torch

from monokernel.models.shapes import SHAPES
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.sampling import SamplingParams
from monokernel.runtime.speculative import SpeculativeConfig
from monokernel.testing.gpu_models import hopper_with, random_ids
from monokernel.weights.random_weights import random_weights

GREEDY = SamplingParams(temperature=0.0)
SPEC = SpeculativeConfig(num_tokens=3)  # passes of 4 positions
# A prompt of one random run three times over: a random model's greedy output soon repeats
# too, so drafts are made and accepted.
PROMPT = random_ids(60, SHAPES["smollm2-135m"].vocab_size, seed=52) * 3
N = 200

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not hopper_with(8), reason="needs a Hopper GPU, 8 GiB"),
]


@functools.lru_cache(maxsize=1)
def _backend():  # type: ignore[no-untyped-def]
    from monokernel.runtime.backends.monokernel import MonokernelBackend

    cfg, dev = SHAPES["smollm2-135m"], torch.device("cuda")
    return MonokernelBackend(cfg, random_weights(cfg, device=dev, seed=51), 1024, dev)


def _stream(
    prompt: Sequence[int],
    n: int,
    speculative: SpeculativeConfig | None = None,
    stops: Sequence[int] = (),
    sampling: SamplingParams = GREEDY,
) -> list[int]:
    mk = _backend()
    mk.set_speculative(speculative)
    request = DecodeRequest(tuple(prompt), sampling, n, frozenset(stops))
    return list(mk.stream(request, CancelToken()))


def test_greedy_passes_stream_what_steps_stream() -> None:
    plain = _stream(PROMPT, N)
    assert _stream(PROMPT, N, SPEC) == plain
    stats = _backend().speculation
    assert stats.passes > 0 and stats.drafted >= stats.accepted > 0
    for n in (37, 101):  # budgets that may end inside an accepted run
        assert _stream(PROMPT, n, SPEC) == plain[:n]
    stop = plain[70]
    assert _stream(PROMPT, N, SPEC, stops=[stop]) == plain[: plain.index(stop) + 1]


def test_a_cancel_stops_the_passes_and_the_cache_stays_right() -> None:
    plain = _stream(PROMPT, N)
    follow = [*PROMPT, *plain[:50]]
    want = _stream(follow, 64)
    mk = _backend()
    mk.set_speculative(SPEC)
    cancel, got = CancelToken(), []
    for token in mk.stream(DecodeRequest(tuple(PROMPT), GREEDY, N, frozenset()), cancel):
        got.append(token)
        if len(got) == 20:
            cancel.set()
    assert got == plain[:20]
    # The passes' cache rows (drafts they did not keep among them) and the prefix cache's
    # record of them: a request reusing the prompt decodes as it would have.
    assert _stream(PROMPT, N, SPEC) == plain
    assert _stream(follow, 64) == want
    assert _stream(follow, 64, SPEC) == want


def test_a_request_sampled_by_temperature_draws_in_passes_what_steps_draw() -> None:
    # Each position's seeded Gumbel-max draw is the step's, so a drafted token is kept with
    # the probability the model gives it and the stream is plain sampling's.
    # A random model's logits lie close together: at a low temperature its samples loop as
    # its greedy output does (and then drafts are made), yet each is a Gumbel-max draw.
    sampled = SamplingParams(temperature=0.02, seed=5)
    plain = _stream(PROMPT, N, sampling=sampled)
    assert plain != _stream(PROMPT, N)  # not the greedy stream
    assert _stream(PROMPT, N, SPEC, sampling=sampled) == plain
    stats = _backend().speculation
    assert stats.passes > 0 and stats.drafted >= stats.accepted > 0, stats


def test_a_top_p_request_decodes_by_steps() -> None:
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    plain = _stream(PROMPT, 64, sampling=sampled)
    assert _stream(PROMPT, 64, SPEC, sampling=sampled) == plain
    assert _backend().speculation.drafted == 0


def test_the_default_model_copies_in_fewer_passes_with_the_same_tokens() -> None:
    """Real weights (SmolLM2-135M-Instruct, bf16): asked to repeat a function, the model
    copies it, the drafts are accepted, and the tokens are plain decoding's."""
    from monokernel.runtime.backends.monokernel import MonokernelBackend
    from monokernel.testing.gpu_models import default_model_on_gpu

    code = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(8))
    cfg, weights, prompt = default_model_on_gpu(f"Repeat this code exactly:\n\n{code}")
    mk = MonokernelBackend(cfg, weights, len(prompt) + 256, torch.device("cuda"))
    try:
        request = DecodeRequest(tuple(prompt), GREEDY, 256, frozenset())
        plain = list(mk.stream(request, CancelToken()))
        mk.set_speculative(SPEC)
        assert list(mk.stream(request, CancelToken())) == plain
        assert mk.speculation.accepted > 0
    finally:
        mk.close()
