"""`monokernel run` refuses every bad flag before the model loads: exit 2, the flag's name as
typed, no traceback. The machine is faked (no GPU, or a given GPU count) so each case
means the same on a CPU runner and on a GPU node."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

import monokernel.runtime.engine as engine_module
from monokernel.cli.main import main, version


@pytest.fixture(autouse=True)
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    # A load here means validation came too late; fail at once rather than download.
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the flags were validated")

    monkeypatch.setattr(engine_module, "Engine", refuse)
    monkeypatch.setattr(engine_module, "load_checkpoint", refuse)


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Runs `monokernel run ARGV`, asserts an argparse-style refusal, returns stderr."""
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        main(["run", *argv])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err
    # argparse's form: the usage, then exactly one error line, last.
    lines = err.strip().splitlines()
    assert err.startswith("usage: monokernel run")
    assert lines[-1].startswith("monokernel run: error: ")
    assert sum("error" in line for line in lines) == 1
    assert elapsed < 5, f"took {elapsed:.1f} s to refuse"
    return err


# (flag as typed, argv, words the message must hold); on a machine with no GPU.
NO_GPU_CASES: list[tuple[str, list[str], str]] = [
    ("--device", ["--device", "tpu", "hi"], "must be auto, cpu, cuda or cuda:N; got 'tpu'"),
    ("--device", ["--device", "foo", "hi"], "got 'foo'"),
    ("--device", ["--device", "cpu:0", "hi"], "got 'cpu:0'"),
    ("--device", ["--device", "cuda:x", "hi"], "got 'cuda:x'"),
    ("--device", ["--device", "cuda", "hi"], "none is visible"),
    ("--device", ["--device", "cuda:0", "hi"], "none is visible"),
    ("--max-model-len", ["--max-model-len", "-5", "hi"], "must be a positive integer; got -5"),
    ("--max-model-len", ["--max-model-len", "0", "hi"], "must be a positive integer; got 0"),
    ("--max-model-len", ["--max-model-len", "1.5", "hi"], "must be an integer"),
    ("--tp", ["--tp", "0", "hi"], "must be a positive integer; got 0"),
    ("--tp", ["--tp", "-1", "hi"], "must be a positive integer; got -1"),
    ("--tp", ["--tp", "2", "hi"], "needs 2 CUDA GPUs; this machine has 0 CUDA GPUs"),
    ("--tp", ["--tp", "2", "--device", "cpu", "hi"], "not --device cpu"),
    ("prompt", [""], "must not be empty"),
    ("--max-tokens", ["--max-tokens", "0", "hi"], "must be a positive integer; got 0"),
    ("--max-tokens", ["--max-tokens", "ten", "hi"], "must be an integer; got 'ten'"),
    ("--max-tokens", ["--max-model-len", "64", "hi"], "leaves no room for the prompt"),
    ("--temperature", ["--temperature", "-1", "hi"], "must be >= 0"),
    ("--temperature", ["--temperature", "nan", "hi"], "must be a finite number"),
    ("--top-p", ["--top-p", "0", "hi"], "must be in (0, 1]; got 0"),
    ("--top-p", ["--top-p", "1.5", "hi"], "must be in (0, 1]; got 1.5"),
    ("--top-k", ["--top-k", "-2", "hi"], "must be an integer >= 0 (0 or -1 turn it off)"),
    ("--seed", ["--seed", "-1", "hi"], "must be an integer >= 0"),
    ("--stop", ["--stop", "", "hi"], "must not be empty"),
    ("--engine", ["--engine", "monokernel", "hi"], "needs an NVIDIA GPU"),
    ("--engine", ["--engine", "monokernel", "--device", "cpu", "hi"], "needs an NVIDIA GPU"),
    ("--engine", ["--engine", "tpu", "hi"], "invalid choice"),
    ("--speculative", ["--speculative", "eagle", "hi"], "invalid choice: 'eagle'"),
    (
        "--speculative",
        ["--speculative", "ngram", "--num-speculative-tokens", "40", "hi"],
        "in [1, 32]; got 40",
    ),
    (
        "--speculative",
        ["--speculative", "ngram", "--ngram-min", "5", "--ngram-max", "3", "hi"],
        "1 <= --ngram-min <= --ngram-max",
    ),
]


@pytest.mark.parametrize(("flag", "argv", "message"), NO_GPU_CASES)
def test_bad_flag_is_refused_before_loading(
    flag: str,
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _fake_gpus(monkeypatch, 0)
    err = _refused(argv, capsys)
    assert f"monokernel run: error: argument {flag}: " in err
    assert message in err


# Cases that need a GPU count; none of them may touch a real GPU.
GPU_CASES: list[tuple[int, str, list[str], str]] = [
    (1, "--device", ["--device", "cuda:3", "hi"], "out of range; this machine has 1 CUDA GPU "),
    (1, "--tp", ["--tp", "2", "hi"], "needs 2 CUDA GPUs; this machine has 1 CUDA GPU"),
    (4, "--tp", ["--tp", "2", "--device", "cuda:3", "hi"], "from cuda:3 on; this machine has 4"),
    (2, "--tp", ["--tp", "2", "--engine", "reference", "hi"], "needs engine 'monokernel'"),
]


@pytest.mark.parametrize(("gpus", "flag", "argv", "message"), GPU_CASES)
def test_flag_this_machine_cannot_run_is_refused(
    gpus: int,
    flag: str,
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _fake_gpus(monkeypatch, gpus)
    err = _refused(argv, capsys)
    assert f"monokernel run: error: argument {flag}: " in err
    assert message in err


def test_good_flags_reach_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    # The boundary values are accepted: validation must not be stricter than the engine.
    _fake_gpus(monkeypatch, 0)
    seen: list[object] = []

    def stop(model: object, config: object) -> None:
        seen.append(config)
        raise KeyboardInterrupt  # main() turns it into 130 before anything loads

    monkeypatch.setattr(engine_module, "Engine", stop)
    argv = ["--device", "cpu", "--top-p", "1", "--top-k", "-1", "--temperature", "0"]
    argv += ["--max-tokens", "1", "--max-model-len", "2", "--seed", "0", "--tp", "1", "hi"]
    assert main(["run", *argv]) == 130
    assert len(seen) == 1


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out == f"monokernel {version()}\n"
    assert version()[0].isdigit()


def test_console_refusal_has_no_traceback() -> None:
    # The real entry point, so nothing in-process (pytest's SystemExit catch) hides a trace.
    proc = subprocess.run(
        [sys.executable, "-m", "monokernel.cli.main", "run", "--device", "tpu", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "argument --device" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("engine", "tp", "message"),
    [
        ("monokernel", 1, "the monokernel verifies at most 7 drafted tokens a pass; got 8"),
        ("auto", 2, "not with --tp > 1"),
    ],
)
def test_speculative_is_refused_where_it_cannot_run(engine: str, tp: int, message: str) -> None:
    import argparse

    from monokernel.cli.validate import speculative_config

    args = argparse.Namespace(
        speculative="ngram",
        num_speculative_tokens=8,
        ngram_max=4,
        ngram_min=2,
        engine=engine,
        tp=tp,
    )
    config, error = speculative_config(args)
    assert config is None and error is not None and message in error
    assert error.startswith("argument --speculative: ")
    ok, none = speculative_config(argparse.Namespace(**{**vars(args), "engine": "auto", "tp": 1}))
    assert none is None and ok is not None and ok.num_tokens == 8
    four = argparse.Namespace(**{**vars(args), "engine": "monokernel", "tp": 1})
    four.num_speculative_tokens = 4
    ok, none = speculative_config(four)
    assert none is None and ok is not None and ok.num_tokens == 4


@pytest.mark.parametrize(
    ("engine", "given", "bounds"),
    [
        ("monokernel", (None, None), (6, 3)),  # its passes cost ~3 steps: long matches only
        ("torch", (None, None), (4, 2)),
        ("monokernel", (8, None), (8, 3)),  # a given bound is kept, the other defaults
        ("reference", (None, 1), (4, 1)),
        ("monokernel", (2, None), "got 3 and 2 (monokernel's defaults fill the one not given)"),
        ("torch", (None, 5), "got 5 and 4"),
    ],
)
def test_ngram_bounds_default_by_engine(
    engine: str, given: tuple[int | None, int | None], bounds: tuple[int, int] | str
) -> None:
    import argparse

    from monokernel.cli.validate import speculative_config

    args = argparse.Namespace(
        speculative="ngram",
        num_speculative_tokens=3,
        ngram_max=given[0],
        ngram_min=given[1],
        engine=engine,
        tp=1,
    )
    config, error = speculative_config(args)
    if isinstance(bounds, str):
        assert config is None and error is not None and bounds in error
    else:
        assert error is None and config is not None
        assert config.bounds(engine) == bounds


@pytest.mark.parametrize(
    ("flag", "engine", "tp", "expect"),
    [
        (None, "auto", 1, "default"),  # the backend says whether its passes pay by default
        (None, "monokernel", 1, "default"),
        (None, "torch", 1, "default"),
        (None, "reference", 1, "default"),
        (None, "monokernel", 2, None),  # no verify pass under TP: off, not refused
        ("off", "monokernel", 1, None),
        ("ngram", "torch", 1, "asked"),
    ],
)
def test_speculation_without_the_flag_is_the_engines_default(
    flag: str | None, engine: str, tp: int, expect: str | None
) -> None:
    import argparse

    from monokernel.cli.validate import speculative_config

    args = argparse.Namespace(
        speculative=flag,
        num_speculative_tokens=3,
        ngram_max=None,
        ngram_min=None,
        engine=engine,
        tp=tp,
    )
    config, error = speculative_config(args)
    assert error is None
    if expect is None:
        assert config is None
    else:
        assert config is not None and config.by_default == (expect == "default")


def test_run_takes_speculative_off_and_refuses_other_words() -> None:
    from monokernel.cli.main import _parse_run

    args = _parse_run(["--speculative", "off", "hi"])
    assert args.speculative_config is None
    with pytest.raises(SystemExit):
        _parse_run(["--speculative", "on", "hi"])
