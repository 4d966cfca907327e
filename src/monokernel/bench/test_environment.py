"""The environment record: versions without a host name, clocks parsed from nvidia-smi."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch

from monokernel.bench.environment import environment, nvidia_smi

FAKE_SMI = """#!/bin/sh
echo "NVIDIA H100 80GB HBM3, 580.159.04, 1980, 1980, 2619, 2619, 700.00, P0"
"""


def test_cpu_environment_has_versions_and_no_host_name() -> None:
    import platform

    env = environment(torch.device("cpu"))
    assert env["device"] == "cpu" and env["gpu"] is None
    assert env["torch"] == torch.__version__ and env["transformers"]
    assert platform.node() not in json.dumps(env)


def test_nvidia_smi_fields(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exe = tmp_path / "nvidia-smi"
    exe.write_text(FAKE_SMI)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert nvidia_smi("0") == {
        "name": "NVIDIA H100 80GB HBM3",
        "driver": "580.159.04",
        "sm_clock_mhz": 1980.0,
        "max_sm_clock_mhz": 1980.0,
        "mem_clock_mhz": 2619.0,
        "max_mem_clock_mhz": 2619.0,
        "power_limit_w": 700.0,
        "pstate": "P0",
        "clock_source": "nvidia-smi",
    }


def test_no_nvidia_smi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert nvidia_smi("0") is None
