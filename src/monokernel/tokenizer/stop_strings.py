"""Cut generated text at the first stop string, holding back text that may start one."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def _held_back(self) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def feed(self, delta: str) -> str:
        """Text safe to emit now; sets ``stopped`` once a stop string has appeared."""
        if self.stopped or not delta:
            return ""
        self.text += delta
        longest = max((len(s) for s in self.stops), default=0)
        search_from = max(0, self.emitted - longest + 1)
        hits = [i for s in self.stops if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.stopped = True
            end = min(hits)
        else:
            end = len(self.text) - self._held_back()
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return out

    def flush(self) -> str:
        """At the end without a stop: the held-back tail was not a stop after all."""
        if self.stopped:
            return ""
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out
