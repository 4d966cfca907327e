"""The prefill all-reduce kernel compiles for sm_90a, and its ctypes mirror matches it.

CPU only (nvcc, no GPU); its runs on GPUs are in monokernel/runtime/test_prefill_exchange.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from monokernel.kernels import prefill_allreduce as par
from monokernel.testing.cuda_structs import struct_mismatch

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


@needs_nvcc
def test_builds_a_cubin_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONOKERNEL_CACHE", str(tmp_path))
    path = par.build()
    assert path.parent == tmp_path / "kernels" and path.read_bytes()[:4] == b"\x7fELF"
    assert par.build() == path  # cached: same key, no rebuild


@needs_nvcc
def test_ctypes_params_match_the_cuda_struct(tmp_path: Path) -> None:
    limits = [
        f'static_assert(PAR_MAX_RANKS == {par.MAX_RANKS}, "ranks");',
        f'static_assert(PAR_MAX_CTAS == {par.MAX_CTAS}, "ctas");',
        f'static_assert(PAR_THREADS == {par.THREADS}, "threads");',
    ]
    mirror = par.PrefillArParams
    why = struct_mismatch(mirror, "PrefillArParams", par.SOURCE, tmp_path, None, limits)
    assert why is None, why


def test_grid() -> None:
    assert par.grid_for(16, 1536, 132) == 24  # 6,144 float4s, 256 a CTA
    assert par.grid_for(2048, 5120, 132) == 132  # one CTA an SM at most
    assert par.grid_for(1, 3, 132) == 1
    assert par.grid_for(2048, 5120, 300) == par.MAX_CTAS  # the signal slots' limit
