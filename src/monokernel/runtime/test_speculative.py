"""N-gram drafting and verification (speculative.py) against decoding one token a pass."""

from __future__ import annotations

import pytest
import torch

from monokernel.errors import InvalidRequestError
from monokernel.models.shapes import SHAPES
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.backends.reference import ReferenceBackend
from monokernel.runtime.sampling import SamplingParams
from monokernel.runtime.speculative import NgramDrafter, SpeculativeConfig, accept, verify
from monokernel.testing.counted import Counted
from monokernel.weights.random_weights import random_weights


def test_drafts_what_followed_the_latest_occurrence_of_the_longest_suffix() -> None:
    d = NgramDrafter(SpeculativeConfig(num_tokens=3, ngram_max=3, ngram_min=1))
    d.extend([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7])
    # Suffix (3, 6, 7) never occurred before; (6, 7) last did at 6-7, followed by 2, 3, 6.
    assert d.draft(10) == [2, 3, 6]
    assert d.draft(2) == [2, 3]  # the caller's limit
    d.extend([8])  # (6, 7, 8) occurred at 1-3: followed by 9, 1, 6
    assert d.draft(10) == [9, 1, 6]
    assert d.draft(0) == []


def test_no_draft_without_an_earlier_occurrence_of_the_shortest_suffix() -> None:
    d = NgramDrafter(SpeculativeConfig(num_tokens=4, ngram_min=2, ngram_max=4), [1, 2, 3, 4, 5])
    assert d.draft(4) == []
    d.extend([1, 2])  # (1, 2) occurred at the start, followed by 3, 4, 5, 1
    assert d.draft(4) == [3, 4, 5, 1]


def test_the_draft_stops_at_the_end_of_the_history() -> None:
    d = NgramDrafter(SpeculativeConfig(num_tokens=8, ngram_min=1, ngram_max=1), [4, 9, 4])
    assert d.draft(8) == [9, 4]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "eagle"}, "choose from ngram"),
        ({"num_tokens": 0}, "num-speculative-tokens"),
        ({"num_tokens": 33}, "num-speculative-tokens"),
        ({"ngram_min": 3, "ngram_max": 2}, "ngram-min"),
        ({"ngram_min": 0}, "ngram-min"),
    ],
)
def test_bad_settings_are_refused_naming_the_flag(kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        SpeculativeConfig(**kwargs)


def test_a_config_as_an_engine_runs_it_takes_the_engines_bounds_where_not_given() -> None:
    unasked = SpeculativeConfig(by_default=True)
    mk = unasked.for_engine("monokernel")
    assert (mk.num_tokens, mk.ngram_max, mk.ngram_min) == (3, 6, 3)
    assert mk.by_default  # so the engine stays quiet where this backend does not draft
    asked = SpeculativeConfig(ngram_min=1).for_engine("torch")
    assert (asked.num_tokens, asked.ngram_max, asked.ngram_min, asked.by_default) == (
        3,
        4,
        1,
        False,
    )


def test_the_reference_engine_drafts_only_when_asked() -> None:
    backend = ReferenceBackend(SHAPES["odd"], random_weights(SHAPES["odd"], seed=3), 64, "cpu")
    assert not backend.drafts_by_default() and backend.drafts_verified()


def test_verify_accepts_while_the_rule_agrees_then_emits_the_rule_token() -> None:
    v = 10
    logits = torch.full((4, v), -5.0)
    for row, best in enumerate([3, 4, 9, 1]):
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0.0)
    assert verify(logits, [3, 4, 9], greedy, 0) == [3, 4, 9, 1]  # all accepted + one more
    assert verify(logits, [3, 7, 9], greedy, 0) == [3, 4]  # the second is replaced
    assert verify(logits[:1], [], greedy, 0) == [3]


def test_accept_keeps_the_draws_up_to_the_first_disagreement() -> None:
    assert accept([3, 4, 9, 1], [3, 4, 9]) == [3, 4, 9, 1]
    assert accept([3, 4, 9, 1], [3, 7, 9]) == [3, 4]
    assert accept([5, 4, 9, 1], [3, 4, 9]) == [5]
    assert accept([3], []) == [3]


def _requests(sp: SamplingParams, n_new: int) -> tuple[list[int], DecodeRequest]:
    cfg = SHAPES["odd"]
    gen = torch.Generator().manual_seed(5)
    piece = torch.randint(0, cfg.vocab_size, (40,), generator=gen).tolist()
    prompt = piece + piece[:25]  # the prompt repeats itself: drafts from its first copy
    return prompt, DecodeRequest(tuple(prompt), sp, n_new, frozenset())


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=7),
        SamplingParams(temperature=1.1, top_k=20, top_p=0.9, seed=3),
    ],
    ids=["greedy", "temperature", "topk-topp"],
)
def test_speculation_gives_the_same_tokens_as_one_token_a_pass(sp: SamplingParams) -> None:
    """Same ids, greedy or seeded sampling; the drafts were made and some accepted."""
    cfg = SHAPES["odd"]
    weights = random_weights(cfg, seed=2, dtype=torch.float32)
    backend = ReferenceBackend(cfg, weights, 400, torch.device("cpu"))
    _, request = _requests(sp, 120)
    plain = list(backend.stream(request, CancelToken()))
    backend.set_speculative(SpeculativeConfig(num_tokens=5, ngram_min=1, ngram_max=3))
    fast = list(backend.stream(request, CancelToken()))
    stats = backend.speculation
    assert stats is not None
    print(f"{sp}: {stats}")
    assert fast == plain
    assert stats.passes > 0 and stats.drafted >= stats.passes
    assert 0 <= stats.accepted <= stats.drafted
    if sp.greedy:
        assert stats.accepted > 0


def test_speculation_keeps_stops_and_max_tokens() -> None:
    cfg = SHAPES["odd"]
    weights = random_weights(cfg, seed=2, dtype=torch.float32)
    backend = ReferenceBackend(cfg, weights, 400, torch.device("cpu"))
    prompt, request = _requests(SamplingParams(temperature=0.0), 60)
    plain = list(backend.stream(request, CancelToken()))
    stop = plain[17]
    stopped = DecodeRequest(tuple(prompt), request.sampling, 60, frozenset({stop}))
    want = list(backend.stream(stopped, CancelToken()))
    backend.set_speculative(SpeculativeConfig(num_tokens=8, ngram_min=1))
    assert list(backend.stream(stopped, CancelToken())) == want and want[-1] == stop
    short = DecodeRequest(tuple(prompt), request.sampling, 7, frozenset())
    assert list(backend.stream(short, CancelToken())) == plain[:7]
    # A cache with room for the prompt and 10 tokens: drafts never write past it.
    tight = ReferenceBackend(cfg, weights, len(prompt) + 10, torch.device("cpu"))
    tight.set_speculative(SpeculativeConfig(num_tokens=8, ngram_min=1))
    ten = DecodeRequest(tuple(prompt), request.sampling, 10, frozenset())
    assert list(tight.stream(ten, CancelToken())) == plain[:10]


def test_the_torch_engine_speculates_the_same_tokens() -> None:
    """The torch backend (uncompiled here, on the CPU) drafts and verifies like the reference."""
    from monokernel.runtime.backends.torch_compiled import TorchBackend

    cfg = SHAPES["odd"]
    weights = random_weights(cfg, seed=2, dtype=torch.float32)
    _, request = _requests(SamplingParams(temperature=0.0), 60)
    want = list(
        ReferenceBackend(cfg, weights, 400, torch.device("cpu")).stream(request, CancelToken())
    )
    backend = TorchBackend(cfg, weights, 400, torch.device("cpu"), compile=False)
    backend.set_speculative(SpeculativeConfig(num_tokens=5, ngram_min=1))
    assert list(backend.stream(request, CancelToken())) == want
    assert backend.speculation is not None and backend.speculation.accepted > 0


# A 64-token suffix must recur before anything is drafted: never, in a short request.
NEVER = SpeculativeConfig(num_tokens=4, ngram_min=64, ngram_max=64)


@pytest.mark.parametrize(
    "sp",
    [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=7)],
    ids=["greedy", "sampled"],
)
@pytest.mark.parametrize("config", [NEVER, SpeculativeConfig(num_tokens=5, ngram_min=1)])
def test_a_pass_without_a_draft_is_the_torch_engines_plain_step(
    sp: SamplingParams, config: SpeculativeConfig
) -> None:
    """Every pass that drafted nothing calls the step the torch engine decodes with (here its
    float32 step, uncompiled: on a GPU the compiled one), and only a pass with a draft runs
    a verification forward: the same ids as without drafts, with no draft at all or some."""
    from monokernel.runtime.backends.torch_compiled import TorchBackend

    cfg = SHAPES["odd"]
    weights = random_weights(cfg, seed=2, dtype=torch.float32)
    _, request = _requests(sp, 40)
    backend = TorchBackend(cfg, weights, 400, torch.device("cpu"), compile=False)
    plain = list(backend.stream(request, CancelToken()))
    step = backend._step = Counted(backend._step)  # type: ignore[method-assign]
    assert list(backend.stream(request, CancelToken())) == plain
    assert step.calls == len(plain) - 1  # without drafts: a step for each token past the first
    step.calls = 0
    forward = backend._forward = Counted(backend._forward)  # type: ignore[method-assign]
    backend.set_speculative(config)
    assert list(backend.stream(request, CancelToken())) == plain
    stats = backend.speculation
    assert stats is not None
    # Each pass emits one token plus the drafted tokens it accepted.
    draftless = len(plain) - 1 - stats.accepted - stats.passes
    assert step.calls == draftless and forward.calls == stats.passes
    if config is NEVER:
        assert stats.passes == 0 and draftless == len(plain) - 1
    else:
        assert stats.passes > 0 and draftless > 0


def test_a_backend_whose_passes_do_not_sum_as_its_step_makes_no_draft() -> None:
    """Where drafts_verified is False (the torch engine on a GPU: eager bf16 passes against
    its compiled step), the request drafts nothing and every token comes from the plain
    step, so the ids are plain decoding's; where True, the same request drafts."""
    from monokernel.runtime.backends.torch_compiled import TorchBackend

    cfg = SHAPES["odd"]
    weights = random_weights(cfg, seed=2, dtype=torch.float32)
    _, request = _requests(SamplingParams(temperature=0.0), 40)
    backend = TorchBackend(cfg, weights, 400, torch.device("cpu"), compile=False)
    assert backend.drafts_verified()  # on the CPU the packed passes sum as the step does
    plain = list(backend.stream(request, CancelToken()))
    backend.set_speculative(SpeculativeConfig(num_tokens=5, ngram_min=1))
    backend.drafts_verified = lambda: False  # type: ignore[method-assign]
    forward = backend._forward = Counted(backend._forward)  # type: ignore[method-assign]
    assert list(backend.stream(request, CancelToken())) == plain
    assert backend.speculation is not None and backend.speculation.drafted == 0
    assert forward.calls == 0
    backend.drafts_verified = lambda: True  # type: ignore[method-assign]
    assert list(backend.stream(request, CancelToken())) == plain
    assert backend.speculation.drafted > 0 and forward.calls > 0
