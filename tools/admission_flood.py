"""Big bodies against a running stream (issue 38 item 2): while one completion streams, N
clients post bodies of ~16 MiB at once (prompts far past the context); reports each refusal's
status and time, the stream's tokens/s before and during the flood, and the server's resident
memory before, at its peak and after. Then the same stream again without a flood (greedy, so
the same tokens): ``during_over_control`` is the speed over the flood's tokens against the
speed over the same tokens undisturbed, which a later window's own speed (a longer context,
a longer text to stream) does not bias.

    python3 tools/admission_flood.py http://127.0.0.1:8765 --pid SERVER_PID [--bodies 10]

Needs httpx (the server's test extra). The server should run a GPU engine, so that the
stream's speed measures what admission takes from it, not CPU contention. The stream is read
in a process of its own: read by a thread beside the ten posting ones, its arrival times
would carry this client's own GIL waits.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from typing import Any

import httpx


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def stream(url: str, model: str, tokens: int, count: Any, stop: Any, out: Any) -> None:
    """Child process: each streamed event's arrival time (perf_counter, CLOCK_MONOTONIC, the
    parent's clock too), sent to ``out`` once ``stop`` is set or the stream ends; ``count``
    counts them as they come; -1 if the stream was refused."""
    body = {"model": model, "prompt": "def f(x):", "max_tokens": tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    stamps: list[float] = []
    with (
        httpx.Client(timeout=None) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as r,
    ):
        if r.status_code != 200:
            print(f"the stream was refused: {r.status_code} {r.read()[:300]!r}", file=sys.stderr)
            count.value = -1
            out.put(stamps)
            return
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
                count.value = len(stamps)
            if stop.is_set():
                break
    out.put(stamps)


def start_stream(url: str, model: str, tokens: int) -> tuple[Any, Any, Any, Any]:
    """The reader process, its event count, its stop event and its result queue."""
    ctx = mp.get_context("spawn")
    count, stop, out = ctx.Value("l", 0), ctx.Event(), ctx.Queue()
    reader = ctx.Process(target=stream, args=(url, model, tokens, count, stop, out), daemon=True)
    reader.start()
    return reader, count, stop, out


def finish_stream(reader: Any, stop: Any, out: Any) -> list[float]:
    stop.set()
    stamps: list[float] = out.get(timeout=60)
    reader.join(timeout=10)
    return stamps


def rate(stamps: list[float], t0: float, t1: float) -> float:
    n = sum(1 for t in stamps if t0 <= t < t1)
    return n / (t1 - t0)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("url")
    ap.add_argument("--pid", type=int, required=True, help="the server's process id")
    ap.add_argument("--bodies", type=int, default=10)
    ap.add_argument("--mib", type=float, default=15.9, help="each body's size")
    ap.add_argument("--stream-tokens", type=int, default=4000, help="the stream's max_tokens")
    args = ap.parse_args(argv)
    model = httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
    reader, count, stop, out = start_stream(args.url, model, args.stream_tokens)
    while 0 <= count.value < 20:
        time.sleep(0.01)
    if count.value < 0:
        return 1
    time.sleep(2.0)
    t_base = time.perf_counter()
    rss_before = rss_mb(args.pid)
    prompt = "x" * int(args.mib * 2**20 - 200)
    raw = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4}).encode()
    results: list[tuple[int, float]] = []
    peak = [rss_before]

    def post() -> None:
        t = time.perf_counter()
        with httpx.Client(timeout=120) as client:
            r = client.post(f"{args.url}/v1/completions", content=raw,
                            headers={"content-type": "application/json"})  # fmt: skip
        results.append((r.status_code, time.perf_counter() - t))

    posters = [threading.Thread(target=post) for _ in range(args.bodies)]
    t_flood = time.perf_counter()
    for p in posters:
        p.start()
    while any(p.is_alive() for p in posters):
        peak.append(rss_mb(args.pid))
        time.sleep(0.02)
    t_done = time.perf_counter()
    time.sleep(2.0)
    rss_after = rss_mb(args.pid)
    stamps = finish_stream(reader, stop, out)
    before = rate(stamps, t_base - 2.0, t_base)
    during = rate(stamps, t_flood, t_done)
    after_rate = rate(stamps, t_done + 0.5, t_done + 2.0)
    # The events that arrived during the flood, i0 .. i1, then the same ones undisturbed.
    i0 = next(i for i, t in enumerate(stamps) if t >= t_flood)
    i1 = max(i for i, t in enumerate(stamps) if t < t_done)
    reader, count, stop, out = start_stream(args.url, model, args.stream_tokens)
    while 0 <= count.value <= i1:
        time.sleep(0.01)
    control = finish_stream(reader, stop, out)
    times = [s for _, s in results]
    row = {
        "bodies": args.bodies,
        "body_mib": args.mib,
        "statuses": sorted({c for c, _ in results}),
        "refusal_s_max": round(max(times), 3),
        "refusal_s_median": round(statistics.median(times), 3),
        "flood_s": round(t_done - t_flood, 3),
        "stream_tok_s_before": round(before, 1),
        "stream_tok_s_during": round(during, 1),
        "stream_tok_s_after": round(after_rate, 1),
        "during_over_before": round(during / before, 3),
        "flood_events": [i0, i1],
        # None when the flood was over within one event (a slow CPU stream).
        "during_over_control": round((control[i1] - control[i0]) / (stamps[i1] - stamps[i0]), 3)
        if i1 > i0
        else None,
        "rss_mb_before": round(rss_before, 1),
        "rss_mb_peak": round(max(peak), 1),
        "rss_mb_after": round(rss_after, 1),
        "after_over_before": round(rss_after / rss_before, 3),
    }
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
