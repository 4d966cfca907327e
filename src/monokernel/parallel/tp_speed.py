"""TP=1 vs TP=N decode speed of the monokernel on one shape with random weights.

    python -m monokernel.parallel.tp_speed [--shape qwen2.5-coder-1.5b] [--tp 2]
        [--prompt 64] [--tokens 512] [--reps 3]

Greedy, no stop ids; µs per token = (last token time - first token time) / (tokens - 1),
the best of ``reps`` runs after one warm-up run per engine.
"""

from __future__ import annotations

import argparse
import time

import torch

from monokernel.models.shapes import SHAPES
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.backends.monokernel.peer import multicast_off
from monokernel.runtime.sampling import SamplingParams
from monokernel.weights.random_weights import random_weights


def _us_per_token(backend, prompt: list[int], tokens: int) -> float:
    req = DecodeRequest(tuple(prompt), SamplingParams(temperature=0.0), tokens, frozenset())
    stamps = [time.perf_counter() for _ in backend.stream(req, CancelToken())]
    if len(stamps) != tokens:
        raise RuntimeError(f"produced {len(stamps)} of {tokens} tokens")
    return (stamps[-1] - stamps[0]) / (tokens - 1) * 1e6


def main(argv: list[str] | None = None) -> int:
    multicast_off()
    ap = argparse.ArgumentParser(prog="python -m monokernel.parallel.tp_speed")
    ap.add_argument("--shape", default="qwen2.5-coder-1.5b", choices=sorted(SHAPES))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quantize", choices=["fp8", "int8", "int4"], help="the layers' weight format")
    args = ap.parse_args(argv)
    from monokernel.runtime.backends.monokernel import MonokernelBackend
    from monokernel.runtime.backends.monokernel.tp import MonokernelTPBackend

    cfg = SHAPES[args.shape]
    dev = torch.device("cuda", 0)
    weights = random_weights(cfg, device=dev, seed=0)
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt,), generator=torch.Generator()).tolist()
    max_len = args.prompt + args.tokens + 1
    results: dict[int, float] = {}
    for n in (1, args.tp):
        if n == 1:
            backend = MonokernelBackend(cfg, weights, max_len, dev, quantize=args.quantize)
        else:
            backend = MonokernelTPBackend(cfg, weights, max_len, dev, n, args.quantize)
        _us_per_token(backend, prompt, args.tokens)  # warm-up (build, first launch)
        results[n] = min(_us_per_token(backend, prompt, args.tokens) for _ in range(args.reps))
        backend.close()
        print(
            f"TP={n} {args.shape} {args.quantize or 'bf16'}: {results[n]:.1f} µs/token, "
            f"{1e6 / results[n]:.1f} tok/s "
            f"({args.prompt}-token prompt, {args.tokens} generated)",
            flush=True,
        )
    print(f"TP={args.tp} speed-up over TP=1: {results[1] / results[args.tp]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
