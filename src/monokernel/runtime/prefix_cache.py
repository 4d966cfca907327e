"""Prefix reuse bookkeeping: which token ids the live KV cache holds, plus a small LRU of
snapshots (device copies of a cache prefix) under a byte budget.

Pure Python on purpose: it decides, the backend does the device copies. The K/V at position
p depends only on tokens 0..p, so any cache (live or snapshot) whose tokens agree with a new
prompt on its first m positions can stand in for prefilling those m positions.

The live cache's contents after a decode run: what the prefill wrote (the prompt, or the
prompt minus its last token when the kernel's first step computes that position), then one
position per completed kernel step, holding the token that step was fed (the first token
drawn from the prefill's logits or the last prompt token, then each generated token but the
last; a step's own output is never written).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    # Compared a block at a time in C (tuple slices), then element-wise inside the first
    # block that differs: a 30k-token conversation costs microseconds, not milliseconds.
    ta, tb = tuple(a), tuple(b)
    n = min(len(ta), len(tb))
    i, block = 0, 1024
    while i + block <= n and ta[i : i + block] == tb[i : i + block]:
        i += block
    while i < n and ta[i] == tb[i]:
        i += 1
    return i


def fed_tokens(
    prompt: Sequence[int],
    generated: Sequence[int],
    steps: int,
    forced: Sequence[int] | None = None,
) -> list[int]:
    """The tokens the kernel's first ``steps`` steps were fed, i.e. whose K/V it wrote at
    positions len(prompt)-1 onwards: ``forced`` when teacher-forced, else the last token of
    ``prompt`` (the kernel's first input) followed by the generated tokens but the last."""
    if steps <= 0:
        return []
    if forced is not None:
        return list(forced[:steps])
    return [prompt[-1], *generated[: steps - 1]]


@dataclass(eq=False, slots=True)
class Snapshot:
    tokens: tuple[int, ...]  # the token ids of positions [0, len) of the copy
    nbytes: int
    payload: Any  # the backend's device copy; dropped (freed) on eviction


@dataclass(frozen=True, slots=True)
class ReusePlan:
    """What to do before prefilling a prompt. In order: snapshot ``save`` (the live cache's
    first len(save) positions) if non-empty, copy positions [restore_from, reuse) from
    ``restore`` if set, then prefill from position ``reuse``."""

    reuse: int
    restore: Snapshot | None = None
    restore_from: int = 0
    save: tuple[int, ...] = ()


class PrefixCache:
    """Tracks the live cache's token ids and holds snapshots, most recently used first."""

    def __init__(
        self,
        bytes_per_token: int,
        budget_bytes: int = 0,
        enabled: bool = True,
        min_snapshot_tokens: int = 128,
    ) -> None:
        if bytes_per_token <= 0:
            raise ValueError("bytes_per_token must be positive")
        self.bytes_per_token = bytes_per_token
        self.budget_bytes = max(0, budget_bytes)
        self.enabled = enabled
        # Keeping fewer tokens than this is not worth a copy (nor an LRU slot): prefilling
        # them again costs about as much as the bookkeeping saves.
        self.min_snapshot_tokens = max(1, min_snapshot_tokens)
        self._live: tuple[int, ...] = ()
        self._snaps: list[Snapshot] = []

    # ---- state ----------------------------------------------------------------------

    @property
    def live(self) -> tuple[int, ...]:
        """Token ids whose K/V the live cache holds at positions [0, len)."""
        return self._live

    @property
    def snapshots(self) -> tuple[Snapshot, ...]:
        """Most recently used first."""
        return tuple(self._snaps)

    @property
    def used_bytes(self) -> int:
        return sum(s.nbytes for s in self._snaps)

    # ---- planning -------------------------------------------------------------------

    def plan(self, prompt: Sequence[int]) -> ReusePlan:
        """How much of ``prompt`` can be reused. At least one token is always left to
        compute (the kernel starts from the last prompt token; prefill logits need one)."""
        limit = len(prompt) - 1
        if not self.enabled or limit <= 0:
            return ReusePlan(0)
        live_m = min(common_prefix(self._live, prompt), limit)
        best, best_m = None, live_m
        for snap in self._snaps:
            m = min(common_prefix(snap.tokens, prompt), limit)
            if m > best_m:
                best, best_m = snap, m
        return ReusePlan(best_m, best, live_m if best else 0, self._save_before(live_m, best))

    def _save_before(self, kept: int, keep: Snapshot | None) -> tuple[int, ...]:
        """The live tokens worth a snapshot, given that only positions [0, ``kept``) of the
        live cache survive the request (a restore overwrites what follows too)."""
        if self.budget_bytes == 0:
            return ()
        room = self.budget_bytes - (keep.nbytes if keep else 0)
        save = self._live[: max(0, room) // self.bytes_per_token]
        if len(save) - kept < self.min_snapshot_tokens or self._covered(save):
            return ()
        return save

    def _covered(self, tokens: tuple[int, ...]) -> bool:
        n = len(tokens)
        return any(len(s.tokens) >= n and s.tokens[:n] == tokens for s in self._snaps)

    # ---- snapshots ------------------------------------------------------------------

    def add_snapshot(
        self, tokens: Sequence[int], payload: Any, keep: Snapshot | None = None
    ) -> Snapshot | None:
        """Hold ``payload`` (a copy of positions [0, len(tokens))) as the most recent
        snapshot, evicting least recently used ones (never ``keep``) to stay in budget.
        Snapshots the new one extends are dropped. None when it cannot fit."""
        snap = Snapshot(tuple(tokens), len(tokens) * self.bytes_per_token, payload)
        kept = keep.nbytes if keep is not None and keep in self._snaps else 0
        if not snap.tokens or snap.nbytes + kept > self.budget_bytes:
            return None
        n = len(snap.tokens)
        self._snaps = [
            s
            for s in self._snaps
            if s is keep or not (len(s.tokens) <= n and snap.tokens[: len(s.tokens)] == s.tokens)
        ]
        while self.used_bytes + snap.nbytes > self.budget_bytes:
            victim = next(s for s in reversed(self._snaps) if s is not keep)
            self._snaps.remove(victim)
        self._snaps.insert(0, snap)
        return snap

    def touch(self, snap: Snapshot) -> None:
        """Mark ``snap`` most recently used."""
        if snap in self._snaps:
            self._snaps.remove(snap)
            self._snaps.insert(0, snap)

    def clear(self) -> None:
        """Drop every snapshot and forget the live contents."""
        self._snaps.clear()
        self._live = ()

    # ---- the live cache -------------------------------------------------------------

    def begin(self, prompt: Sequence[int], reuse: int) -> None:
        """A request will overwrite positions >= ``reuse``; only [0, reuse) stays valid."""
        self._live = tuple(prompt[: max(0, reuse)])

    def written(self, tokens: Sequence[int]) -> None:
        """Positions [0, len(tokens)) now hold ``tokens`` (after a prefill)."""
        self._live = tuple(tokens)

    def finish(self, prompt: Sequence[int], fed: Sequence[int]) -> None:
        """After a decode run that prefilled ``prompt[:-1]`` and then ran len(fed) steps fed
        with ``fed`` (``fed_tokens``): those are the valid positions, whatever was cancelled.
        ``prompt`` ends with the kernel's first input: the request's last prompt token, or
        the token drawn from the prefill's logits (the prefill then wrote the whole prompt)."""
        self._live = tuple(prompt[:-1]) + tuple(fed)

    def invalidate(self) -> None:
        """The live cache's contents are unknown (a failed run): trust none of it."""
        self._live = ()
