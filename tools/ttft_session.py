"""Cold starts in a session: the time to first token of every request of one backend's life.

    PYTHONPATH=src python3 tools/ttft_session.py --shape smollm2-135m --requests 50

One monokernel backend (random weights in the named shape) serves ``--requests`` requests in
a row, each a fresh prompt (random ids, so no prefix is reused) whose length is drawn from
[--min-prompt, --max-prompt] (``--spread``: log-uniformly, or uniformly), 8 tokens
generated: what an agent's server sees when every turn has a new length. Prints the load time
(the prefill warm-up's share too), the first request's TTFT, the median, p90, p99 and max, and
the ratios issue 38 asks for (p99 / p50 and first / p50). Run it with
MONOKERNEL_PREFILL_WARMUP=0 beside the default to see what the warm-up removes.

Then the same session again on the same backend (``--again``, default on; the conversation
replayed for --turns): by then every length has been seen, so each request's ratio to its
second run says what the first run paid beyond the work of its length (a cold start), apart
from the spread of lengths that p99 / p50 mixes in.

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
    ap.add_argument("--spread", choices=("log", "uniform"), default="log")
    ap.add_argument("--again", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--json", dest="json_file")
    args = ap.parse_args(argv)
    cfg, device = SHAPES[args.shape], torch.device("cuda")
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    max_len = args.max_len or (8192 if args.turns else args.max_prompt + 16)
    # No snapshots: within one pass none would be restored (no conversation comes back), and
    # in the --again pass they would let a request skip the prefill its first run paid.
    weights = random_weights(cfg, device=device, seed=args.seed)
    backend = MonokernelBackend(cfg, weights, max_len, device, snapshot_bytes=0)
    load_s = time.perf_counter() - t0
    top = args.max_turn if args.turns else args.max_prompt
    lo, hi = (
        (math.log(args.min_prompt), math.log(top))
        if args.spread == "log"
        else (
            args.min_prompt,
            top,
        )
    )
    prompts: list[list[int]] = []
    lengths: list[int] = []  # each request's new tokens (the whole prompt when fresh)
    held: list[int] = []  # the conversation so far (--turns)
    for _ in range(args.requests):
        u = lo + (hi - lo) * torch.rand(1, generator=gen).item()
        n = int(math.exp(u) if args.spread == "log" else u)
        new = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
        if args.turns and len(held) + n + 16 > max_len:
            held = []
        prompt = held + new if args.turns else new
        held = prompt
        prompts.append(prompt)
        lengths.append(n)
    ttft_ms = [time_request(backend, p, 8).ttft_s * 1e3 for p in prompts]
    again_ms = [time_request(backend, p, 8).ttft_s * 1e3 for p in prompts] if args.again else []
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
    if again_ms:
        # A fresh prompt's second run is a fresh prefill again (random ids, prefix reuse of the
        # same ids aside: the backend holds only the latest prompt); a turn's replays it too.
        ratio = [a / b for a, b in zip(ttft_ms, again_ms, strict=True)]
        row |= {
            "again_p50_ms": round(statistics.median(again_ms), 3),
            "again_p99_ms": round(_pct(again_ms, 0.99), 3),
            "over_again_max": round(max(ratio), 3),
            "over_again_p99": round(_pct(ratio, 0.99), 3),
        }
    print(json.dumps(row))
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(
                row | {"ttft_ms": ttft_ms, "again_ms": again_ms, "prompt_tokens": lengths},
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
