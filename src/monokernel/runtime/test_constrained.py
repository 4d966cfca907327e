"""Grammar-constrained decoding (runtime/constrained.py) on the tiny tokenizer and model:
masks, EOS exactly when the grammar accepts, valid output from random logits and random
weights on the reference and torch engines, and the refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("llguidance")

from monokernel.runtime.backends.base import DecodeRequest
from monokernel.runtime.backends.torch_compiled import TorchBackend
from monokernel.runtime.constrained import (
    INSTALL_HINT,
    Constraint,
    ConstraintError,
    GrammarCompiler,
    sample_masked,
    unsupported_reason,
)
from monokernel.runtime.engine import Engine, EngineConfig
from monokernel.runtime.sampling import SamplingParams
from monokernel.runtime.speculative import SpeculativeConfig
from monokernel.testing.tiny_models import make_tiny_model_dir
from monokernel.weights.loader import load_checkpoint
from monokernel.weights.safetensors_loader import cast_weights

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}


def _matches(value: object) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"city", "days", "metric"}
        and value["city"] in ("Paris", "Rome", "Tokyo")
        and type(value["days"]) is int
        and 1 <= value["days"] <= 7
        and type(value["metric"]) is bool
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir("llama3", tmp_path_factory.mktemp("constrained") / "tiny")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return Engine(model_dir, EngineConfig(engine="reference", device="cpu", progress=False))


@pytest.fixture(scope="module")
def compiler(engine: Engine) -> GrammarCompiler:
    return GrammarCompiler(engine.tokenizer.hf, engine.model_config.vocab_size, [2])


def test_mask_allows_eos_exactly_when_the_grammar_accepts(
    engine: Engine, compiler: GrammarCompiler
) -> None:
    hf = engine.tokenizer.hf
    eos = min(engine.eos_token_ids)
    compiler = GrammarCompiler(hf, engine.model_config.vocab_size, engine.eos_token_ids)
    m = compiler.matcher(Constraint.json_schema(SCHEMA))
    first = m.mask()
    assert first.shape == (engine.model_config.vocab_size,)
    assert not first[eos]
    assert all(hf.decode([t]).startswith("{") for t in first.nonzero().flatten().tolist())
    for t in hf('{"city": "Rome", "days": 3, "metric": true}', add_special_tokens=False)[
        "input_ids"
    ]:
        assert m.mask()[t], hf.decode([t])
        assert not m.mask()[eos]
        m.advance(t)
    assert m.accepting
    assert m.mask().nonzero().flatten().tolist() == [eos]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_logits_give_valid_json(
    engine: Engine, compiler: GrammarCompiler, temperature: float
) -> None:
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    for seed in range(5):
        m = compiler.matcher(Constraint.json_schema(SCHEMA))
        params = SamplingParams(temperature=temperature, seed=seed)
        out: list[int] = []
        for pos in range(200):
            token = sample_masked(torch.randn(vocab, generator=gen) * 5, params, pos, m)
            if token == 2:
                break
            out.append(token)
        else:
            pytest.fail("the grammar never ended")
        assert _matches(json.loads(engine.tokenizer.decode(out)))


def test_regex_and_choice(compiler: GrammarCompiler, engine: Engine) -> None:
    vocab = engine.model_config.vocab_size
    for constraint, check in (
        (Constraint.regex(r"[0-9]{3}-[a-z]{2}"), lambda s: len(s) == 6 and s[3] == "-"),
        (Constraint.choice(["yes", "no"]), lambda s: s in ("yes", "no")),
    ):
        m = compiler.matcher(constraint)
        out: list[int] = []
        for pos in range(50):
            token = sample_masked(torch.randn(vocab), SamplingParams(temperature=0), pos, m)
            if token == 2:
                break
            out.append(token)
        assert check(engine.tokenizer.decode(out)), engine.tokenizer.decode(out)


def test_refused_schema_names_what_llguidance_refused(compiler: GrammarCompiler) -> None:
    with pytest.raises(ConstraintError, match="Unknown format: bogus"):
        compiler.matcher(Constraint.json_schema({"type": "string", "format": "bogus"}))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_output_matches_schema(engine: Engine, temperature: float) -> None:
    for seed in range(3):
        params = SamplingParams(
            max_tokens=100,
            temperature=temperature,
            seed=seed,
            constraint=Constraint.json_schema(SCHEMA),
        )
        done = engine.complete("Weather?", params)
        assert done.finish_reason == "stop"
        assert _matches(json.loads(done.text)), done.text


def test_torch_backend_matches_reference_under_a_constraint(model_dir: Path) -> None:
    cpu = torch.device("cpu")
    ckpt = load_checkpoint(model_dir, progress=False, device=cpu, dtype=torch.float32)
    engine = Engine(ckpt, EngineConfig(engine="reference", device="cpu", progress=False))
    constraint = Constraint.json_object()
    want = [
        engine.complete("x", SamplingParams(max_tokens=60, temperature=t, seed=3, constraint=c))
        for t in (0.0, 0.9)
        for c in (constraint, None)
    ]
    weights = cast_weights(dict(ckpt.weights), torch.float32, cpu)
    engine.backend = TorchBackend(ckpt.config, weights, engine.max_model_len, cpu, compile=False)
    engine.engine_name = "torch"
    got = [
        engine.complete("x", SamplingParams(max_tokens=60, temperature=t, seed=3, constraint=c))
        for t in (0.0, 0.9)
        for c in (constraint, None)
    ]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert isinstance(json.loads(got[0].text), dict)
    assert got[0].token_ids != got[1].token_ids  # the mask did change the greedy output


def test_other_engines_refuse() -> None:
    for engine in ("reference", "torch", "monokernel"):
        assert unsupported_reason(engine) is None
    assert "runs on the reference, torch, monokernel engines" in (unsupported_reason("hf") or "")


def test_under_speculative_a_constrained_request_decodes_without_drafts(
    engine: Engine, model_dir: Path
) -> None:
    """The same tokens as an engine without --speculative, greedy and sampled, nothing
    drafted; an unconstrained request on the same engine still drafts."""
    config = EngineConfig(
        engine="reference",
        device="cpu",
        progress=False,
        speculative=SpeculativeConfig(num_tokens=4, ngram_min=1),
    )
    spec = Engine(model_dir, config)
    for t in (0.0, 0.9):
        p = SamplingParams(
            max_tokens=24, temperature=t, seed=5, constraint=Constraint.json_object()
        )
        got, want = spec.complete("x", p), engine.complete("x", p)
        assert got.token_ids == want.token_ids
        assert got.timings.drafted_tokens == 0

    # Which requests draft: not those with a grammar, logit processing or logprobs.
    def drafts(sp: SamplingParams, constraint: Constraint | None = None) -> bool:
        matcher = None if constraint is None else spec.constraint_matcher(constraint)
        return spec.backend.drafting(DecodeRequest((1, 2), sp, 4, frozenset(), matcher))

    assert drafts(SamplingParams()) and drafts(SamplingParams(temperature=0.8, seed=1))
    assert not drafts(SamplingParams(), Constraint.json_object())
    assert not drafts(SamplingParams(presence_penalty=0.5))
    assert not drafts(SamplingParams(logprobs=2))


def test_missing_llguidance_says_how_to_install(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "llguidance", None)
    monkeypatch.setitem(sys.modules, "llguidance.hf", None)
    fresh = GrammarCompiler(engine.tokenizer.hf, engine.model_config.vocab_size, [2])
    with pytest.raises(ConstraintError, match="llguidance") as info:
        fresh.matcher(Constraint.json_object())
    assert INSTALL_HINT in str(info.value)


def test_words_are_the_mask_packed_for_the_kernel(engine: Engine) -> None:
    """The monokernel's mask words hold mask()'s bits, 32 ids a word, nothing past the
    vocabulary (an odd 333-id one here)."""
    compiler = GrammarCompiler(engine.tokenizer.hf, 333, engine.eos_token_ids)
    m = compiler.matcher(Constraint.json_schema(SCHEMA))
    for text in ("", '{"city": "Ro'):
        for t in engine.tokenizer.hf(text, add_special_tokens=False)["input_ids"]:
            m.advance(t)
        words = m.words()
        assert words.shape == (11,) and words.dtype.name == "uint32"
        bits = [bool(words[i >> 5] >> (i & 31) & 1) for i in range(11 * 32)]
        assert bits[:333] == m.mask().tolist() and not any(bits[333:])
