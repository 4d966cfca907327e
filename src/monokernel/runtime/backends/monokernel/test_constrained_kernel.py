"""Constrained decoding on the monokernel (grammar_mask.py, kernels/csrc/sampling.cuh
``grammar_allows``): the kernel draws only what the grammar allows, from a tiny random model
whose unconstrained output is nowhere near JSON, greedy and sampled, with the first token
from the prefill or from the kernel, and when the host's masks come late.

GPU tests (marker ``gpu``) on a Hopper GPU (two for --tp 2); they need llguidance.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("llguidance")

from monokernel.runtime.constrained import Constraint, TokenMatcher
from monokernel.runtime.engine import Engine, EngineConfig
from monokernel.runtime.sampling import SamplingParams
from monokernel.runtime.test_constrained import SCHEMA, _matches
from monokernel.testing.gpu_models import needs_hopper, needs_hopper_pair
from monokernel.testing.tiny_models import make_tiny_model_dir

# Kernel-sized (the tiny tests' 72-wide model has rows the kernel cannot read).
SIZES = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
}


pytestmark = [
    pytest.mark.gpu,
    needs_hopper,
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    d: Path = make_tiny_model_dir("llama3", tmp_path_factory.mktemp("mkgrammar") / "m", sizes=SIZES)
    mk = Engine(d, EngineConfig(engine="monokernel", device="cuda", progress=False))
    assert mk.engine_name == "monokernel"
    return mk


def _params(temperature: float, seed: int, constraint: Constraint | None) -> SamplingParams:
    return SamplingParams(max_tokens=120, temperature=temperature, seed=seed, constraint=constraint)


def _all_allowed(engine: Engine, constraint: Constraint, ids: list[int]) -> bool:
    m = engine.constraint_matcher(constraint)
    for t in ids:
        if not bool(m.mask()[t]):
            return False
        m.advance(t)
    return True


@pytest.mark.parametrize("first", ["prefill", "kernel"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_kernel_draws_only_what_the_grammar_allows(
    engine: Engine, temperature: float, first: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine.backend, "first_from_prefill", first == "prefill")
    schema = Constraint.json_schema(SCHEMA)
    for seed in range(3):
        got = engine.complete("Weather?", _params(temperature, seed, schema))
        assert _matches(json.loads(got.text)), got.text
        assert _all_allowed(engine, schema, got.token_ids)
        plain = engine.complete("Weather?", _params(temperature, seed, None))
        assert plain.token_ids != got.token_ids  # the mask did the work, not the weights
    regex = Constraint.regex(r"[0-9]{3}-[a-z]{2}")
    got = engine.complete("Code?", _params(temperature, 7, regex))
    assert len(got.text) == 6 and got.text[3] == "-" and got.text[:3].isdigit(), got.text


def test_late_masks_are_waited_for(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host slower than the kernel's step (2 ms a mask) changes nothing: the LM head waits
    for each step's mask."""
    schema = Constraint.json_schema(SCHEMA)
    want = engine.complete("Weather?", _params(0.0, 0, schema))
    words = TokenMatcher.words

    def slow(self: TokenMatcher):  # type: ignore[no-untyped-def]
        time.sleep(0.002)
        return words(self)

    monkeypatch.setattr(TokenMatcher, "words", slow)
    got = engine.complete("Weather?", _params(0.0, 0, schema))
    assert got.token_ids == want.token_ids


@needs_hopper_pair
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_tp2_draws_only_what_the_grammar_allows(
    engine: Engine, tmp_path_factory: pytest.TempPathFactory, temperature: float
) -> None:
    """--tp 2: every rank gets each step's mask and masks its own ids; the token both ranks
    agree on is one the grammar allows (the same weights as the TP=1 engine's)."""
    d = make_tiny_model_dir("llama3", tmp_path_factory.mktemp("mkgrammar2") / "m", sizes=SIZES)
    tp = Engine(d, EngineConfig(engine="monokernel", device="cuda:0", tp=2, progress=False))
    schema = Constraint.json_schema(SCHEMA)
    try:
        for seed in range(3):
            got = tp.complete("Weather?", _params(temperature, seed, schema))
            assert _matches(json.loads(got.text)), got.text
            assert _all_allowed(engine, schema, got.token_ids)
            plain = tp.complete("Weather?", _params(temperature, seed, None))
            assert plain.token_ids != got.token_ids
        regex = Constraint.regex(r"[0-9]{3}-[a-z]{2}")
        got = tp.complete("Code?", _params(temperature, 7, regex))
        assert len(got.text) == 6 and got.text[3] == "-" and got.text[:3].isdigit(), got.text
    finally:
        tp.close()
