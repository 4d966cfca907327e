"""Filling the KV cache for a prompt: reuse what the live cache or a snapshot already holds
(``prefix_cache.PrefixCache`` decides), prefill the rest (``prefill.Prefiller``).

Device-agnostic: the monokernel backend runs it on the GPU, the tests on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from monokernel.runtime.prefill import Prefiller
from monokernel.runtime.prefix_cache import PrefixCache, ReusePlan, Snapshot


class CacheFiller:
    def __init__(
        self,
        prefill: Prefiller,
        prefix: PrefixCache,
        can_allocate: Callable[[int], bool] = lambda _nbytes: True,
    ) -> None:
        """``can_allocate(nbytes)``: whether a snapshot of that size leaves enough memory
        for prefill; a snapshot is an optimisation and must never starve a request."""
        self.prefill, self.prefix = prefill, prefix
        self.k, self.v = prefill.k, prefill.v
        self._can_allocate = can_allocate

    def fill(
        self,
        prompt_ids: Sequence[int],
        end: int,
        logits: bool = False,
        plan: ReusePlan | None = None,
    ) -> torch.Tensor | None:
        """Make cache positions [0, end) hold the K/V of ``prompt_ids[:end]`` (end <=
        len(prompt_ids)). With ``logits`` (and end == len(prompt_ids)) returns the last
        token's logits [V] float32; reuse always leaves that token to compute. ``plan``:
        ``self.prefix.plan(prompt_ids)`` when the caller made it already."""
        if plan is None:
            plan = self.prefix.plan(prompt_ids)
        self._apply(plan)
        self.prefix.begin(prompt_ids, plan.reuse)  # what the prefill overwrites is gone
        out = None
        if plan.reuse < end:
            # Near the cache's end a graph may start a little earlier, over held tokens.
            start = self.prefill.fitting_start(plan.reuse, end - plan.reuse)
            out = self.prefill.run(prompt_ids[start:end], start, logits=logits)
        self.prefix.written(prompt_ids[:end])
        return out

    def _apply(self, plan: ReusePlan) -> None:
        if plan.save:  # before anything overwrites the live cache
            self._snapshot(plan.save, plan.restore)
        if plan.restore is not None:
            k, v = plan.restore.payload
            a, b = plan.restore_from, plan.reuse  # [0, a) already holds the same tokens
            self.k[:, :, a:b].copy_(k[:, :, a:b])
            self.v[:, :, a:b].copy_(v[:, :, a:b])
            self.prefix.touch(plan.restore)

    def _snapshot(self, tokens: Sequence[int], keep: Snapshot | None) -> None:
        m = len(tokens)
        if not self._can_allocate(m * self.prefix.bytes_per_token):
            return
        try:
            payload = (self.k[:, :, :m].clone(), self.v[:, :, :m].clone())
        except torch.cuda.OutOfMemoryError:
            return
        self.prefix.add_snapshot(tokens, payload, keep=keep)
