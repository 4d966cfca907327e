"""The Engine on the reference backend with a tiny random model: events, stops, limits."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from monokernel import Engine, EngineConfig, SamplingParams
from monokernel.errors import BackendUnavailableError, InvalidRequestError, UnsupportedModelError
from monokernel.models.config import ModelConfig
from monokernel.runtime import backends
from monokernel.runtime import engine as engine_mod
from monokernel.runtime.backends.base import CancelToken
from monokernel.runtime.backends.reference import ReferenceBackend
from monokernel.runtime.memory_plan import ContextPlan, ContextTooLargeError
from monokernel.testing.tiny_models import make_tiny_model_dir


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    d = make_tiny_model_dir("qwen2", tmp_path_factory.mktemp("m") / "tiny")
    return Engine(d, EngineConfig(engine="reference", device="cpu", max_model_len=128))


def test_events_then_one_final_event(engine: Engine) -> None:
    events = list(
        engine.generate("def f", SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
    )
    assert [e.token_id is None for e in events] == [False] * 9 + [True]
    final = events[-1]
    assert final.finish_reason == "length"
    assert final.timings and final.timings.generated_tokens == 9
    ids = [e.token_id for e in events[:-1]]
    assert "".join(e.text for e in events) == engine.tokenizer.decode(ids)  # type: ignore[arg-type]


def test_greedy_and_seeded_sampling_are_reproducible(engine: Engine) -> None:
    for params in (
        SamplingParams(max_tokens=12, temperature=0),
        SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=5),
    ):
        a, b = engine.complete("import", params), engine.complete("import", params)
        assert a.token_ids == b.token_ids


def test_stop_token_id_ends_with_stop(engine: Engine) -> None:
    free = engine.complete("x", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    out = engine.complete(
        "x",
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=(stop_at,)),
    )
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: first + 1]


def test_stop_string_cuts_the_text(engine: Engine) -> None:
    free = engine.complete("for", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert len(free.text) > 6
    stop = free.text[4:6]
    cut = free.text.index(stop)
    out = engine.complete(
        "for", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=(stop,))
    )
    assert out.finish_reason == "stop"
    assert out.text == free.text[:cut]
    assert len(out.token_ids) < 24


def test_cancel_stops_the_stream(engine: Engine) -> None:
    cancel = CancelToken()
    events = []
    for e in engine.generate(
        "a", SamplingParams(max_tokens=100, temperature=0, ignore_eos=True), cancel=cancel
    ):
        events.append(e)
        if len(events) == 3:
            threading.Thread(target=cancel.set).start()
    assert events[-1].finish_reason == "cancelled"
    assert len(events) < 10
    # The next request is unaffected.
    assert (
        engine.complete(
            "a", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        ).finish_reason
        == "length"
    )


def test_chat_messages_use_the_template(engine: Engine) -> None:
    ids = engine.encode([{"role": "user", "content": "hello"}])
    assert engine.tokenizer.hf.decode(ids).startswith("<|im_start|>user\nhello")


def test_prompt_over_the_context_is_refused(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match=r"over the context limit of 128"):
        engine.generate("hello", SamplingParams(max_tokens=200))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.generate("", SamplingParams())


def test_the_startup_line_names_the_context(engine: Engine) -> None:
    limit = engine.model_config.max_position_embeddings
    assert engine.engine_note is None
    assert engine.startup_notes == (
        f"context: 128 tokens (--max-model-len 128; model max {limit})",
    )


# -- `--engine auto` where the monokernel cannot run: stand-in monokernels, real torch -------


class UnbuildableMonokernel:
    """Refuses the model as the real backend does for a shape its kernel lacks."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise UnsupportedModelError("head_dim 104 is not supported by the kernel")


class NeverBuiltMonokernel:
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("the plan said the monokernel cannot fit; it must not be built")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir("qwen2", tmp_path_factory.mktemp("fb") / "tiny")


def _monokernel_resolves(monkeypatch: pytest.MonkeyPatch, stand_in: str) -> None:
    """The CPU resolves like a Hopper GPU would, with ``stand_in`` as the monokernel."""

    def resolve(name: str, device: torch.device) -> str:
        return "monokernel" if name in ("auto", "monokernel") else name

    monkeypatch.setattr(engine_mod, "resolve_engine", resolve)
    monkeypatch.setattr(backends, "resolve_engine", resolve)
    monkeypatch.setitem(backends.BACKEND_CLASSES, "monokernel", (__name__, stand_in))


def test_auto_runs_torch_when_the_monokernel_cannot_build(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _monokernel_resolves(monkeypatch, "UnbuildableMonokernel")
    eng = Engine(model_dir, EngineConfig(device="cpu", max_model_len=64, progress=False))
    assert eng.engine_name == "torch" and type(eng.backend).__name__ == "TorchBackend"
    assert eng.engine_note == (
        "monokernel: cannot run this model (head_dim 104 is not supported by the kernel); "
        "using the torch engine"
    )
    assert eng.startup_notes[0] == eng.engine_note and eng.max_model_len == 64
    out = eng.complete("def f", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == 4


def test_a_named_monokernel_that_cannot_build_fails(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _monokernel_resolves(monkeypatch, "UnbuildableMonokernel")
    config = EngineConfig(engine="monokernel", device="cpu", max_model_len=64, progress=False)
    with pytest.raises(UnsupportedModelError, match="head_dim 104"):
        Engine(model_dir, config)


def test_auto_runs_torch_when_only_torch_fits_in_memory(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _monokernel_resolves(monkeypatch, "NeverBuiltMonokernel")
    asked: list[str] = []

    def plan(
        cfg: ModelConfig, free: int | None, weights: int, engine: str, *rest: object
    ) -> ContextPlan:
        asked.append(engine)
        if engine == "monokernel":
            raise ContextTooLargeError("too large", 2048, 90 * 2**30, 80 * 2**30)
        return ContextPlan(48, "context: 48 tokens (planned for torch)")

    monkeypatch.setattr(engine_mod, "plan_context", plan)
    eng = Engine(model_dir, EngineConfig(device="cpu", progress=False))
    assert asked == ["monokernel", "torch"]
    assert eng.engine_name == "torch" and eng.max_model_len == 48
    assert eng.startup_notes == (
        "monokernel: cannot run this model (its load needs 90.0 GiB for a 2048-token context, "
        "weight repacking included, and 80.0 GiB is free); using the torch engine",
        "context: 48 tokens (planned for torch)",
    )


def test_when_nothing_fits_the_monokernel_error_stands(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _monokernel_resolves(monkeypatch, "NeverBuiltMonokernel")

    def plan(
        cfg: ModelConfig, free: int | None, weights: int, engine: str, *rest: object
    ) -> ContextPlan:
        raise ContextTooLargeError(f"{engine} does not fit", 1, 2, 1)

    monkeypatch.setattr(engine_mod, "plan_context", plan)
    with pytest.raises(ContextTooLargeError, match=r"^monokernel does not fit$"):
        Engine(model_dir, EngineConfig(device="cpu", progress=False))


class DraftlessMonokernel(ReferenceBackend):
    """A monokernel stand-in whose shape has no pass build (MonokernelBackend.drafts_note)."""

    name = "monokernel"
    drafts_note = "no pass build fits this shape"

    def __init__(self, *args: Any, **_: object) -> None:  # the monokernel's keywords unused
        super().__init__(*args[:4])

    def drafts_verified(self) -> bool:
        return False

    def drafts_by_default(self) -> bool:
        return True  # as the monokernel's, which drafts by default where its passes fit


def test_speculative_reaches_the_monokernel_which_says_why_it_makes_no_drafts(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from monokernel.runtime.speculative import SpeculativeConfig

    _monokernel_resolves(monkeypatch, "DraftlessMonokernel")
    spec = SpeculativeConfig(ngram_min=1)
    config = EngineConfig(device="cpu", max_model_len=96, progress=False, speculative=spec)
    eng = Engine(model_dir, config)
    # The config as the monokernel runs it: its own n-gram bounds where none was given.
    assert eng.engine_name == "monokernel" and eng.backend.speculative == spec.for_engine(
        "monokernel"
    )
    assert (eng.backend.speculative.ngram_max, eng.backend.speculative.ngram_min) == (6, 1)
    assert eng.engine_note == (
        "no pass build fits this shape, so it makes none (docs/speculative.md)"
    )
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    out = eng.complete("abc abc abc abc", sp)
    assert len(out.token_ids) == 12 and out.timings.drafted_tokens == 0
    two = EngineConfig(device="cpu", progress=False, speculative=spec, tp=2)
    with pytest.raises(InvalidRequestError, match="not with --tp > 1"):
        Engine(model_dir, two)


class PassBuildFailsMonokernel(DraftlessMonokernel):
    """A monokernel stand-in whose pass build nvcc refuses (MonokernelBackend.set_speculative
    raises what build.py raises)."""

    def set_speculative(self, config: Any) -> None:
        super().set_speculative(config)
        if config is not None:
            raise BackendUnavailableError("nvcc failed building the monokernel (...):\nptxas")


def test_a_pass_build_that_fails_costs_the_default_nothing_but_an_asked_run(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from monokernel.runtime.speculative import SpeculativeConfig

    _monokernel_resolves(monkeypatch, "PassBuildFailsMonokernel")
    unasked = SpeculativeConfig(by_default=True)
    eng = Engine(model_dir, EngineConfig(device="cpu", progress=False, speculative=unasked))
    assert eng.speculative is None and eng.backend.speculative is None
    assert eng.engine_note == (
        "speculative decoding off: nvcc failed building the monokernel (...): "
        "(--speculative off skips it)"
    )
    assert len(eng.complete("abc", SamplingParams(max_tokens=3, temperature=0)).token_ids) == 3
    asked = EngineConfig(device="cpu", progress=False, speculative=SpeculativeConfig())
    with pytest.raises(BackendUnavailableError, match="nvcc failed"):
        Engine(model_dir, asked)


def test_the_default_speculation_stays_quiet_where_the_monokernel_cannot_draft(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculation nobody asked for (run's and serve's default) is dropped without a note
    where the model's passes do not fit, and under --tp > 1 it is not refused."""
    from monokernel.runtime.speculative import SpeculativeConfig

    _monokernel_resolves(monkeypatch, "DraftlessMonokernel")
    unasked = SpeculativeConfig(by_default=True)
    eng = Engine(model_dir, EngineConfig(device="cpu", progress=False, speculative=unasked))
    assert eng.engine_name == "monokernel" and eng.engine_note is None
    assert eng.speculative is None and eng.backend.speculative is None
    out = eng.complete("abc abc abc abc", SamplingParams(max_tokens=5, temperature=0))
    assert out.timings.drafted_tokens is None  # decoded without speculation, as off
    two = EngineConfig(device="cpu", progress=False, speculative=unasked, tp=2)
    with pytest.raises(Exception) as refused:  # TP needs GPUs: refused, but not for drafts
        Engine(model_dir, two)
    assert "--tp 2" in str(refused.value) and "--speculative" not in str(refused.value)
