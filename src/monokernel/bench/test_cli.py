"""``monokernel bench`` end to end on the CPU (reference and hf engines, a tiny checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from monokernel.bench.cli import main, parse_limits
from monokernel.bench.engines import check_engine_label
from monokernel.bench.measure import engine_tp, split_engine
from monokernel.bench.records import validate
from monokernel.bench.sweep import EngineLimits
from monokernel.testing.tiny_models import make_tiny_model_dir


def test_cpu_sweep_writes_json_table_and_figures(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    out, figs = tmp_path / "bench.json", tmp_path / "figs"
    argv = ["--model", str(tiny_dir), "--device", "cpu", "--engines", "reference,hf"]
    argv += ["--prompt-tokens", "8,16,4096", "--gen-tokens", "4", "--repeats", "2"]
    argv += ["--limit", "reference:gen-cap=0", "--hf-cache", "dynamic"]
    assert main([*argv, "--json", str(out), "--plot", str(figs)]) == 0
    doc = validate(json.loads(out.read_text()))
    assert doc["runs"][0]["args"]["prompt_tokens"] == [8, 16, 4096]
    assert {(c["engine"], c["prompt_tokens"]) for c in doc["cells"]} == {
        ("reference", 8), ("reference", 16), ("hf", 8), ("hf", 16),
    }  # fmt: skip
    # The repeats default limit of the reference engine (1) still holds; its gen cap is lifted.
    ref = [c for c in doc["cells"] if c["engine"] == "reference"]
    assert all(c["repeats"] == 1 and c["gen_tokens_run"] == 4 for c in ref)
    assert all(c["hf_cache"] == "dynamic" for c in doc["cells"] if c["engine"] == "hf")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("device: cpu") and lines[1].startswith("engine")
    assert sum(line.startswith(("reference", "hf")) for line in lines) == 4
    assert any("over the model's max context" in line for line in lines)  # 4096 > 256
    assert (figs / "decode_vs_prompt.png").exists()


def test_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device", "cpu", "--engines", "monokernel"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err
    assert main(["--device", "cpu", "--engines", "nope"]) == 2
    assert "unknown engine 'nope'" in capsys.readouterr().err
    assert main(["--device", "cpu", "--engines", "endpoint"]) == 2
    assert "--endpoint URL" in capsys.readouterr().err
    assert main(["--device", "cpu", "--engines", "reference", "--limit", "ref:x=1"]) == 2
    assert "ENGINE:KEY=N" in capsys.readouterr().err
    for label, why in (
        ("torch@tp2", "only the monokernel runs over several GPUs"),
        ("monokernel@tp1", "tpN with N >= 2"),
        ("monokernel:fp8@2", "tpN with N >= 2"),
    ):
        assert main(["--device", "cpu", "--engines", label]) == 2
        assert why in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--prompt-tokens", "12,abc"])


def test_engine_labels_name_the_format_and_the_gpus() -> None:
    assert split_engine("monokernel:fp8@tp2") == ("monokernel", "fp8")
    assert split_engine("monokernel@tp4") == ("monokernel", None)
    assert (engine_tp("monokernel:fp8@tp2"), engine_tp("monokernel@tp4")) == (2, 4)
    assert engine_tp("monokernel:int8") == 1
    assert check_engine_label("monokernel:int8@tp2") is None
    assert check_engine_label("monokernel:fp8-block@tp2") is None
    assert "fp8-block, int8-g16" in str(check_engine_label("monokernel:fp8-blocks"))
    assert check_engine_label("monokernel:int8-g16") is None


def test_fp8_block_engines_run_a_block_checkpoint_of_the_weights(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """``reference:fp8-block``: the weights as a 128 x 128 block FP8 checkpoint holds them,
    counted at fp8's bytes and a scale a row and block."""
    from monokernel.bench.measure import bytes_per_token
    from monokernel.models.shapes import SHAPES

    cfg = SHAPES["llama-3.1-8b"]
    fp8, blocks = bytes_per_token(cfg, 0, fmt="fp8"), bytes_per_token(cfg, 0, fmt="fp8-block")
    shapes = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # QKV, O, gate/up, down
    per_layer = sum(4 * r * c // 128 - 4 * r for r, c in shapes)  # block scales, not row ones
    assert blocks - fp8 == cfg.num_layers * per_layer
    out = tmp_path / "bench.json"
    argv = ["--model", str(tiny_dir), "--device", "cpu", "--engines", "reference:fp8-block"]
    argv += ["--prompt-tokens", "8", "--gen-tokens", "4", "--repeats", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    (cell,) = validate(json.loads(out.read_text()))["cells"]
    assert cell["engine"] == "reference:fp8-block" and cell["gen_tokens_run"] == 4


def test_limits_parse_over_the_defaults() -> None:
    limits = parse_limits(["hf:max-gen=512", "reference:max-prompt=2048", "reference:gen-cap=0"])
    assert limits["hf"] == EngineLimits(max_gen=512)
    assert limits["reference"] == EngineLimits(max_prompt=2048, gen_cap=None, repeats=1)
    assert parse_limits([])["reference"] == EngineLimits(gen_cap=64, repeats=1)


def test_turn_tokens_must_not_be_negative(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("-1", "x"):
        with pytest.raises(SystemExit) as exit_info:
            main(["--device", "cpu", "--engines", "reference", "--turn-tokens", bad])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"argument --turn-tokens: expected an integer >= 0, got '{bad}'" in err


def test_turn_cell_end_to_end(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "turn.json"
    argv = ["--model", str(tiny_dir), "--device", "cpu", "--engines", "reference"]
    argv += ["--prompt-tokens", "8", "--gen-tokens", "4", "--turn-tokens", "6"]
    assert main([*argv, "--json", str(out)]) == 0
    doc = validate(json.loads(out.read_text()))
    (cell,) = doc["cells"]
    assert doc["runs"][0]["args"]["turn_tokens"] == 6
    assert (cell["prompt_tokens"], cell["turn_tokens"], cell["request_prompt_tokens"]) == (8, 6, 14)
    # The reference engine has no prefix cache, so the record claims no reuse.
    assert all("reused_tokens" not in r for r in cell["runs_raw"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["reference", "8+6", "4"] in [r[:3] for r in rows]


def test_grammar_engine_times_constrained_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("llguidance")
    model = make_tiny_model_dir("llama3", tmp_path / "tiny")  # with its tokenizer
    out = tmp_path / "bench.json"
    argv = ["--model", str(model), "--device", "cpu", "--prompt-tokens", "8"]
    argv += ["--gen-tokens", "6", "--repeats", "1", "--limit", "reference:gen-cap=0"]
    assert main([*argv, "--engines", "reference+grammar"]) == 2
    assert "needs --grammar REGEX" in capsys.readouterr().err
    assert main([*argv, "--engines", "reference+grammar", "--grammar", "[a-"]) == 2
    assert "--grammar" in capsys.readouterr().err
    argv += ["--engines", "reference,reference+grammar", "--grammar", "[a-z]{40}"]
    assert main([*argv, "--json", str(out)]) == 0
    cells = {c["engine"]: c for c in validate(json.loads(out.read_text()))["cells"]}
    assert set(cells) == {"reference", "reference+grammar"}
    assert all(c["gen_tokens_run"] == 6 for c in cells.values())
