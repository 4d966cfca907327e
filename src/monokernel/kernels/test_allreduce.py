"""The all-reduce benchmark kernel compiles for sm_90a, and its ctypes mirror matches it.

CPU only (nvcc, no GPU); the runs on GPUs are in monokernel/parallel/test_allreduce_bench.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from monokernel.kernels import allreduce as ar
from monokernel.testing.cuda_structs import struct_mismatch

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
_C_NAMES = {"inp": "in"}  # ctypes field -> C field, where `in` is a Python keyword


@needs_nvcc
def test_builds_a_cubin_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONOKERNEL_CACHE", str(tmp_path))
    path = ar.build()
    assert path.parent == tmp_path / "kernels" and path.stat().st_size > 0
    assert path.read_bytes()[:4] == b"\x7fELF"
    assert ar.build() == path  # cached: same key, no rebuild
    assert not list(tmp_path.glob("*.tmp*"))


@needs_nvcc
def test_ctypes_params_match_the_cuda_struct(tmp_path: Path) -> None:
    limits = [
        f'static_assert(AR_MAX_RANKS == {ar.MAX_RANKS}, "ranks");',
        f'static_assert(AR_MAX_THREADS == {ar.MAX_THREADS}, "threads");',
    ]
    why = struct_mismatch(ar.ArParams, "ArParams", ar.SOURCE, tmp_path, _C_NAMES, limits)
    assert why is None, why


def test_grid_and_buffer_sizes() -> None:
    assert ar.grid_for(1024, 128, 132) == 4  # 4 KB: 512 units, one per thread
    assert ar.grid_for(8192, 128, 132) == 32
    assert ar.grid_for(2, 128, 132) == 1
    assert ar.grid_for(1 << 20, 128, 132) == 132
    assert ar.recv_buffer_bytes(2, 1024) == 2 * 2 * 512 * 16
    assert ar.entry_name(2) == "ar_bench_2"
