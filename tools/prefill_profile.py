"""Where a prefill's GPU time goes (GPU machine): torch.profiler over the monokernel
backend's prefill of a fresh prompt and of an agent's turn on a held conversation, the
CUDA kernels grouped by name, the largest first.

    PYTHONPATH=src python3 tools/prefill_profile.py --shape llama-3.2-1b \\
        --prompt-tokens 8192 --context 16384 --turn-tokens 500
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from monokernel.models.shapes import SHAPES
from monokernel.runtime.backends.monokernel import MonokernelBackend
from monokernel.runtime.prefill_attention import flash_cache_attention_ok
from monokernel.runtime.prefill_ops import addmm_fp32_ok, rms_norm_fused_ok, silu_mul_fused_ok
from monokernel.runtime.prefill_qkv import fused_epilogue_ok
from monokernel.weights.random_weights import random_weights


def _timed(backend: MonokernelBackend, ids: list[int], reset: list[int] | None) -> float:
    """ms of one prefill_logits call (host wall time, synchronised), after `reset` was
    prefilled so the call reuses it as a prefix."""
    if reset is not None:
        backend.prefill_logits(reset)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    backend.prefill_logits(ids)
    return (time.perf_counter() - t0) * 1e3


def _report(name: str, backend: MonokernelBackend, ids: list[int], reset: list[int] | None):
    for _ in range(2):  # graphs captured, workspaces grown
        _timed(backend, ids, reset)
    ms = sorted(_timed(backend, ids, reset) for _ in range(3))[1]
    if reset is not None:
        backend.prefill_logits(reset)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        backend.prefill_logits(ids)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) / 1e3
    launches = sum(e.count for e in events)
    print(
        f"\n== {name}: {ms:.2f} ms wall (median of 3), {total:.2f} ms of kernels, "
        f"{launches} kernels"
    )
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:14]:
        print(f"{e.self_device_time_total / 1e3:8.3f} ms {e.count:5d}x  {e.key[:90]}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--turn-tokens", type=int, default=500)
    args = ap.parse_args(argv)
    cfg = SHAPES[args.shape]
    dev = torch.device("cuda")
    weights = random_weights(cfg, device=dev, seed=0)
    max_len = max(args.prompt_tokens, args.context + args.turn_tokens) + 64
    # Live cache only: with a snapshot budget, re-prefilling `held` after a turn saves that
    # turn as a snapshot, and the next turn would restore it instead of prefilling 500 tokens.
    backend = MonokernelBackend(cfg, weights, max_len, dev, snapshot_bytes=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (max_len,), generator=g).tolist()
    print(
        f"{args.shape} (default precision): flash attention on the cache "
        f"{flash_cache_attention_ok(dev)}, fused silu*mul {silu_mul_fused_ok(dev)}, in-place "
        f"addmm {addmm_fp32_ok(dev)}, fused norms {rms_norm_fused_ok(dev)}, fused QKV epilogue "
        f"{fused_epilogue_ok(dev)}"
    )
    backend.set_prefix_reuse(False)  # a fresh prompt: nothing reused
    _report(f"fresh prompt of {args.prompt_tokens}", backend, ids[: args.prompt_tokens], None)
    backend.set_prefix_reuse(True)
    held = ids[: args.context]
    turn = ids[: args.context + args.turn_tokens]
    _report(f"turn of {args.turn_tokens} on a held {args.context}", backend, turn, held)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
