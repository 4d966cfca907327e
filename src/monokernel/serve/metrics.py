"""Prometheus metrics in the text exposition format, rendered on ``GET /metrics``.

Two families from the same observations:

* ``vllm:*`` with a ``model_name`` label, under the names and buckets vLLM's V1 server
  exports, so dashboards and alerts written for vLLM read this server unchanged (see
  docs/serving.md for the list, and what is absent);
* ``monokernel_*``, the project's own (rejections by status, requests abandoned in the
  queue, speculative decoding's drafts), and ``process_*`` read from /proc on Linux.

No client library: the format is a few lines per metric, and the GPU image we test on has
none. Updated from the generation thread (hence the lock). TTFT is measured from the
request's arrival, so it includes queueing: what a client feels.
"""

from __future__ import annotations

import bisect
import os
import resource
import threading
import time
from collections.abc import Sequence
from pathlib import Path

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03,
    0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# Token counts a request: 1-2-5 steps up to past the longest context.
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))

PREFIX = "monokernel_"
VLLM = "vllm:"
# Our finish reasons in vLLM's words ("abort": ended before stop or length).
_VLLM_REASON = {"stop": "stop", "length": "length", "cancelled": "abort"}


def _num(x: float) -> str:
    return repr(float(x)) if x != int(x) or abs(x) > 1e15 else str(int(x))


def _labels(pairs: Sequence[tuple[str, str]]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Histogram:
    def __init__(
        self,
        name: str,
        help_text: str,
        buckets: Sequence[float],
        labels: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.name, self.help, self.labels = name, help_text, tuple(labels)
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
            lines.append(f"{self.name}_bucket{_labels((*self.labels, ('le', le)))} {running}")
        tail = _labels(self.labels)
        lines += [f"{self.name}_sum{tail} {self.sum!r}", f"{self.name}_count{tail} {self.count}"]
        return lines


class Metrics:
    def __init__(self, model_name: str = "") -> None:
        self._lock = threading.Lock()
        self.model = (("model_name", model_name),)
        m = self.model

        def both(name: str, help_text: str, buckets: Sequence[float]) -> list[Histogram]:
            return [
                Histogram(PREFIX + name, help_text, buckets),
                Histogram(VLLM + name, help_text, buckets, m),
            ]

        self.ttft = both(
            "time_to_first_token_seconds",
            "Request arrival to first generated token (includes queueing).",
            _LATENCY_BUCKETS,
        )
        self.itl = both(
            "inter_token_latency_seconds",
            "Time between consecutive generated tokens.",
            _ITL_BUCKETS,
        )
        # vLLM's earlier name for the same, which older dashboards read.
        self.itl.append(
            Histogram(
                VLLM + "time_per_output_token_seconds",
                "Time between consecutive generated tokens.",
                _ITL_BUCKETS,
                m,
            )
        )
        self.e2e = both(
            "e2e_request_latency_seconds", "Request arrival to its last token.", _REQUEST_BUCKETS
        )
        self.queue = Histogram(
            VLLM + "request_queue_time_seconds",
            "Time a request waited for the engine.",
            _REQUEST_BUCKETS,
            m,
        )
        self.prefill = Histogram(
            VLLM + "request_prefill_time_seconds",
            "Engine start to first token: the prefill.",
            _REQUEST_BUCKETS,
            m,
        )
        self.decode = Histogram(
            VLLM + "request_decode_time_seconds",
            "First token to last token.",
            _REQUEST_BUCKETS,
            m,
        )
        self.inference = Histogram(
            VLLM + "request_inference_time_seconds",
            "Engine start to last token (prefill and decode).",
            _REQUEST_BUCKETS,
            m,
        )
        self.prompt_hist = Histogram(
            VLLM + "request_prompt_tokens", "Prompt tokens a request.", _TOKEN_BUCKETS, m
        )
        self.generation_hist = Histogram(
            VLLM + "request_generation_tokens", "Generated tokens a request.", _TOKEN_BUCKETS, m
        )
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0  # prompt tokens of requests to an engine with a prefix cache
        self.prefix_hits = 0  # of those, tokens an earlier request's K/V supplied
        self.draft_tokens = 0  # speculative decoding: drafted, and accepted by the model
        self.accepted_tokens = 0
        self.finished: dict[str, int] = {}
        self.rejected: dict[int, int] = {}
        self.abandoned = 0  # requests whose client left (or shutdown came) while queued

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            for h in self.ttft:
                h.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        with self._lock:
            for h in self.itl:
                h.observe(seconds)

    def finish(
        self,
        reason: str,
        prompt_n: int,
        generated_n: int,
        e2e_s: float,
        drafted_n: int = 0,
        accepted_n: int = 0,
        *,
        queue_s: float | None = None,
        prefill_s: float | None = None,
        decode_s: float | None = None,
        cached_n: int | None = None,
    ) -> None:
        """A request that ran: ``prefill_s``/``decode_s`` the engine's TTFT and decode span,
        ``cached_n`` its prompt tokens from the prefix cache (None: the engine has none)."""
        with self._lock:
            for h in self.e2e:
                h.observe(e2e_s)
            if queue_s is not None:
                self.queue.observe(queue_s)
            if prefill_s is not None and decode_s is not None:
                self.prefill.observe(prefill_s)
                self.decode.observe(decode_s)
                self.inference.observe(prefill_s + decode_s)
            self.prompt_hist.observe(prompt_n)
            self.generation_hist.observe(generated_n)
            self.prompt_tokens += prompt_n
            self.generation_tokens += generated_n
            if cached_n is not None:
                self.prefix_queries += prompt_n
                self.prefix_hits += cached_n
            self.draft_tokens += drafted_n
            self.accepted_tokens += accepted_n
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def reject(self, status: int) -> None:
        with self._lock:
            self.rejected[status] = self.rejected.get(status, 0) + 1

    def abandon_queued(self) -> None:
        with self._lock:
            self.abandoned += 1

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
                    "prefix_cache_queries_total",
                    "counter",
                    "Prompt tokens looked up in the prefix cache.",
                    self.prefix_queries,
                ),
                *self._scalar(
                    "prefix_cache_hits_total",
                    "counter",
                    "Prompt tokens the prefix cache supplied.",
                    self.prefix_hits,
                ),
            ]
            lines += self._reasons(PREFIX, (), dict(self.finished), ("stop", "length", "cancelled"))
            vllm_reasons: dict[str, int] = {}
            for reason, n in self.finished.items():
                key = _VLLM_REASON.get(reason, reason)
                vllm_reasons[key] = vllm_reasons.get(key, 0) + n
            vllm_reasons["abort"] = vllm_reasons.get("abort", 0) + self.abandoned
            lines += self._reasons(VLLM, self.model, vllm_reasons, ("stop", "length", "abort"))
            lines += self._own(PREFIX + "request_abandoned_total", "counter",
                               "Requests that left (or were shut down) while queued.",
                               self.abandoned)  # fmt: skip
            lines += self._own(PREFIX + "spec_decode_draft_tokens_total", "counter",
                               "Tokens drafted by speculative decoding (--speculative).",
                               self.draft_tokens)  # fmt: skip
            lines += self._own(PREFIX + "spec_decode_accepted_tokens_total", "counter",
                               "Drafted tokens the model agreed with.",
                               self.accepted_tokens)  # fmt: skip
            name = PREFIX + "request_rejected_total"
            lines += [f"# HELP {name} Requests refused, by HTTP status.", f"# TYPE {name} counter"]
            for status in sorted(self.rejected):
                lines.append(f'{name}{{status="{status}"}} {self.rejected[status]}')
            for h in (*self.ttft, *self.itl, *self.e2e, self.queue, self.prefill, self.decode,
                      self.inference, self.prompt_hist, self.generation_hist):  # fmt: skip
                lines += h.render()
        lines += process_metrics()
        return "\n".join(lines) + "\n"

    def _scalar(self, name: str, kind: str, help_text: str, value: float) -> list[str]:
        """``name`` in both families (vLLM's with the model label)."""
        return [
            *self._own(PREFIX + name, kind, help_text, value),
            *self._own(VLLM + name, kind, help_text, value, self.model),
        ]

    @staticmethod
    def _own(
        full: str, kind: str, help_text: str, value: float, labels: Sequence[tuple[str, str]] = ()
    ) -> list[str]:
        return [
            f"# HELP {full} {help_text}",
            f"# TYPE {full} {kind}",
            f"{full}{_labels(labels)} {_num(value)}",
        ]

    @staticmethod
    def _reasons(
        prefix: str,
        labels: Sequence[tuple[str, str]],
        counts: dict[str, int],
        always: Sequence[str],
    ) -> list[str]:
        name = prefix + "request_success_total"
        out = [f"# HELP {name} Finished requests by reason.", f"# TYPE {name} counter"]
        for reason in sorted(set(counts) | set(always)):
            tags = _labels((("finished_reason", reason), *labels))
            out.append(f"{name}{tags} {counts.get(reason, 0)}")
        return out


_START = time.time()


def process_metrics() -> list[str]:
    """Prometheus' standard process_* metrics where /proc is there (Linux); none elsewhere."""
    proc = Path("/proc/self")
    if not proc.is_dir():
        return []
    page = os.sysconf("SC_PAGE_SIZE")
    vm_pages, rss_pages = (int(x) for x in (proc / "statm").read_text().split()[:2])
    usage = resource.getrusage(resource.RUSAGE_SELF)
    boot = _boot_time()
    ticks = os.sysconf("SC_CLK_TCK")
    # /proc/self/stat field 22: the start time in clock ticks since boot.
    stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
    start = boot + int(stat[19]) / ticks if boot is not None else _START
    values = [
        ("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", vm_pages * page),
        ("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.",
         rss_pages * page),
        ("process_cpu_seconds_total", "counter", "Total user and system CPU time in seconds.",
         usage.ru_utime + usage.ru_stime),
        ("process_open_fds", "gauge", "Number of open file descriptors.",
         len(os.listdir(proc / "fd"))),
        ("process_max_fds", "gauge", "Maximum number of open file descriptors.",
         resource.getrlimit(resource.RLIMIT_NOFILE)[0]),
        ("process_start_time_seconds", "gauge", "Start time of the process since the epoch.",
         start),
    ]  # fmt: skip
    out: list[str] = []
    for name, kind, help_text, value in values:
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {_num(value)}"]
    return out


def _boot_time() -> float | None:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        return None
    return None
