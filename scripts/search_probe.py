"""Does the load-time placement search's timing predict a request's speed? (GPU machine.)

    PYTHONPATH=src python3 scripts/search_probe.py --shape qwen2.5-coder-1.5b --json out.json

For a few places of the hand-off buffer (runtime/backends/handoff_placement.py) and fresh
copies of the weights (``MonokernelBackend.use_weights``), times each several ways,
interleaved over rounds: teacher-forced decodes over the spans given (a '+' joins spans into
one timing, as the search's SPANS), and a whole request as the bench times it (64-token
prompt, 512 generated). A timing that ranks the places as the requests do is one the search
can use; the weights' rows tell whether their place matters too (docs/perf-notes.md step
56).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from monokernel.bench.measure import time_request
from monokernel.bench.shapes import SHAPES, random_weights
from monokernel.runtime.backends.handoff_placement import span_us_per_step
from monokernel.runtime.backends.monokernel import MonokernelBackend


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="qwen2.5-coder-1.5b")
    ap.add_argument("--handoffs", type=int, default=7, help="fresh hand-off places")
    ap.add_argument("--weights", type=int, default=3, help="fresh copies of the weights")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spans", default="256x64,96x64+352x64,64x512",
                    help="timed decodes: START x STEPS; '+' joins spans")  # fmt: skip
    ap.add_argument("--json", dest="json_file")
    args = ap.parse_args(argv)
    # The weights move between requests; graphs captured by a prefill would keep the old ones.
    os.environ["MONOKERNEL_PREFILL_GRAPHS"] = "0"
    device = torch.device("cuda")
    cfg = SHAPES[args.shape]
    weights = random_weights(cfg, device=device, seed=0)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (64,), generator=gen).tolist()
    b = MonokernelBackend(cfg, weights, 64 + 512 + 1, device, handoff_search=0)
    del weights
    forced = torch.randint(0, cfg.vocab_size, (512,), generator=gen, dtype=torch.int32).to(device)
    own_h, own_w = b.handoff, b.streamed_weights()
    handoffs = [own_h] + [torch.empty_like(own_h) for _ in range(args.handoffs)]
    copies = [own_w] + [[t.clone() for t in own_w] for _ in range(args.weights)]
    places = [(f"h{i}", i, 0) for i in range(len(handoffs))]
    places += [(f"w{j}", 0, j) for j in range(1, len(copies))]
    spans = {
        s: tuple(tuple(int(v) for v in part.split("x")) for part in s.split("+"))
        for s in args.spans.split(",")
    }

    time_request(b, prompt, 32)  # warm-up
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for name, hi, wj in places:
            b.use_handoff(handoffs[hi])
            b.use_weights(copies[wj])
            for s, span in spans.items():
                times.setdefault((name, s), []).append(span_us_per_step(b, forced, span))
            t = time_request(b, prompt, 512)
            times.setdefault((name, "request"), []).append(t.decode_s_per_token * 1e6)
    cols = [*spans, "request"]
    print(f"device: {torch.cuda.get_device_name(device)} | {args.shape} | µs a step, best round")
    print("place  " + " ".join(f"{c:>26s}" for c in cols))
    best = {k: min(v) for k, v in times.items()}
    for name, _, _ in places:
        print(f"{name:6s} " + " ".join(f"{best[(name, c)]:26.1f}" for c in cols))
    names = [p[0] for p in places]
    req = [best[(n, "request")] for n in names]
    for c in spans:
        xs = [best[(n, c)] for n in names]
        print(f"correlation with the request, {c}: {statistics.correlation(xs, req):+.2f}")
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump({f"{n}|{c}": v for (n, c), v in times.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
