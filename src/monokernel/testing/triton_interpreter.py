"""Run a Triton kernel's logic on the CPU: Triton's interpreter, in a fresh Python process
(TRITON_INTERPRET must be set before Triton is first imported, and the test process may have
imported it already). The tests of the prefill's Triton kernels use it to check indexing
and masks without a GPU; the interpreter has no bf16 rounding to nearest (it truncates), so
their checks are tolerances, and the GPU tests check the compiled kernels exactly."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_interpreted(code: str, timeout_s: float = 300) -> str:
    """The last line the Python source ``code`` prints, run in Triton's interpreter (skips
    the test where Triton is not installed; fails it with the stderr's tail if it raises)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


def interpreted(module: str, call: str, timeout_s: float = 300) -> str:
    """The last line ``print(module.call)`` writes in Triton's interpreter, ``torch`` in scope
    for the call's arguments (skips the test where Triton is not installed)."""
    return run_interpreted(f"import torch; import {module} as m; print(m.{call})", timeout_s)
