"""Cold starts in a session: the time to first token of every request of one backend's life.

    PYTHONPATH=src python3 tools/ttft_session.py --shape smollm2-135m --requests 50

One monokernel backend (random weights in the named shape) serves ``--requests`` requests in
a row, each a fresh prompt (random ids, so no prefix is reused) whose length is drawn
log-uniformly from [--min-prompt, --max-prompt], 8 tokens generated: what an agent's server
sees when every turn has a new length. Prints the load time (the prefill warm-up's share
too), the first request's TTFT, the median, p90, p99 and max, and the ratios issue 38 asks
for (p99 / p50 and first / p50). Run it with MONOKERNEL_PREFILL_WARMUP=0 beside the default
to see what the warm-up removes.

``--turns``: an agent's conversation instead: each request repeats the previous one's prompt
and appends a new turn (log-uniform in [--min-prompt, --max-turn] tokens), so the backend
prefills only the turn after the held prefix; the conversation starts over when the next turn
would not fit the context (--max-len, default 8,192 here).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

from monokernel.bench.measure import time_request
from monokernel.models.shapes import SHAPES
from monokernel.runtime.backends.monokernel import MonokernelBackend
from monokernel.weights.random_weights import random_weights


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--min-prompt", type=int, default=20)
    ap.add_argument("--max-prompt", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--max-len",
        type=int,
        default=0,
        help="the backend's context (default: the longest prompt + 16); prompts whose bucket "
        "passes it are prefilled eagerly, as past the chunk",
    )
    ap.add_argument("--turns", action="store_true", help="a held conversation (above)")
    ap.add_argument("--max-turn", type=int, default=1000)
    ap.add_argument("--json", dest="json_file")
    args = ap.parse_args(argv)
    cfg, device = SHAPES[args.shape], torch.device("cuda")
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    max_len = args.max_len or (8192 if args.turns else args.max_prompt + 16)
    backend = MonokernelBackend(
        cfg, random_weights(cfg, device=device, seed=args.seed), max_len, device
    )
    load_s = time.perf_counter() - t0
    top = args.max_turn if args.turns else args.max_prompt
    lo, hi = math.log(args.min_prompt), math.log(top)
    ttft_ms: list[float] = []
    lengths: list[int] = []  # each request's new tokens (the whole prompt when fresh)
    held: list[int] = []  # the conversation so far (--turns)
    for _ in range(args.requests):
        n = int(math.exp(lo + (hi - lo) * torch.rand(1, generator=gen).item()))
        new = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
        if args.turns and len(held) + n + 16 > max_len:
            held = []
        prompt = held + new if args.turns else new
        held = prompt
        ttft_ms.append(time_request(backend, prompt, 8).ttft_s * 1e3)
        lengths.append(n)
    backend.close()
    p50 = statistics.median(ttft_ms)
    row = {
        "shape": args.shape,
        "session": "turns" if args.turns else "fresh",
        "device": torch.cuda.get_device_name(device),
        "load_s": round(load_s, 3),
        "warmup_s": round(backend.warmup_s, 3),
        "first_ms": round(ttft_ms[0], 3),
        "p50_ms": round(p50, 3),
        "p90_ms": round(_pct(ttft_ms, 0.90), 3),
        "p99_ms": round(_pct(ttft_ms, 0.99), 3),
        "max_ms": round(max(ttft_ms), 3),
        "p99_over_p50": round(_pct(ttft_ms, 0.99) / p50, 3),
        "first_over_p50": round(ttft_ms[0] / p50, 3),
        "slowest": sorted(zip(ttft_ms, lengths, strict=True), reverse=True)[:5],
    }
    print(json.dumps(row))
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(row | {"ttft_ms": ttft_ms, "prompt_tokens": lengths}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
