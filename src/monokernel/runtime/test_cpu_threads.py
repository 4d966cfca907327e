"""The CPU thread governor (cpu_threads.py) on scripted /proc readings: fewer threads while
another process keeps cores busy, all of them back once it stops, never more than torch's
own count nor fewer than one; off by the environment switch."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from monokernel.runtime import cpu_threads
from monokernel.runtime.cpu_threads import ThreadGovernor


class Machine:
    """A machine whose clock and CPU tick counters the test moves by hand."""

    def __init__(self) -> None:
        self.now, self.busy, self.own = 100.0, 0, 0

    def run(self, seconds: float, own_cores: float, other_cores: float, hz: int) -> None:
        self.now += seconds
        self.own += round(own_cores * seconds * hz)
        self.busy += round((own_cores + other_cores) * seconds * hz)


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> Iterator[Machine]:
    m = Machine()
    monkeypatch.setattr(cpu_threads, "_machine_busy_ticks", lambda: m.busy)
    monkeypatch.setattr(cpu_threads, "_own_ticks", lambda: m.own)
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: m.now)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield m
    torch.set_num_threads(before)


def test_threads_follow_the_cores_others_leave(machine: Machine) -> None:
    gov = ThreadGovernor(window=8)
    hz = gov._hz
    assert gov.max_threads == 4
    machine.run(1.0, own_cores=0.0, other_cores=0.0, hz=hz)
    gov.request_started()
    assert gov.threads == 4 and torch.get_num_threads() == 4
    # Another process takes a core and a half: two are left (rounded).
    for _ in range(8):
        machine.run(0.05, own_cores=2.5, other_cores=1.5, hz=hz)
        gov.token()
    assert gov.threads == 2 and torch.get_num_threads() == 2
    # Everything busy elsewhere: one thread, never none.
    for _ in range(8):
        machine.run(0.05, own_cores=1.0, other_cores=3.9, hz=hz)
        gov.token()
    assert gov.threads == 1
    # Gone quiet: all four again, judged at the next request.
    machine.run(2.0, own_cores=0.0, other_cores=0.0, hz=hz)
    gov.request_started()
    assert gov.threads == 4 and torch.get_num_threads() == 4


def test_too_short_a_window_changes_nothing(machine: Machine) -> None:
    gov = ThreadGovernor(window=1)
    machine.run(0.001, own_cores=0.0, other_cores=4.0, hz=gov._hz)
    gov.token()
    assert gov.threads == 4


def test_the_switch_turns_it_off(machine: Machine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONOKERNEL_CPU_SHARE_CORES", "0")
    gov = ThreadGovernor(window=1)
    machine.run(1.0, own_cores=0.0, other_cores=4.0, hz=gov._hz)
    gov.token()
    assert gov.threads == 4 and torch.get_num_threads() == 4


def test_without_proc_it_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_threads, "_machine_busy_ticks", lambda: None)
    gov = ThreadGovernor(window=1)
    gov.request_started()
    gov.token()
    assert gov.threads == gov.max_threads
