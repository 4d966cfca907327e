"""Build and launch the in-kernel all-reduce microbenchmark (``csrc/allreduce_bench.cu``).

The same conventions as ``build.py`` (its nvcc lookup, cache dir and arch flags; a content
hash as the cache key; a file lock and an atomic rename), but a separate cubin: the
benchmark shares only ``common.cuh`` (its timer) with the decode kernel. One
``AllReduceKernel`` per device, loaded into that device's primary context (torch's) through
``launcher.KernelModule``.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from monokernel.kernels.build import CSRC, build_standalone
from monokernel.kernels.launcher import DeviceKernel

SOURCE = CSRC / "allreduce_bench.cu"
HEADERS = (CSRC / "common.cuh", CSRC / "tunables.cuh")  # what SOURCE includes: the cache key
MAX_RANKS = 8  # AR_MAX_RANKS
MAX_THREADS = 512  # AR_MAX_THREADS (the kernels' launch bound)
UNIT_FLOATS = 2  # floats per 16-byte wire unit {float, tag, float, tag}


class ArParams(ctypes.Structure):
    """Mirror of ``struct ArParams`` in csrc/allreduce_bench.cu (same order and widths)."""

    _fields_ = [
        ("peer_recv", ctypes.c_uint64 * MAX_RANKS),
        ("inp", ctypes.c_uint64),
        ("out", ctypes.c_uint64),
        ("timing", ctypes.c_uint64),
        ("error", ctypes.c_uint64),
        ("rank", ctypes.c_int32),
        ("nranks", ctypes.c_int32),
        ("n", ctypes.c_int32),
        ("iters", ctypes.c_int32),
        ("base_tag", ctypes.c_uint32),
        ("timeout_ms", ctypes.c_uint32),
    ]


def entry_name(nranks: int) -> str:
    return f"ar_bench_{nranks}"


def recv_buffer_bytes(nranks: int, n: int) -> int:
    """Receive buffer of one GPU: [2 parities][nranks sources][n/2 units] x 16 bytes."""
    return 2 * nranks * (n // UNIT_FLOATS) * 16


def build() -> Path:
    """The benchmark's cubin, compiled now unless the cache already holds it."""
    return build_standalone(SOURCE, HEADERS, "allreduce_bench", "the all-reduce benchmark")


def grid_for(n: int, threads: int, max_ctas: int) -> int:
    """One thread per wire unit (the most polls in flight), at most ``max_ctas`` CTAs."""
    units = n // UNIT_FLOATS
    return max(1, min(max_ctas, -(-units // threads)))


class AllReduceKernel(DeviceKernel):
    """The N-rank entry point loaded on one device; launched cooperatively, so a grid that
    cannot be resident at once is an error instead of a cross-GPU hang."""

    def __init__(self, cubin: Path, device: int, nranks: int, threads: int) -> None:
        if not 1 <= nranks <= MAX_RANKS:
            raise ValueError(f"nranks must be in [1, {MAX_RANKS}], got {nranks}")
        if not 32 <= threads <= MAX_THREADS or threads % 32:
            raise ValueError(f"threads must be a multiple of 32 in [32, {MAX_THREADS}]")
        super().__init__(cubin, device, entry_name(nranks), 0, threads)
