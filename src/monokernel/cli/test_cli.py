"""`monokernel run` end to end on a tiny model, in-process and as a console script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from monokernel.cli.main import main
from monokernel.testing.tiny_models import make_tiny_model_dir


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir("llama3", tmp_path_factory.mktemp("cli") / "tiny")


def test_run_json(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "run",
            "--model",
            str(model),
            "--max-tokens",
            "7",
            "--json",
            "--chat",
            "--temperature",
            "0.8",
            "--seed",
            "1",
            "hello",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {
        "text",
        "token_ids",
        "finish_reason",
        "prompt_tokens",
        "ttft_ms",
        "decode_tok_s",
    }
    assert 1 <= len(out["token_ids"]) <= 7 and out["prompt_tokens"] > 3
    # A safetensors checkpoint of random bf16 weights, as loaded, on the CPU.
    assert out["weights"] in ("float32", "bfloat16")


def test_run_speculative_json(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--speculative ngram, and the torch engine's packed CPU step by default: the same
    tokens as --speculative off, and the drafts counted."""
    argv = ["run", "--model", str(model), "--max-tokens", "40", "--json", "--temperature", "0"]
    prompt = "the cat sat on the mat; the cat sat on the mat; the cat"
    assert main([*argv, "--speculative", "off", prompt]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "drafted_tokens" not in plain and plain["engine"] == "torch"
    for flags in (["--speculative", "ngram", "--ngram-min", "1"], ["--ngram-min", "1"]):
        assert main([*argv, *flags, prompt]) == 0
        fast = json.loads(capsys.readouterr().out)
        assert fast["token_ids"] == plain["token_ids"] and fast["text"] == plain["text"]
        assert fast["drafted_tokens"] >= fast["accepted_tokens"] >= 0 < fast["drafted_tokens"]


def test_run_streams_text_and_timings(model: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "monokernel.cli.main",
            "run",
            "--model",
            str(model),
            "--max-tokens",
            "5",
            "def reverse(s):",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "TTFT" in proc.stderr and "tok/s" in proc.stderr
    assert " weights] prompt: " in proc.stderr
    # The startup line: the context chosen and why (the CPU default, capped by the model).
    assert "context: " in proc.stderr and "tokens (the CPU default; model max" in proc.stderr


def test_missing_model_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    # Bad flag values exit 2 before loading (test_validate.py); a model that cannot be
    # opened is only known when loading it, and exits 1.
    assert main(["run", "--model", "/does/not/exist", "hi"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


@pytest.mark.parametrize("command", [[], ["run"], ["bench"], ["roofline"], ["agent-bench"]])
def test_help_texts_have_no_markup(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # Docstrings quote code in backticks; a terminal shows them raw, so --help must not.
    try:
        rc = main([*command, "--help"])
    except SystemExit as e:  # argparse exits after printing the help
        rc = int(e.code or 0)
    out = capsys.readouterr().out
    assert rc == 0 and "usage: monokernel" in out
    assert "`" not in out, out
