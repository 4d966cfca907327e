"""Time build variants of the monokernel side by side in one process (GPU machine).

    PYTHONPATH=src python3 tools/kernel_variants.py --shapes llama-3.2-1b \
        --variant base= --variant dpre1=-DMK_D_PRE=1 --json out.json

Each variant is a set of -D tuning defines (MONOKERNEL_NVCC_FLAGS, part of the build's cache
key) and/or settings of monokernel/envs.py (e.g. ``group=MONOKERNEL_ATTN_GROUP_FROM=1``,
which a loaded build carries; any other the backend reads when it is built); all variants
of a shape run on the same random
weights and prompt, interleaved over rounds so drift in clocks or temperature hits every
variant alike. Reports the median µs/token, MBU against the copy bandwidth measured in this
run, the stage profile, and how many greedy tokens agree with the first variant (a different
reduction order may flip a near-tie, so this is a sanity figure, not a test).

Where the buffers lie moves the speed too (the hand-off buffer up to ~1% on
Qwen2.5-Coder-1.5B, the weights' copy a few µs). So variants that differ only in -D defines
run on one backend, whose kernels are swapped between timings (``load_kernels`` /
``use_kernels``): the same weights, KV cache and hand-off buffer (``--own-weights``: a
backend each, as variants with settings other than BUILD_SETTINGS always get; they still
share the first one's hand-off buffer, unless ``--own-handoff``).

``--tp N`` runs each variant at N GPUs (the TP backend's ranks swap their kernels
together; each rank keeps its own hand-off buffer), the MBU over a rank's share of the
bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys

import torch

from monokernel import envs
from monokernel.bench.measure import bytes_per_token, copy_bandwidth, time_request
from monokernel.models.shapes import SHAPES
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.backends.monokernel import MonokernelBackend
from monokernel.runtime.backends.monokernel.kernel import KernelBuild
from monokernel.runtime.backends.monokernel.tp import MonokernelTPBackend
from monokernel.runtime.sampling import SamplingParams
from monokernel.weights.quantize import QUANTIZE_METHODS
from monokernel.weights.random_weights import random_weights


def _tokens(backend: MonokernelBackend, prompt: list[int], n: int) -> list[int]:
    req = DecodeRequest(tuple(prompt), SamplingParams(temperature=0.0), n, frozenset())
    return list(backend.stream(req, CancelToken()))


Backend = MonokernelBackend | MonokernelTPBackend
# Settings a loaded build carries (kernel.py KernelBuild), so variants that differ in them
# share one backend like -D variants: a 32B model fits an 80 GB GPU once, not twice.
BUILD_SETTINGS = frozenset({"MONOKERNEL_ATTN_GROUP_FROM"})
Builds = KernelBuild | list[KernelBuild]  # a TP backend's: one a rank


def _select(backends: dict[str, Backend], kernels: dict[str, Builds], name: str) -> Backend:
    """The backend of variant ``name``, launching that variant's kernels."""
    b = backends[name]
    b.use_kernels(kernels[name])
    return b


def _agree(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="llama-3.2-1b,qwen2.5-coder-1.5b")
    ap.add_argument("--variant", action="append", default=[], help="NAME=FLAGS")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--own-handoff", action="store_true", help="each variant its own hand-off buffer"
    )
    ap.add_argument(
        "--own-weights", action="store_true", help="each variant its own backend and weights"
    )
    ap.add_argument(
        "--quantize",
        choices=QUANTIZE_METHODS,
        help="the layers' weight format (--quantize)",
    )
    ap.add_argument("--tp", type=int, default=1, help="GPUs each variant runs on")
    ap.add_argument("--json", dest="json_file")
    args = ap.parse_args(argv)
    variants = [v.split("=", 1) for v in args.variant] or [["default", ""]]
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    results: list[dict] = []
    for shape in args.shapes.split(","):
        cfg = SHAPES[shape]
        # --tp shards from the host, as the engine does (drawn on the GPU: seconds, not minutes).
        store = "cpu" if args.tp > 1 else None
        weights = random_weights(cfg, device=device, seed=0, store=store)
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, cfg.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
        max_len = args.prompt_tokens + args.gen_tokens + 1
        bpt = bytes_per_token(cfg, args.prompt_tokens + args.gen_tokens / 2, fmt=args.quantize)
        bpt /= args.tp  # a rank's share (each streams its columns and vocabulary range)
        backends: dict[str, Backend] = {}
        kernels: dict[str, Builds] = {}  # the kernels of each variant
        shared: Backend | None = None
        # One backend for every variant: it may repack the weights in place (a 32B model
        # fits an 80 GB GPU once, not twice).
        settings = {
            name: dict(f.split("=", 1) for f in flags.split() if f.startswith("MONOKERNEL_"))
            for name, flags in variants
        }
        own = {name: bool(env.keys() - BUILD_SETTINGS) for name, env in settings.items()}
        one = not args.own_weights and not any(own.values())
        for name, flags in variants:
            env = settings[name]
            nvcc = " ".join(f for f in flags.split() if not f.startswith("MONOKERNEL_"))
            with envs.overridden(**{**env, "MONOKERNEL_NVCC_FLAGS": nvcc}):
                if own[name] or args.own_weights or shared is None:
                    b: Backend
                    if args.tp > 1:
                        b = MonokernelTPBackend(
                            cfg, weights, max_len, device, args.tp, quantize=args.quantize
                        )
                    else:
                        b = MonokernelBackend(
                            cfg,
                            weights,
                            max_len,
                            device,
                            handoff_search=0,
                            consume_weights=one,
                            quantize=args.quantize,
                        )
                    backends[name], kernels[name] = b, b.kernels
                    if not (own[name] or args.own_weights):
                        shared = b
                else:
                    backends[name], kernels[name] = shared, shared.load_kernels()

        for name, _ in variants:
            time_request(_select(backends, kernels, name), prompt, 32)  # warm-up
        if not args.own_handoff and args.tp == 1:
            # One hand-off buffer for every variant (where it lies moves the speed), unless a
            # variant changes its size.
            first = next(iter(backends.values()))
            for b in backends.values():
                if b.handoff.numel() == first.handoff.numel():
                    b.use_handoff(first.handoff)
        times: dict[str, list[float]] = {name: [] for name, _ in variants}
        for _ in range(args.rounds):
            for name, _ in variants:
                r = time_request(_select(backends, kernels, name), prompt, args.gen_tokens)
                times[name].append(r.decode_s_per_token * 1e6)
        ref_tokens: list[int] | None = None
        for name, flags in variants:
            b = _select(backends, kernels, name)
            toks = _tokens(b, prompt, args.gen_tokens)
            ref_tokens = ref_tokens or toks
            prof = b.profile_step(prompt, args.gen_tokens, args.gen_tokens // 2)
            us = statistics.median(times[name])
            results.append(
                {
                    "shape": shape,
                    "variant": name,
                    "flags": flags,
                    "us_per_token": us,
                    "runs": times[name],
                    "mbu": bpt / (us * 1e-6) / bw,
                    "greedy_agree": _agree(ref_tokens, toks),
                    "profile": prof,
                }
            )
            if b is not shared:
                b.close()
        if shared is not None:
            for name, build in kernels.items():
                if backends[name] is shared:
                    shared.unload_kernels(build)  # all but the build it launches
            shared.close()
        # Nothing of this shape may stay alive while the next one is drawn and packed (an
        # 80 GB GPU ran out of memory at the 14B after the 7B and the 8B).
        del backends, kernels, weights, shared, b
        gc.collect()
        torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name(device)
    print(
        f"device: {dev} | copy bw {bw / 1e9:.0f} GB/s | prompt {args.prompt_tokens} "
        f"gen {args.gen_tokens} | tp {args.tp}"
    )
    stages = "ABCDEF"
    head = " ".join(f"{s:>9}" for s in stages)
    print(f"{'shape':<19} {'variant':<12} {'µs/tok':>7} {'MBU':>6} {'agree':>5} {head}")
    for r in results:
        p = r["profile"]
        cells = " ".join(
            f"{p.get(s + '.work', 0):>4.0f}+{p.get(s + '.wait', 0):<4.0f}" for s in stages
        )
        print(
            f"{r['shape']:<19} {r['variant']:<12} {r['us_per_token']:>7.1f} "
            f"{r['mbu'] * 100:>5.1f}% {r['greedy_agree']:>5} {cells}"
        )
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(
                {"device": dev, "copy_bw": bw, "tp": args.tp, "results": results}, f, indent=2
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
