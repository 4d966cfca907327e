"""Repository-level checks: lint, and the README's commands staying what CI runs."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
def test_ruff_clean() -> None:
    proc = subprocess.run(
        ["ruff", "check", "src", "tests", "conftest.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    assert len(blocks) >= 2, "the quick start needs its two commands"
    test_command = blocks[1].strip()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1].strip() == test_command


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("source", sorted(p.name for p in (ROOT / "scripts").glob("*.cu")))
def test_script_cuda_sources_compile(source: str, tmp_path: Path) -> None:
    """The standalone CUDA programs in scripts/ (run by hand on a GPU machine) still build
    for sm_90a, so a probe that no longer compiles cannot land."""
    proc = subprocess.run(
        [
            "nvcc",
            "-O3",
            "-arch=sm_90a",
            "-c",
            str(ROOT / "scripts" / source),
            "-o",
            str(tmp_path / "probe.o"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
