"""How many threads a CPU decode should use: the cores no other process is busy on.

A decode step on the CPU is a few hundred small parallel regions, each as slow as its
slowest thread. When another process keeps a core busy, one of our threads waits for its
turn on that core at every region's end, and the whole step runs at the speed of a thread
that gets a fraction of a core (2 cores, 2 threads and one busy process: ~42 down to ~12
tokens/s, while 1 thread keeps ~28; docs/benchmarks.md, "The CPU engine"). So the threads
follow the load: every ``window`` tokens the governor reads how much CPU time the machine
spent outside this process since its last look (Linux ``/proc/stat`` and
``/proc/self/stat``, tens of microseconds) and sets ``torch.set_num_threads`` to the cores
left, between 1 and the count torch started with. Where ``/proc`` is not there, it does nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from monokernel import envs

_PROC_STAT = Path("/proc/stat")
_SELF_STAT = Path("/proc/self/stat")


def _machine_busy_ticks() -> int | None:
    """Clock ticks every core spent running something since boot (user, nice, system, irq,
    softirq), or None without /proc. Not steal: time a hypervisor gave other machines slows
    every thread alike, and fewer threads would not win it back."""
    try:
        with _PROC_STAT.open() as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:8]] + [0] * 7  # older kernels have fewer fields
    user, nice, system, _idle, _iowait, irq, softirq = values[:7]
    return user + nice + system + irq + softirq


def _own_ticks() -> int | None:
    """Clock ticks this process (all its threads) has run, or None without /proc."""
    try:
        text = _SELF_STAT.read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


class ThreadGovernor:
    """Sets torch's thread count from the load other processes put on the machine."""

    def __init__(self, window: int = 32) -> None:
        """``window``: tokens between two looks at the load."""
        self.window = window
        self.max_threads = torch.get_num_threads()
        self.threads = self.max_threads
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._enabled = self.max_threads > 1 and _machine_busy_ticks() is not None
        self._last = self._sample()
        self._tokens = 0

    def _sample(self) -> tuple[float, int, int] | None:
        busy, own = _machine_busy_ticks(), _own_ticks()
        if busy is None or own is None:
            return None
        return time.monotonic(), busy, own

    def others_cores(self) -> float | None:
        """Cores other processes kept busy since the last look (and take a new one)."""
        now = self._sample()
        last, self._last = self._last, now
        if now is None or last is None or now[0] - last[0] < 0.02:
            return None  # too short a window to say
        others = (now[1] - last[1]) - (now[2] - last[2])
        return max(0.0, others / self._hz / (now[0] - last[0]))

    def request_started(self) -> None:
        """Judge the load since the last request (the gap between requests shows what
        else runs) before this one's prefill."""
        self._tokens = 0
        self._judge()

    def token(self) -> None:
        """One token decoded: every ``window`` tokens, judge the load again."""
        self._tokens += 1
        if self._tokens % self.window == 0:
            self._judge()

    def _judge(self) -> None:
        if not self._enabled or not envs.MONOKERNEL_CPU_SHARE_CORES:
            return
        others = self.others_cores()
        if others is None:
            return
        threads = max(1, min(self.max_threads, self.max_threads - round(others)))
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
