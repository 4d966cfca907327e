"""The Engine on the reference backend with a tiny random model: events, stops, limits."""

from __future__ import annotations

import threading

import pytest

from monokernel import Engine, EngineConfig, SamplingParams
from monokernel.errors import InvalidRequestError
from monokernel.runtime.backends.base import CancelToken
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
