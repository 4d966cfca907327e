"""The build log (MONOKERNEL_BUILD_LOG) and prebuild's --from-log: what one run asked the
build for, built again elsewhere with the same flags."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from monokernel import envs
from monokernel.kernels import build as kbuild
from monokernel.kernels import prebuild
from monokernel.models.shapes import SHAPES


def _dims(shape: str, **changes: object) -> kbuild.KernelDims:
    return dataclasses.replace(kbuild.KernelDims.from_config(SHAPES[shape]), **changes)


def test_every_build_request_is_logged_and_read_back_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request is logged even when the cache holds its cubin (nothing compiles here), and
    the log reads back as the distinct requests in first-seen order."""
    monkeypatch.setattr(kbuild, "compile_cached", lambda target, command, what: target)
    log = tmp_path / "builds.jsonl"
    odd = _dims("odd")
    int4 = _dims("llama-3.2-1b", weight_format="int4", weight_group=128, positions=1)
    pass4 = _dims("smollm2-135m", positions=4, group_units=False)
    with envs.overridden(MONOKERNEL_BUILD_LOG=str(log)):
        kbuild.build(odd)
        kbuild.build(odd)
        with envs.overridden(MONOKERNEL_NVCC_FLAGS="-DMK_BATCH2=6"):
            kbuild.build(int4)
        kbuild.build(pass4, debug=True)
    assert len(log.read_text().splitlines()) == 4
    assert kbuild.read_build_log(log) == [
        (odd, "", False),
        (int4, "-DMK_BATCH2=6", False),
        (pass4, "", True),
    ]
    with envs.overridden(MONOKERNEL_BUILD_LOG=None):
        kbuild.build(odd)
    assert len(log.read_text().splitlines()) == 4


def test_a_line_that_is_not_a_request_is_named(tmp_path: Path) -> None:
    log = tmp_path / "builds.jsonl"
    log.write_text('{"dims": {"hidden": 1}, "flags": "", "debug": false}\n')
    with pytest.raises(ValueError, match=r"builds.jsonl:1: not a build request line"):
        kbuild.read_build_log(log)


def test_prebuild_from_log_builds_each_request_with_its_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only the logged requests (no shape named), each under the flags and debug switch it
    was logged with, none logged again."""
    log = tmp_path / "builds.jsonl"
    odd, wide = _dims("odd"), _dims("odd-wide", group_units=False)
    for dims, flags, debug in ((odd, "", False), (wide, "-DMK_D_PRE=1", True), (odd, "", False)):
        kbuild.log_build(log, dims, flags, debug)
    built: list[tuple[kbuild.KernelDims, str, bool | None, object]] = []

    def fake_build(dims: kbuild.KernelDims, debug: bool | None = None) -> Path:
        built.append((dims, envs.MONOKERNEL_NVCC_FLAGS, debug, envs.MONOKERNEL_BUILD_LOG))
        return tmp_path / "x.cubin"

    monkeypatch.setattr(prebuild, "build", fake_build)
    with envs.overridden(MONOKERNEL_BUILD_LOG=str(log)):
        assert prebuild.main(["--from-log", str(log), "--jobs", "1"]) == 0
    assert sorted(built, key=str) == sorted(
        [(odd, "", False, None), (wide, "-DMK_D_PRE=1", True, None)], key=str
    )
    assert "flags: '-DMK_D_PRE=1' (debug)" in capsys.readouterr().out


def test_prebuild_refuses_a_log_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        prebuild.main(["--from-log", str(tmp_path / "missing.jsonl")])
    assert "--from-log" in capsys.readouterr().err
