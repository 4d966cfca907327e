"""Does where the hand-off vectors lie in memory move decode speed? (GPU machine.)

    PYTHONPATH=src python3 scripts/placement_probe.py --shape qwen2.5-coder-1.5b --json out.json

The same cubin loaded twice in one process can differ by ~1% (12 µs/token on
Qwen2.5-Coder-1.5B; docs/perf-notes.md step 48 has this probe's findings). What differs
between two loads is where the buffers land. This probe keeps two backends (two copies of the
weights) and moves only the tagged hand-off buffer (x, qkv, delta, attn_out, act and the
attention partials, one tensor: MonokernelBackend.use_handoff) between placements inside one
pool: byte offsets from a 2 MB boundary, the pool's pages being 2 MB (the low 21 bits of a
virtual address are the physical address's). Each placement is timed on both backends,
interleaved over rounds, so a row's spread between backends is the weights' placement and a
column's spread the hand-offs'.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from monokernel.bench.measure import copy_bandwidth, time_request
from monokernel.bench.shapes import SHAPES, random_weights
from monokernel.runtime.backends.monokernel import MonokernelBackend

PAGE = 2 << 20


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="qwen2.5-coder-1.5b")
    ap.add_argument("--offsets", default="0,4,8,16,32,64,128,256,512,1024",
                    help="KB from a 2 MB boundary")  # fmt: skip
    ap.add_argument("--pages", default="3,5", help="2 MB pages of the pool, each at +0")
    ap.add_argument("--backends", type=int, default=2, help="copies of the weights")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=512)
    ap.add_argument("--json", dest="json_file")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    cfg = SHAPES[args.shape]
    weights = random_weights(cfg, device=device, seed=0)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
    max_len = args.prompt_tokens + args.gen_tokens + 1
    backends = [
        MonokernelBackend(cfg, weights, max_len, device, handoff_search=0)
        for _ in range(args.backends)
    ]
    n = backends[0].handoff.numel()
    pages = [int(k) for k in args.pages.split(",") if k]
    npages = max([*pages, 7]) + 2
    pool = torch.empty(npages * PAGE // 4, dtype=torch.float32, device=device)
    base = (-pool.data_ptr()) % PAGE // 4  # first 2 MB boundary in the pool, in floats

    def at(nbytes: int) -> list[torch.Tensor]:  # one buffer, nbytes past that boundary
        o = base + nbytes // 4
        return [pool[o : o + n]] * len(backends)

    owns = [b.handoff for b in backends]
    placements = {"own": owns}
    placements |= {f"{kb}K": at(int(kb) * 1024) for kb in args.offsets.split(",")}
    placements |= {f"page+{k},0K": at(k * PAGE) for k in pages}
    for b in backends:
        time_request(b, prompt, 32)  # warm-up
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for name, bufs in placements.items():
            for i, b in enumerate(backends):
                b.use_handoff(bufs[i])
                t = time_request(b, prompt, args.gen_tokens)
                times.setdefault((name, i), []).append(t.decode_s_per_token * 1e6)
    for i, b in enumerate(backends):
        b.use_handoff(owns[i])
    print(f"device: {torch.cuda.get_device_name(device)} | copy bw {bw / 1e9:.0f} GB/s | "
          f"{args.shape} | prompt {args.prompt_tokens} gen {args.gen_tokens}")  # fmt: skip
    nb = len(backends)
    print(f"{'placement':<12} {'addr mod 2MB':>12}" + "".join(f" {'backend ' + str(i):>10}"
                                                          for i in range(nb)))  # fmt: skip
    rows = []
    for name, bufs in placements.items():
        med = [statistics.median(times[(name, i)]) for i in range(nb)]
        addr = [t.data_ptr() % PAGE for t in bufs]
        rows.append({"placement": name, "addr_mod_2mb": addr, "us_per_token": med,
                     "rounds": [times[(name, i)] for i in range(nb)]})  # fmt: skip
        print(f"{name:<12} {addr[0]:>12x}" + "".join(f" {m:>10.1f}" for m in med))
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "copy_bw": bw,
                       "shape": args.shape, "rows": rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
