"""What does one all-reduce of the tensor-parallel prefill cost? Times the exchange kernel
(csrc/prefill_allreduce.cu, runtime/prefill_exchange.py) on N GPUs for a prompt chunk's
[rows, hidden] fp32 partials, every rank launching its exchange on its own stream as the
prefill's graphs do, and checks the result against the host's sum first.

    PYTHONPATH=src python3 tools/prefill_exchange_cost.py --ranks 2 --rows 64,1024,4096 \\
        --hidden 4096 [--iters 20]

Prints µs an exchange (the slowest rank's CUDA-event time over ``iters`` exchanges back to
back, divided by ``iters``) and the rate at which a rank reads its peers' partials over
NVLink: (N - 1) * rows * hidden * 4 bytes an exchange.
"""

from __future__ import annotations

import argparse

import torch

from monokernel.runtime.prefill_exchange import ATTENTION, MLP, PeerExchange


def _check(ex: PeerExchange, devices: list[torch.device], rows: int, hidden: int) -> None:
    """One exchange against the host's sum in rank order, bit for bit."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=g)
    parts = [torch.randn(rows, hidden, generator=g) for _ in devices]
    want = x.clone()
    for p in parts:
        want += p
    xs = [x.to(d) for d in devices]
    for r, d in enumerate(devices):
        ex.partial(r, MLP, rows).copy_(parts[r].to(d))
    ex.reduce_all(xs, MLP)
    for r in range(len(devices)):
        if not torch.equal(xs[r].cpu(), want):
            raise SystemExit(f"rank {r}: the exchange of {rows} rows differs from the host's sum")


def _time(ex: PeerExchange, devices: list[torch.device], rows: int, iters: int) -> float:
    """µs an exchange: the slowest rank's events around a CUDA graph of ``iters`` exchanges
    (captured as the prefill's graphs are, so the host's launch rate does not count)."""
    xs = [torch.zeros(rows, ex.hidden, device=d) for d in devices]
    graphs = []
    for r, d in enumerate(devices):
        with torch.cuda.device(d):
            g = torch.cuda.CUDAGraph()
            # The device's own capture stream: torch.cuda.graph's default is made once, on
            # the first device it sees.
            with torch.cuda.graph(g, stream=torch.cuda.Stream(d)):
                for k in range(iters):
                    ex.reduce_rank(r, xs[r], (ATTENTION, MLP)[k % 2])
            graphs.append(g)
    events = []
    for _ in range(2):  # the first round warms up
        events = []
        for d, g in zip(devices, graphs, strict=True):
            with torch.cuda.device(d):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                g.replay()
                end.record()
                events.append((start, end))
        for d in devices:
            torch.cuda.synchronize(d)
    return max(s.elapsed_time(e) for s, e in events) * 1e3 / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rows", default="64,1024,4096", help="comma-separated token counts")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"--ranks {args.ranks}: this machine has {torch.cuda.device_count()} GPUs")
    devices = [torch.device(f"cuda:{r}") for r in range(args.ranks)]
    ex = PeerExchange(devices, max(rows), args.hidden)
    try:
        print(f"{torch.cuda.get_device_name(0)} x{args.ranks}, hidden {args.hidden}")
        print(f"{'rows':>6} {'µs/exchange':>12} {'peer GB/s':>10}")
        for t in rows:
            _check(ex, devices, t, args.hidden)
            us = _time(ex, devices, t, args.iters)
            peer = (args.ranks - 1) * t * args.hidden * 4
            print(f"{t:>6} {us:>12.1f} {peer / us / 1e3:>10.1f}")
    finally:
        ex.free()


if __name__ == "__main__":
    main()
