"""Figures drawn from a result JSON written here (skipped without matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from monokernel.bench import plot, records
from monokernel.bench.measure import RunTiming
from monokernel.models.shapes import SHAPES

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Decode seconds per token by engine: made up, only their order matters to a figure.
SPEED = {"monokernel": 1.1e-3, "torch": 2.1e-3, "hf": 9e-3}


def _result() -> dict[str, Any]:
    cfg = SHAPES["llama-3.2-1b"]
    doc = records.new_document(
        {"device": "test GPU", "gpu": None}, records.model_info(cfg, "llama", "bf16", 2)
    )
    doc["runs"].append({"args": {}, "copy_bw_GBps": 3000.0})
    cells = [(p, 128) for p in (128, 512, 2048)] + [(64, g) for g in (512, 2048)]
    for prompt, gen in cells:
        for engine, s in SPEED.items():
            timings = [RunTiming(prompt * 1e-5 * k, s * k, gen) for k in (0.98, 1.0, 1.03)]
            rec = records.ok_record(engine, prompt, gen, timings, cfg, 3e12, 2)
            doc["cells"].append({"run": 0} | rec)
    doc["cells"].append(
        {"run": 0} | records.error_record("hf", 4096, 128, RuntimeError("out of memory"))
    )
    records.add_torch_ratios(doc["cells"])
    return doc


def test_plot_cli_draws_every_figure(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    results.write_text(json.dumps(_result()))
    out = tmp_path / "figs"
    assert plot.main([str(results), "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "decode_vs_gen.png",
        "decode_vs_prompt.png",
        "ratio_vs_torch.png",
        "ttft_vs_prompt.png",
    ]
    for name in names:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC


def test_single_cell_without_torch_draws_nothing(tmp_path: Path) -> None:
    doc = _result()
    doc["cells"] = [c for c in doc["cells"] if c["engine"] == "hf" and c["prompt_tokens"] == 128]
    records.add_torch_ratios(doc["cells"])
    assert plot.draw(doc, tmp_path) == []


def test_turn_cells_stay_out_of_the_sweeps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = _result()
    cfg = SHAPES["llama-3.2-1b"]
    for engine, s in SPEED.items():  # a prefix-reuse turn at gen 128, the prompt sweep's gen
        timings = [RunTiming(5e-3, s, 128)]
        rec = records.ok_record(engine, 512, 128, timings, cfg, 3e12, 2, turn_tokens=500)
        doc["cells"].append({"run": 0} | rec)
    records.add_torch_ratios(doc["cells"])
    seen: list[dict[str, Any]] = []
    real = plot._ttft_figure
    monkeypatch.setattr(
        plot, "_ttft_figure", lambda plt, d, cells: seen.extend(cells) or real(plt, d, cells)
    )
    assert len(plot.draw(doc, tmp_path)) == 4
    assert seen and not any(c.get("turn_tokens") for c in seen)
