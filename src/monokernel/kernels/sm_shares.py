"""Each SM's share of the LM head, in proportion to how fast it streams.

When every SM streams at once, an H100's SMs do not get equal bandwidth: those of the smaller
GPCs stream ~13% faster, the same SMs every time (docs/perf-notes.md step 38). With equal
shares, a bandwidth-bound stage ends when the slow SMs do. ``measure`` times every SM with
``csrc/sm_speed.cu`` (one CTA per SM, all streaming together); ``share_table`` deals a
stage's rows by SM id in proportion to the measured rates, for ``Params::sm_share``. Only the
LM head takes it: dealing stage D's pairs the same way cost the kernel registers that it
spilled (step 38).

The same conventions as ``allreduce.py`` (build.py's nvcc, cache dir and arch flags; a
content hash as the cache key; a file lock and an atomic rename). ``MONOKERNEL_SM_SHARES=0``
turns the deal off (round robin over the grid, as before).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch

from monokernel.kernels.build import ARCH_FLAGS, CSRC, cache_dir, compile_cached, find_nvcc
from monokernel.kernels.launcher import KernelModule, set_current_context

SOURCE = CSRC / "sm_speed.cu"
THREADS = 512
CHUNK_BYTES = 16
# Enough shared memory that no two CTAs fit one SM (228 KB there), so a grid of one CTA per
# SM lands on every SM.
SMEM_BYTES = 120 * 1024


class SpeedParams(ctypes.Structure):
    """Mirror of ``struct SpeedParams`` in csrc/sm_speed.cu (same order and widths)."""

    _fields_ = [
        ("src", ctypes.c_uint64),
        ("ns", ctypes.c_uint64),
        ("smid", ctypes.c_uint64),
        ("barrier", ctypes.c_uint64),
        ("per_cta", ctypes.c_int64),
        ("iters", ctypes.c_int32),
        ("regions", ctypes.c_int32),
    ]


def enabled() -> bool:
    return os.environ.get("MONOKERNEL_SM_SHARES", "1") != "0"


def _flags() -> list[str]:
    return ["-O3", "-std=c++17", *ARCH_FLAGS, "-cubin"]


def cubin_path() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + "\n".join(_flags()).encode()).hexdigest()[:24]
    return cache_dir() / f"sm_speed-{key}.cubin"


def build() -> Path:
    return compile_cached(
        cubin_path(),
        lambda out: [find_nvcc(), *_flags(), "-o", str(out), str(SOURCE)],
        "the SM speed probe",
    )


def measure(
    device: torch.device, grid: int, per_cta_bytes: int = 256 * 1024, iters: int = 12
) -> dict[int, float]:
    """Median streaming time (µs) of each SM id over ``iters`` rounds in which all ``grid``
    CTAs (one per SM) read ``per_cta_bytes`` each at once. The first two rounds are dropped
    (clocks and TLBs warming). Empty if the CTAs did not land on ``grid`` distinct SMs."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    set_current_context(index)
    module = KernelModule(build(), "sm_speed", SMEM_BYTES, THREADS)
    regions = 3  # each region beyond L2 by the time it is read again
    per_cta = per_cta_bytes // CHUNK_BYTES
    src = torch.zeros(regions * grid * per_cta * 4, dtype=torch.int32, device=device)
    ns = torch.zeros(iters * grid, dtype=torch.int64, device=device)
    smid = torch.zeros(grid, dtype=torch.int32, device=device)
    barrier = torch.zeros(1, dtype=torch.int32, device=device)
    params = SpeedParams(
        src.data_ptr(), ns.data_ptr(), smid.data_ptr(), barrier.data_ptr(), per_cta, iters, regions
    )
    stream = torch.cuda.current_stream(device)
    try:
        module.launch(grid, params, stream.cuda_stream)  # type: ignore[arg-type]  # any Structure
        stream.synchronize()
    finally:
        module.unload()
    ids = smid.tolist()
    if len(set(ids)) != grid:
        return {}
    times = ns.view(iters, grid)[2:].double().div(1e3).tolist()
    return {ids[c]: statistics.median(row[c] for row in times) for c in range(grid)}


def deal(total: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """(first, count) for each weight: counts in proportion to the weights, summing to
    ``total`` (largest remainder), first items contiguous in order."""
    if total < 0 or not weights or any(not w > 0 for w in weights):
        raise ValueError(f"need total >= 0 and positive weights, got {total}, {list(weights)}")
    s = sum(weights)
    exact = [total * w / s for w in weights]
    counts = [int(e) for e in exact]
    by_rest = sorted(range(len(weights)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_rest[: total - sum(counts)]:
        counts[i] += 1
    out, first = [], 0
    for c in counts:
        out.append((first, c))
        first += c
    return out


def share_table(times_us: dict[int, float], totals: Sequence[int]) -> torch.Tensor:
    """int32 [len(totals) * n, 2]: block k holds (first, count) of stage k's ``totals[k]`` items
    for SM ids 0..n-1 (n = the highest id + 1; an id not measured gets nothing), each SM's
    count in proportion to its rate 1 / time."""
    if not times_us:
        raise ValueError("no SM was measured")
    n = max(times_us) + 1
    ids = sorted(times_us)
    table = torch.zeros(len(totals) * n, 2, dtype=torch.int32)
    rates = [1.0 / times_us[i] for i in ids]
    for k, total in enumerate(totals):
        for sm, (first, count) in zip(ids, deal(total, rates), strict=True):
            table[k * n + sm] = torch.tensor([first, count], dtype=torch.int32)
    return table
