"""`monokernel serve` refuses bad flags before it listens or loads: exit 2, the flag named."""

from __future__ import annotations

import pytest
import torch

from monokernel.serve import cli


def _assert_refused(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--port", "-1"], "--port"),
        (["--port", "70000"], "--port"),
        (["--tp", "0"], "--tp"),
        (["--tp", "-1"], "--tp"),
        (["--max-model-len", "0"], "--max-model-len"),
        (["--max-model-len", "-5"], "--max-model-len"),
        (["--max-queue", "-1"], "--max-queue"),
        (["--max-body-bytes", "0"], "--max-body-bytes"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
        (["--shutdown-timeout", "inf"], "--shutdown-timeout"),
        (["--allowed-origins", "example.com"], "--allowed-origins"),
        (["--allowed-origins", ","], "--allowed-origins"),
        (["--device", "tpu"], "--device"),
        (["--device", "foo"], "--device"),
    ],
)
def test_bad_flag_is_refused_at_parse_time(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _assert_refused(argv, flag, capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--device", "cuda"], "--device"),
        (["--tp", "2"], "--tp"),
        (["--engine", "monokernel"], "--engine"),
    ],
)
def test_what_this_machine_cannot_run_is_refused_before_listening(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _assert_refused(argv, flag, capsys)
