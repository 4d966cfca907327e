"""Debug and profiling runs of the kernel: teacher-forced logits, the timing buffer of one
step, and that buffer read as a per-stage profile."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from monokernel.errors import InvalidRequestError
from monokernel.kernels import layout
from monokernel.runtime.backends.monokernel.kernel import Probe
from monokernel.runtime.backends.monokernel.request import RequestDriver, ids_in_vocab
from monokernel.runtime.sampling import SamplingParams


def stage_profile(t: Sequence[int], num_layers: int) -> dict[str, float]:
    """µs per stage kind summed over layers, from one step's timing marks ``t``
    (kernels/layout.py: CTA 0's clock where each stage's work and its wait end, and the
    global time at the step's start and end, which converts cycles to time): ``clock_GHz``,
    ``<stage>.work`` and ``<stage>.wait`` for stages A-E per layer, F the LM head, S
    sampling and the token hand-off, and ``total``."""

    def at(name: str, layer: int = 0) -> int:
        return t[layout.mark_slot(name, layer, num_layers)]

    start, end = at("step.start"), at("sample.work")
    ns_per_cycle = (at("step.end_ns") - at("step.start_ns")) / max(end - start, 1)
    out: dict[str, float] = {"clock_GHz": 1.0 / ns_per_cycle if ns_per_cycle else 0.0}

    def add(key: str, cycles: int) -> None:
        out[key] = out.get(key, 0.0) + cycles * ns_per_cycle / 1e3

    done = start  # where the previous stage's wait ended
    for layer in range(num_layers):
        for stage, letter in layout.LAYER_STAGES:
            work, wait = at(f"{stage}.work", layer), at(f"{stage}.wait", layer)
            add(f"{letter}.work", work - done)
            add(f"{letter}.wait", wait - work)
            done = wait
    work, wait = at("lm_head.work"), at("lm_head.wait")
    add("F.work", work - done)
    add("F.wait", wait - work)
    add("S.work", end - wait)
    out["total"] = (end - start) * ns_per_cycle / 1e3
    return out


class Probes:
    """The debug paths of a backend whose requests ``driver`` runs."""

    def __init__(self, driver: RequestDriver) -> None:
        self.driver = driver
        self.device, self.vocab_size = driver.device, driver.vocab_size
        self.num_layers = driver.kernel.cfg.num_layers

    def teacher_forced_logits(
        self, prompt_ids: Sequence[int], next_ids: Sequence[int]
    ) -> torch.Tensor:
        """Logits [len(next_ids), V] float32, where step s feeds the kernel the given token
        (the last prompt token, then next_ids[s-1]) instead of its own sample."""
        steps = len(next_ids)
        if not ids_in_vocab(next_ids, self.vocab_size):
            raise InvalidRequestError("a forced token id is outside the vocabulary")
        forced_list = [prompt_ids[-1], *next_ids[:-1]]
        forced = torch.tensor(forced_list, dtype=torch.int32, device=self.device)  # [steps]
        logits = torch.full(
            (steps, self.vocab_size), float("nan"), dtype=torch.float32, device=self.device
        )  # [steps, V]
        greedy = SamplingParams(temperature=0.0, max_tokens=max(steps, 1))
        probe = Probe(forced=forced, debug_logits=logits)
        run = self.driver.run(prompt_ids, steps, greedy, (), None, probe, forced_ids=forced_list)
        produced = sum(1 for _ in run)
        if produced != steps:
            raise RuntimeError(f"the kernel ran {produced} of {steps} forced steps")
        torch.cuda.synchronize(self.device)
        return logits

    def timed_run(
        self, prompt_ids: Sequence[int], n_steps: int, step: int, skew: bool = False
    ) -> list[int]:
        """A greedy run of ``n_steps`` whose step ``step`` fills the kernel's timing buffer
        (kernels/layout.py: CTA 0's marks, then with ``skew`` the stage-skew points of every
        CTA, which a -DMK_SKEW=1 build records: tools/stage_skew.py). Returns the raw
        slots."""
        size = layout.timing_words(self.num_layers, self.driver.kernel.grid, skew)
        timing = torch.zeros(size, dtype=torch.int64, device=self.device)
        greedy = SamplingParams(temperature=0.0, max_tokens=n_steps)
        probe = Probe(timing=timing, timing_step=step)
        for _ in self.driver.run(prompt_ids, n_steps, greedy, (), None, probe):
            pass
        torch.cuda.synchronize(self.device)
        return timing.tolist()

    def profile_step(self, prompt_ids: Sequence[int], n_steps: int, step: int) -> dict[str, float]:
        """Time the stages of one decode step (greedy run of ``n_steps``), as CTA 0 sees them
        (stage_profile)."""
        return stage_profile(self.timed_run(prompt_ids, n_steps, step), self.num_layers)
