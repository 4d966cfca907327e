"""Build and launch the tensor-parallel prefill's all-reduce (``csrc/prefill_allreduce.cu``).

A standalone cubin with ``allreduce.py``'s build conventions (content-hashed in the cache, a
lock, an atomic rename), loaded into each rank's primary context (torch's). Its launches are
plain, not cooperative, so a CUDA graph can capture them; the grid is at most one CTA an SM,
and nothing else runs on a rank's stream beside it, so every CTA is resident at once (a CTA
that spins for its peer never waits for a CTA of its own grid).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from monokernel.kernels.build import CSRC, build_standalone
from monokernel.kernels.launcher import DeviceKernel

SOURCE = CSRC / "prefill_allreduce.cu"
HEADERS = (CSRC / "common.cuh",)  # what SOURCE includes: the cache key
ENTRY = "prefill_allreduce"
MAX_RANKS = 8  # PAR_MAX_RANKS
MAX_CTAS = 256  # PAR_MAX_CTAS
THREADS = 256  # PAR_THREADS
# A rank's signal words: [MAX_CTAS][MAX_RANKS] arrivals its peers store into, then its own
# [MAX_CTAS] exchange counts.
SIGNAL_WORDS = MAX_CTAS * MAX_RANKS + MAX_CTAS
SIGNAL_BYTES = 4 * SIGNAL_WORDS
COUNTS_OFFSET = 4 * MAX_CTAS * MAX_RANKS  # bytes: where the counts start
# A peer that has not signalled after this long is lost (a failed launch on its side): the
# kernel traps instead of spinning forever.
TIMEOUT_MS = 20_000


class PrefillArParams(ctypes.Structure):
    """Mirror of ``struct PrefillArParams`` in csrc/prefill_allreduce.cu."""

    _fields_ = [
        ("parts", ctypes.c_uint64 * MAX_RANKS),
        ("arrivals", ctypes.c_uint64 * MAX_RANKS),
        ("count", ctypes.c_uint64),
        ("x", ctypes.c_uint64),
        ("bias", ctypes.c_uint64),
        ("rank", ctypes.c_int32),
        ("nranks", ctypes.c_int32),
        ("rows", ctypes.c_int32),
        ("hidden", ctypes.c_int32),
        ("timeout_ms", ctypes.c_uint32),
    ]


def build() -> Path:
    """The kernel's cubin, compiled now unless the cache already holds it."""
    return build_standalone(SOURCE, HEADERS, "prefill_allreduce", "the prefill all-reduce")


def grid_for(rows: int, hidden: int, sms: int) -> int:
    """One CTA an SM at most, fewer where there are fewer float4s than threads; every rank of
    an exchange must use the same grid (its CTAs pair up by index)."""
    units = -(-rows * hidden // 4)
    return max(1, min(sms, MAX_CTAS, -(-units // THREADS)))


class PrefillAllReduce(DeviceKernel):
    """The entry point loaded on one device."""

    def __init__(self, device: int, cubin: Path | None = None) -> None:
        super().__init__(cubin or build(), device, ENTRY, 0, THREADS)
