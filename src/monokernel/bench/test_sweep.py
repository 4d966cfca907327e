"""The sweep and its JSON on the CPU: the reference engine on a tiny model, and fake engines
for the paths a real one rarely takes (errors, budgets, ratios). No timing assertions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from monokernel.bench import records, sweep
from monokernel.bench.measure import RunTiming, bytes_per_token
from monokernel.bench.merge import merge_results
from monokernel.bench.sweep import EngineLimits, SweepConfig, run_benchmark
from monokernel.bench.table import format_table
from monokernel.weights.loader import Checkpoint

CPU = torch.device("cpu")


def _run(tiny: Checkpoint, config: SweepConfig, json_path: Path | None = None) -> dict[str, Any]:
    return run_benchmark(
        tiny.config, tiny.weights, "tiny", config, CPU, {"k": 1}, torch.float32, json_path
    )


def test_reference_sweep_json_schema(tiny: Checkpoint, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    config = SweepConfig(("reference",), (8, 24, 10_000), (4,), repeats=3)
    doc = _run(tiny, config, out)
    on_disk = json.loads(out.read_text())
    assert on_disk == json.loads(json.dumps(doc))  # the file is the returned document
    records.validate(on_disk)
    assert on_disk["schema_version"] == records.SCHEMA_VERSION
    env = on_disk["environment"]
    assert env["device"] == "cpu" and env["gpu"] is None
    assert env["torch"] == torch.__version__ and env["monokernel"]
    assert "host" not in json.dumps(env)  # results get shared: no host name
    assert on_disk["runs"][0]["args"] == {"k": 1}
    assert on_disk["runs"][0]["copy_bw_GBps"] is None  # measured only on a GPU
    # 10,000 does not fit the tiny model's 256 positions: skipped with a note, not run.
    assert {(s["prompt_tokens"], s["engine"]) for s in on_disk["skipped"]} == {(10_000, None)}
    cells = on_disk["cells"]
    assert [(c["prompt_tokens"], c["gen_tokens"]) for c in cells] == [(8, 4), (24, 4)]
    for c in cells:
        assert c["status"] == "ok" and c["engine"] == "reference" and c["run"] == 0
        assert c["repeats"] == 3 and len(c["runs_raw"]) == 3
        assert c["gen_tokens_run"] == c["gen_tokens"]
        assert all(r["tokens"] == c["gen_tokens"] for r in c["runs_raw"])
        for metric in ("us_per_token", "tok_per_s", "ttft_ms"):
            s = c[metric]
            assert set(s) == {"median", "p10", "p90"} and s["p10"] <= s["median"] <= s["p90"]
        assert c["mean_context"] == c["prompt_tokens"] + c["gen_tokens"] / 2
        assert c["bytes_per_token"] > 0
        assert c["mbu"] is None and c["roofline_tok_s"] is None  # no bandwidth on the CPU
        assert c["vs_torch"] is None  # no torch engine in this run
    table = format_table(on_disk)
    assert table.splitlines()[0].startswith("device: cpu")
    assert table.splitlines()[1].startswith("engine")
    assert sum(line.startswith("reference") for line in table.splitlines()) == 2
    assert "note: skipped prompt 10000 gen 4" in table


def test_limits_cap_and_skip(tiny: Checkpoint) -> None:
    config = SweepConfig(
        ("reference",),
        (8, 40),
        (10,),
        repeats=3,
        limits={"reference": EngineLimits(max_prompt=16, gen_cap=5, repeats=2)},
    )
    doc = _run(tiny, config)
    (cell,) = doc["cells"]
    assert (cell["prompt_tokens"], cell["gen_tokens"], cell["gen_tokens_run"]) == (8, 10, 5)
    assert cell["repeats"] == 2 and cell["mean_context"] == 8 + 5 / 2
    (skip,) = doc["skipped"]
    assert skip["engine"] == "reference" and skip["prompt_tokens"] == 40
    assert "10*" in format_table(doc)  # a capped cell is marked


def test_sweep_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="gen lengths"):
        SweepConfig(("reference",), (8,), (1,))
    with pytest.raises(ValueError, match="at least one"):
        SweepConfig((), (8,), (4,))


class _FakeRunner:
    """Times by decree: torch 2 ms/token, 'fast' 1 ms, 'broken' raises."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.info = {"fake": True}
        self.closed = False

    def run(self, prompt: list[int], gen_tokens: int) -> RunTiming:
        if self.name == "broken":
            raise RuntimeError("no such luck")
        per_token = {"torch": 2e-3, "fast": 1e-3}[self.name]
        return RunTiming(len(prompt) * 1e-4, per_token, gen_tokens)

    def close(self) -> None:
        self.closed = True


def test_ratios_errors_and_bandwidth(tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sweep, "open_runner", lambda name, *a: _FakeRunner(name))
    config = SweepConfig(("torch", "fast", "broken"), (8,), (4,), repeats=2)
    cells, skipped = sweep.run_sweep(
        tiny.config, tiny.weights, config, CPU, bandwidth=1e9, log=lambda _: None
    )
    records.add_torch_ratios(cells)
    by = {c["engine"]: c for c in cells}
    assert all(c.pop("cell_wall_s") >= 0 for c in cells)
    assert by["broken"] == {
        "run": 0,
        "engine": "broken",
        "prompt_tokens": 8,
        "turn_tokens": 0,
        "gen_tokens": 4,
        "status": "error",
        "error": "RuntimeError: no such luck",
    }
    assert by["fast"]["vs_torch"] == pytest.approx(2.0)
    assert by["torch"]["vs_torch"] == pytest.approx(1.0)
    assert by["fast"]["ttft_vs_torch"] == pytest.approx(1.0)
    assert by["fast"]["fake"] is True  # the runner's info lands in its record
    fast = by["fast"]
    assert fast["tok_per_s"]["median"] == pytest.approx(1000.0)
    # MBU = bytes per token at the mean context / time per token / bandwidth.
    assert fast["mbu"] == pytest.approx(fast["bytes_per_token"] / 1e-3 / 1e9)
    assert fast["roofline_tok_s"] == pytest.approx(1e9 / fast["bytes_per_token"])
    assert fast["floor_us"] == pytest.approx(fast["bytes_per_token"] / 1e9 * 1e6)
    assert skipped == []


def test_streamed_layers_set_the_bytes_and_the_roofline(
    tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runner that says how its layers stream (the monokernel's, BackendRunner.layers) is
    counted at those bytes, MBU and ceiling with them; the others as their label says."""
    from monokernel.bench.engines import LayerStream
    from monokernel.weights.formats.int4 import Int4Groups

    layers = LayerStream((Int4Groups(32),) * 4, "groups int4-g32")

    def open_fake(name: str, *a: Any) -> _FakeRunner:
        runner = _FakeRunner(name)
        if name == "fast":
            runner.layers = layers  # type: ignore[attr-defined]
        return runner

    monkeypatch.setattr(sweep, "open_runner", open_fake)
    config = SweepConfig(("torch", "fast"), (8,), (4,), repeats=1)
    cells, _ = sweep.run_sweep(tiny.config, tiny.weights, config, CPU, 1e9, 0, 2, log=_quiet)
    by = {c["engine"]: c for c in cells}
    context = by["fast"]["mean_context"]
    bpt = layers.bytes_per_token(tiny.config, context, 2)
    assert bpt < bytes_per_token(tiny.config, context, 2)
    assert by["torch"]["bytes_per_token"] == bytes_per_token(tiny.config, context, 2)
    fast = by["fast"]
    assert fast["bytes_per_token"] == bpt
    assert fast["mbu"] == pytest.approx(bpt / 1e-3 / 1e9)
    assert fast["roofline_tok_s"] == pytest.approx(1e9 / bpt)
    assert fast["floor_us"] == pytest.approx(bpt / 1e9 * 1e6)


def _quiet(_msg: str) -> None:
    pass


def test_time_budget_skips_the_rest(tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sweep, "open_runner", lambda name, *a: _FakeRunner(name))
    config = SweepConfig(("torch", "fast"), (8, 16), (4,), time_budget_s=-1.0)
    cells, skipped = sweep.run_sweep(
        tiny.config, tiny.weights, config, CPU, None, log=lambda _: None
    )
    assert cells == []
    assert len(skipped) == 4 and all("time budget" in s["reason"] for s in skipped)


def test_merge_keeps_each_run_apart(tiny: Checkpoint) -> None:
    a = _run(tiny, SweepConfig(("reference",), (8,), (4,), repeats=1))
    b = _run(tiny, SweepConfig(("reference",), (16,), (4,), repeats=1))
    merged = records.validate(merge_results([a, b]))
    assert len(merged["runs"]) == 2
    assert [(c["run"], c["prompt_tokens"]) for c in merged["cells"]] == [(0, 8), (1, 16)]
    assert "environment_mismatch" not in merged
    with pytest.raises(ValueError, match="schema_version"):
        merge_results([a | {"schema_version": 1}])
