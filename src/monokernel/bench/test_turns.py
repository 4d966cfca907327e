"""``--turn-tokens``: a cell that times an agent's next turn (the warm-up's prompt plus N new
tokens), on the CPU with stand-in engines. No timing assertions."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

from monokernel.bench import engines, records, sweep
from monokernel.bench.hf import HFRunner
from monokernel.bench.measure import RunTiming
from monokernel.bench.sweep import SweepConfig
from monokernel.bench.table import format_table
from monokernel.models.config import ModelConfig
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.kv_filler import CacheFiller
from monokernel.runtime.prefix_cache import PrefixCache, fed_tokens
from monokernel.weights.loader import Checkpoint
from monokernel.weights.names import Weights

CPU = torch.device("cpu")


def _quiet(_msg: str) -> None:
    pass


class _Recorder:
    """Answers every request at once and remembers what it was asked, in order."""

    name = "recorder"

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.calls: list[tuple[list[int], int]] = []

    def run(self, prompt: list[int], gen_tokens: int) -> RunTiming:
        self.calls.append((list(prompt), gen_tokens))
        return RunTiming(len(prompt) * 1e-3, 1e-3, gen_tokens)  # TTFT (ms) = prompt length

    def close(self) -> None:
        pass


def _recorded_sweep(
    tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch, turn: int
) -> tuple[_Recorder, dict[str, Any]]:
    runners: list[_Recorder] = []

    def open_recorder(name: str, cfg: ModelConfig, w: Any, max_len: int, *_: Any) -> _Recorder:
        runners.append(_Recorder(max_len))
        return runners[-1]

    monkeypatch.setattr(sweep, "open_runner", open_recorder)
    config = SweepConfig(("recorder",), (40,), (8,), repeats=3, turn_tokens=turn)
    cells, _ = sweep.run_sweep(tiny.config, tiny.weights, config, CPU, None, log=_quiet)
    (runner,) = runners
    (cell,) = cells
    return runner, cell


def test_turn_requests_extend_the_warm_up_prompt(
    tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner, cell = _recorded_sweep(tiny, monkeypatch, turn=5)
    assert runner.max_len == 40 + 5 + 8 + 1  # the cache holds base, turn and generation
    base, warm_gen = runner.calls[0]
    assert len(base) == 40 and warm_gen == 8  # the warm-up: the base prompt, untimed
    # then one untimed turn (with a prompt of its own) and the base again, then the timed turns
    assert [len(p) for p, _ in runner.calls[:3]] == [40, 45, 40]
    warm_turn, timed_calls = runner.calls[1][0], runner.calls[3:]
    timed = [p for p, _ in timed_calls if len(p) == 45]
    assert len(timed) == 3 and warm_turn not in timed
    assert all(p[:40] == base for p in timed)  # each turn extends the warm-up's prompt
    new_parts = {tuple(p[40:]) for p in timed}
    assert len(new_parts) == 3  # with new tokens of its own
    # Between two turns the base runs again, untimed, so each turn finds the same cache.
    assert [len(p) for p, _ in runner.calls] == [40, 45, 40, 45, 40, 45, 40, 45]
    assert all(p == base for p, _ in runner.calls[2::2])
    # Only the turns are timed: the recorder's TTFT is the prompt length in ms.
    assert [r["ttft_ms"] for r in cell["runs_raw"]] == pytest.approx([45, 45, 45])
    assert cell["turn_tokens"] == 5 and cell["prompt_tokens"] == 40
    assert cell["request_prompt_tokens"] == 45
    assert cell["mean_context"] == 45 + 8 / 2  # MBU at the context decode really reads


def test_without_turns_every_request_is_fresh(
    tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner, cell = _recorded_sweep(tiny, monkeypatch, turn=0)
    assert runner.max_len == 40 + 8 + 1
    base = runner.calls[0][0]
    assert [len(p) for p, _ in runner.calls] == [40, 40, 40, 40]
    assert all(p[:8] != base[:8] for p, _ in runner.calls[1:])
    assert cell["turn_tokens"] == 0 and cell["request_prompt_tokens"] == 40


class _PrefillStandIn:
    """What CacheFiller needs of a Prefiller: the cache tensors, ``fitting_start`` (no graphs:
    the start itself), and ``run``, which here only counts the tokens it would prefill."""

    def __init__(self, max_len: int) -> None:
        self.k = torch.zeros(1, 1, max_len, 1)
        self.v = torch.zeros(1, 1, max_len, 1)
        self.tokens = 0

    def fitting_start(self, start: int, tokens: int) -> int:
        return start

    def run(self, tokens: list[int], start: int, logits: bool = False) -> None:
        self.tokens += len(tokens)


class _KernelStandIn:
    """The monokernel backend's cache bookkeeping (``RequestDriver.run`` in
    runtime/backends/monokernel/request.py) without the GPU: the runtime's own CacheFiller
    and PrefixCache decide what a request reuses, prefills and snapshots; the 'kernel' emits
    made-up tokens."""

    requests: ClassVar[list[dict[str, int]]] = []

    def __init__(self, cfg: ModelConfig, weights: Weights, max_len: int, device: Any) -> None:
        self.vocab = cfg.vocab_size
        self.prefill = _PrefillStandIn(max_len)
        self.snapshots = 0
        # The backend's default snapshot budget, twice the cache (1 byte per token here).
        self.prefix = PrefixCache(1, 2 * max_len)
        prefill: Any = self.prefill  # duck-typed: CacheFiller reads k, v and calls run
        self.filler = CacheFiller(prefill, self.prefix, self._snapshot_fits)

    def _snapshot_fits(self, nbytes: int) -> bool:
        self.snapshots += 1  # asked exactly when a snapshot is about to be copied
        return True

    def stream(self, request: DecodeRequest, cancel: CancelToken) -> Iterator[int]:
        prompt = list(request.prompt_ids)
        self.prefill.tokens = self.snapshots = 0
        self.filler.fill(prompt, len(prompt) - 1)
        self.requests.append(
            {"prompt": len(prompt), "prefilled": self.prefill.tokens, "snapshots": self.snapshots}
        )
        out = [(len(prompt) + s) % self.vocab for s in range(request.max_new_tokens)]
        yield from out
        self.prefix.finish(prompt, fed_tokens(prompt, out[:-1], len(out)))

    def close(self) -> None:
        pass


def test_every_turn_reuses_the_base_and_copies_nothing(
    tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A turn plus its generation (100 + 40) leaves more than a snapshot's 128 tokens past
    # the base: without the untimed base re-run, turns 2 and 3 would copy turn 1 aside.
    base, turn, gen = 200, 100, 40
    cfg = dataclasses.replace(tiny.config, vocab_size=50_000, max_position_embeddings=1024)
    monkeypatch.setitem(engines.BACKENDS, "standin", (__name__, "_KernelStandIn"))
    monkeypatch.setattr(_KernelStandIn, "requests", [])
    config = SweepConfig(("standin",), (base,), (gen,), repeats=3, turn_tokens=turn)
    (cell,), _ = sweep.run_sweep(cfg, tiny.weights, config, CPU, None, log=_quiet)
    assert cell["status"] == "ok", cell.get("error")
    timed = [r for r in _KernelStandIn.requests if r["prompt"] == base + turn][1:]
    assert len(timed) == 3  # after the untimed first turn
    for r in timed:
        assert r["prefilled"] == turn - 1  # the kernel's first step computes the last one
        assert r["snapshots"] == 0
    # The record says what the backend's prefix cache supplied.
    assert [r["reused_tokens"] for r in cell["runs_raw"]] == [base] * 3


def test_turn_record_table_and_ratios(tiny: Checkpoint) -> None:
    cfg = tiny.config
    timings = [RunTiming(2e-3, 1e-3, 8, reused_tokens=40)]
    turn = {"run": 0} | records.ok_record("monokernel", 40, 8, timings, cfg, None, 4, 5)
    cold = {"run": 0} | records.ok_record("torch", 40, 8, timings[:1], cfg, None, 4)
    records.add_torch_ratios([turn, cold])
    assert turn["vs_torch"] is None  # a turn cell is not compared with a cold one
    assert turn["runs_raw"][0]["reused_tokens"] == 40
    unknown = records.ok_record("t", 40, 8, [RunTiming(1, 1, 8)], cfg, None, 4)
    assert "reused_tokens" not in unknown["runs_raw"][0]  # no number where none is known
    doc = records.new_document({"device": "cpu"}, records.model_info(cfg, "t", "f32", 4))
    doc["runs"].append({"args": {}})
    doc["cells"] = [turn, cold]
    doc["skipped"] = [
        {"run": 0, "engine": "hf", "prompt_tokens": 40, "turn_tokens": 5, "gen_tokens": 8}
        | {"reason": "why not"}
    ]
    rows = format_table(records.validate(doc)).splitlines()
    assert rows[2].split()[:3] == ["torch", "40", "8"]  # a cell without a turn, as before
    assert rows[3].split()[:3] == ["monokernel", "40+5", "8"]  # after it: 40+5 > 40
    assert rows[-1] == "note: skipped hf prompt 40+5 gen 8: why not"


def test_sweep_config_refuses_negative_turns() -> None:
    with pytest.raises(ValueError, match="turn tokens must be >= 0"):
        SweepConfig(("reference",), (8,), (4,), turn_tokens=-1)


def test_turn_over_the_context_is_skipped(
    tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sweep, "open_runner", lambda *a: pytest.fail("must not open"))
    config = SweepConfig(("reference",), (200,), (8,), turn_tokens=50)  # 258 > 256
    cells, (note,) = sweep.run_sweep(tiny.config, tiny.weights, config, CPU, None, log=_quiet)
    assert cells == [] and note["turn_tokens"] == 50 and "max context" in note["reason"]


@pytest.mark.parametrize(("cache", "expect"), [("static", 8 + 5), ("dynamic", 8)])
def test_hf_static_warm_up_sizes_the_cache_for_the_turn(cache: str, expect: int) -> None:
    runner = HFRunner.__new__(HFRunner)  # no model: only the warm-up's arithmetic
    runner.cache, runner.device = cache, CPU
    asked: list[int] = []
    runner._timed = lambda ids, n: asked.append(n) or (0.0, n)  # type: ignore[method-assign]
    runner.warmup([1, 2, 3], 8, 5)
    assert asked == [expect]  # static: base + 8 + 5 positions, what the turns need
