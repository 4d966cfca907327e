"""Prometheus metrics in the text exposition format (no client library needed).

Updated from the generation thread (hence the lock) and rendered on ``GET /metrics``.
TTFT is measured from the request's arrival, so it includes queueing: what a client feels.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03,
    0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
_E2E_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
)  # fmt: skip

PREFIX = "monokernel_"


def _num(x: float) -> str:
    return repr(float(x)) if x != int(x) or abs(x) > 1e15 else str(int(x))


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name = PREFIX + name
        self.help = help_text
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            running += n
            le = "+Inf" if bound == float("inf") else _num(bound)
            lines.append(f'{self.name}_bucket{{le="{le}"}} {running}')
        lines += [f"{self.name}_sum {self.sum!r}", f"{self.name}_count {self.count}"]
        return lines


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft = Histogram(
            "time_to_first_token_seconds",
            "Request arrival to first generated token (includes queueing).",
            _LATENCY_BUCKETS,
        )
        self.itl = Histogram(
            "inter_token_latency_seconds",
            "Time between consecutive generated tokens.",
            _ITL_BUCKETS,
        )
        self.e2e = Histogram(
            "e2e_request_latency_seconds", "Request arrival to its last token.", _E2E_BUCKETS
        )
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.draft_tokens = 0  # speculative decoding: drafted, and accepted by the model
        self.accepted_tokens = 0
        self.finished: dict[str, int] = {}
        self.rejected: dict[int, int] = {}

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        with self._lock:
            self.itl.observe(seconds)

    def finish(
        self,
        reason: str,
        prompt_n: int,
        generated_n: int,
        e2e_s: float,
        drafted_n: int = 0,
        accepted_n: int = 0,
    ) -> None:
        with self._lock:
            self.e2e.observe(e2e_s)
            self.prompt_tokens += prompt_n
            self.generation_tokens += generated_n
            self.draft_tokens += drafted_n
            self.accepted_tokens += accepted_n
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def reject(self, status: int) -> None:
        with self._lock:
            self.rejected[status] = self.rejected.get(status, 0) + 1

    def render(self, waiting: int, running: int) -> str:
        with self._lock:
            lines = [
                *self._scalar("num_requests_waiting", "gauge", "Requests in the queue.", waiting),
                *self._scalar("num_requests_running", "gauge", "Requests generating.", running),
                *self._scalar(
                    "prompt_tokens_total", "counter", "Prompt tokens processed.", self.prompt_tokens
                ),
                *self._scalar(
                    "generation_tokens_total",
                    "counter",
                    "Tokens generated.",
                    self.generation_tokens,
                ),
                *self._scalar(
                    "spec_decode_draft_tokens_total",
                    "counter",
                    "Tokens drafted by speculative decoding (--speculative).",
                    self.draft_tokens,
                ),
                *self._scalar(
                    "spec_decode_accepted_tokens_total",
                    "counter",
                    "Drafted tokens the model agreed with.",
                    self.accepted_tokens,
                ),
            ]
            name = PREFIX + "request_success_total"
            lines += [f"# HELP {name} Finished requests by reason.", f"# TYPE {name} counter"]
            for reason in sorted(set(self.finished) | {"stop", "length", "cancelled"}):
                lines.append(f'{name}{{finished_reason="{reason}"}} {self.finished.get(reason, 0)}')
            name = PREFIX + "request_rejected_total"
            lines += [f"# HELP {name} Requests refused, by HTTP status.", f"# TYPE {name} counter"]
            for status in sorted(self.rejected):
                lines.append(f'{name}{{status="{status}"}} {self.rejected[status]}')
            for h in (self.ttft, self.itl, self.e2e):
                lines += h.render()
        return "\n".join(lines) + "\n"

    @staticmethod
    def _scalar(name: str, kind: str, help_text: str, value: float) -> list[str]:
        full = PREFIX + name
        return [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}", f"{full} {_num(value)}"]
