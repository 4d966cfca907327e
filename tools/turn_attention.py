"""Time prefill attention for an agent's turn (GPU machine): T new queries against a held
conversation's cached keys, one layer, FlashAttention-2 on the cache with the cached keys
split into 1..N chunks (runtime/prefill_attention.py) and the Triton kernel in several
block configurations (runtime/prefill_attention_triton.py), each against SDPA's math.

    PYTHONPATH=src python3 tools/turn_attention.py --context 16384 --turn-tokens 512
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from monokernel.bench.measure import graph_ms
from monokernel.runtime.prefill_attention import (
    flash_cache_attention,
    merge_parts,
    sdpa_case,
    split_count,
    split_parts,
)
from monokernel.runtime.prefill_attention_triton import BLOCKS, triton_cache_attention

SHAPES = {"llama-3.2-1b": (32, 8, 64), "qwen2.5-coder-1.5b": (12, 2, 128)}
# (block_m, block_n, warps, stages) configurations of the Triton kernel timed besides the
# default.
TRITON_SWEEP = (
    (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 4, 3),
    (64, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4), (64, 64, 8, 3),
)  # fmt: skip


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--turn-tokens", type=int, default=512)
    ap.add_argument("--splits", default="1,2,3,4,5,6,8,11,16")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    t, start = args.turn_tokens, args.context
    print(f"device: {torch.cuda.get_device_name(dev)} | {t} queries at [{start}, {start + t})")
    print(f"{'shape':<19} {'splits':>6} {'ms':>7} {'TFLOP/s':>8} {'rel err':>8}")
    for name, (heads, kv_heads, d) in SHAPES.items():
        q, k, v, used, want = sdpa_case(dev, heads, kv_heads, d, start, t, start + t + 64)
        # Score and P.V products, the causal block counted half.
        flops = 4 * heads * d * t * (start + t / 2)
        picked = split_count(t, heads, start, sms)
        for s in (int(x) for x in args.splits.split(",")):
            run = functools.partial(flash_cache_attention, q, k, v, used, s)
            ms = graph_ms(run)
            got = run().float()
            rel = float((got - want).norm() / want.norm())
            mark = "  <- split_count" if s == picked else ""
            print(f"{name:<19} {s:>6} {ms:>7.3f} {flops / ms / 1e9:>8.0f} {rel:>8.1e}{mark}")
        _parts(name, q, k, v, used, max(2, picked))
        for cfg in dict.fromkeys((BLOCKS, *TRITON_SWEEP)):
            run = functools.partial(triton_cache_attention, q, k, v, used, *cfg)
            try:
                ms = graph_ms(run)
                rel = float((run().float() - want).norm() / want.norm())
            except Exception as e:  # a config Triton cannot build here: say so, go on
                print(f"{name:<19} triton {cfg}: {type(e).__name__}: {str(e)[:120]}")
                continue
            mark = "  <- default" if cfg == BLOCKS else ""
            print(f"{name:<19} triton {cfg} {ms:>7.3f} {flops / ms / 1e9:>8.0f} {rel:>8.1e}{mark}")
    return 0


def _parts(name: str, q, k, v, used, splits: int) -> None:
    """The split form's two pieces timed alone: its FA2 calls (the chunks and the causal
    block, with the query copies), and the merge."""
    calls = functools.partial(split_parts, q, k, v, used, splits)
    merge = functools.partial(merge_parts, *calls())
    print(
        f"{name:<19} {splits:>6} parts: FA2 calls {graph_ms(calls):.3f} ms, "
        f"merge {graph_ms(merge):.3f}"
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
