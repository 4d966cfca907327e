"""Time loading a safetensors checkpoint onto a device, as the engine loads it.

    python -m monokernel.weights.load_time DIR [--device cuda] [--dtype auto] [--repeat 2]
        [--cold] [--progress] [--no-plain-read]

A load's speed depends mostly on whether the shards are in the page cache. A checkpoint
that was just written (``weights/random_checkpoint.py``) or read is, usually whole: the
first read is then as fast as the second. So each read reports how much of the checkpoint
was resident before it, ``--cold`` first evicts the shards (``posix_fadvise``
DONTNEED, which needs no root but is a no-op on some filesystems, e.g. tmpfs), and a plain
read of the files at the end gives the ceiling the loader can approach on this machine.
Peak host memory is reported too: loading to a GPU must not hold the model on the host.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import mmap
import os
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from monokernel.models.config import load_hf_config
from monokernel.weights.progress import format_bytes, format_seconds
from monokernel.weights.safetensors_loader import (
    STAGE_BYTES,
    load_safetensors_weights,
    read_header,
    safetensors_files,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resident_fraction(files: Sequence[Path]) -> float | None:
    """The share of the files' pages in the page cache (mincore); None where it cannot be
    asked."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    libc = ctypes.CDLL(libc_name, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    resident = total = 0
    for path in files:
        size = path.stat().st_size
        if size == 0:
            continue
        pages = -(-size // page)
        vec = (ctypes.c_ubyte * pages)()
        with open(path, "rb") as fh:
            # A read-only shared mapping through libc: Python's mmap object hides its
            # address, and mapping only reserves addresses, it reads nothing.
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fh.fileno(), 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            rc = libc.mincore(addr, size, vec)
        finally:
            libc.munmap(addr, size)
        if rc != 0:
            return None
        # Only bit 0 of each byte is defined (the others are reserved and zero).
        resident += pages - bytes(vec).count(0)
        total += pages
    return resident / total if total else None


def evict(files: Sequence[Path]) -> None:
    """Ask the kernel to drop the files from the page cache; dirty pages (a checkpoint
    written moments ago) are flushed first, since only clean ones can be dropped."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_read(files: Sequence[Path]) -> tuple[int, float]:
    """(bytes, seconds) reading the files front to back, in the loader's chunk size."""
    buf = bytearray(STAGE_BYTES)
    view = memoryview(buf)
    nbytes = 0
    start = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as fh:
            while n := fh.readinto(view):
                nbytes += n
    return nbytes, time.perf_counter() - start


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * mmap.PAGESIZE


def _peak_rss_bytes() -> int:
    # ru_maxrss is in kilobytes on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _resident(files: Sequence[Path]) -> str:
    frac = resident_fraction(files)
    return "unknown" if frac is None else f"{frac:.0%}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m monokernel.weights.load_time",
        description="Time loading an HF safetensors checkpoint straight onto a device.",
    )
    p.add_argument("model_dir", type=Path, help="HF directory: config.json + *.safetensors")
    p.add_argument("--device", default="auto", help="auto (cuda if there is one) | cpu | cuda:N")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "checkpoint", *_DTYPES],
        help="auto: bfloat16 on a GPU, float32 on the CPU, as the engine picks",
    )
    p.add_argument("--repeat", type=int, default=2, help="reads to time (default 2)")
    p.add_argument("--cold", action="store_true", help="evict the shards before the first read")
    p.add_argument("--progress", action="store_true", help="draw the bar even when not a TTY")
    p.add_argument(
        "--no-plain-read", action="store_true", help="skip the plain file read at the end"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.repeat < 1:
        _parser().error("--repeat must be at least 1")
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if args.dtype == "auto":
        dtype: torch.dtype | None = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = _DTYPES.get(args.dtype)  # "checkpoint": None, keep the stored dtype
    cfg = load_hf_config(args.model_dir)
    files = safetensors_files(args.model_dir)
    size = sum(f.stat().st_size for f in files)
    # Rates count the checkpoint's bytes, what crosses the disk and the bus, whatever the
    # cast makes of them on the device.
    nbytes = sum(e.nbytes for f in files for e in read_header(f))
    if device.type == "cuda":
        torch.zeros(1, device=device)  # the CUDA context's start is not part of a load
    print(
        f"checkpoint: {args.model_dir} ({cfg.family}, {cfg.num_layers} layers, "
        f"{len(files)} file{'' if len(files) == 1 else 's'}, {format_bytes(size)}) -> "
        f"{device} {str(dtype).removeprefix('torch.') if dtype else 'checkpoint dtype'}",
        flush=True,
    )
    if args.cold:
        evict(files)
    rss_before = _rss_bytes()
    for k in range(args.repeat):
        note = "after eviction, " if args.cold and k == 0 else ""
        cached = f"{note}page cache held {_resident(files)} of it"
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        weights = load_safetensors_weights(
            args.model_dir,
            cfg,
            device=device,
            dtype=dtype,
            progress=args.progress,
            force_progress=args.progress,
        )
        seconds = time.perf_counter() - start  # the loader synchronises the GPU itself
        gpu = ""
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            gpu = f", GPU peak {format_bytes(peak)}"
        print(
            f"read {k + 1}: {format_bytes(nbytes)} in {format_seconds(seconds)} "
            f"({nbytes / seconds / 1e9:.2f} GB/s; {cached}){gpu}",
            flush=True,
        )
        del weights
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(
        f"host memory: RSS {format_bytes(rss_before)} before loading, peak "
        f"{format_bytes(_peak_rss_bytes())} (mapped pages and the CUDA context included)"
    )
    if not args.no_plain_read:
        cached = _resident(files)
        read, seconds = plain_read(files)
        print(
            f"plain read of the files (the ceiling; page cache held {cached} of them): "
            f"{format_bytes(read)} in {format_seconds(seconds)} "
            f"({read / seconds / 1e9:.2f} GB/s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
