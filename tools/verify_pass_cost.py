"""What a verify pass costs on the monokernel (issue 36): µs per pass of 1 to P positions
against the step build's µs per step, teacher-forced on random weights of a shape in one
process (docs/speculative.md). GPU only.

    python tools/verify_pass_cost.py smollm2-135m --quantize int4:32 --positions 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from monokernel import envs
from monokernel.models.shapes import SHAPES
from monokernel.testing.gpu_models import random_ids, row_format, rows_backend
from monokernel.weights.random_weights import random_weights

RELAUNCH_TOKENS = 256  # a --relaunch request's tokens


def _weight_format(text: str) -> str:
    try:
        row_format(text)
    except ValueError as e:  # argparse shows an ArgumentTypeError's words, not a ValueError's
        raise argparse.ArgumentTypeError(f"{e} (e.g. int4:32)") from None
    return text


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument(
        "--quantize",
        default="bf16",
        type=_weight_format,
        help="bf16, fp8, int8 or int4[:GROUP] (rows; int4 in groups of 128 unless GROUP says)",
    )
    ap.add_argument("--positions", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--passes", type=int, default=128, help="passes a timed launch runs")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--relaunch",
        action="store_true",
        help="also what one more launch costs a request (drafted.py's hand-over between the "
        "step and pass builds): 256 greedy tokens in one launch against launches of 8",
    )
    ap.add_argument(
        "--profile", action="store_true", help="also CTA 0's stage profile of a step and a pass"
    )
    ap.add_argument(
        "--skew",
        action="store_true",
        help="-DMK_SKEW=1 builds: every CTA's time at each stage's edges in the middle layer of "
        "a step and of a pass of 1 and of P (median and latest over the CTAs, µs; a pass's "
        "attention points are marked by position, so in a pass of P they come from another "
        "pass)",
    )
    ap.add_argument(
        "--ncu",
        choices=["step", "pass"],
        help="after the timings, one launch of 16 steps or of 16 passes of P positions between "
        "cudaProfilerStart and Stop, for `ncu --profile-from-start off -k mk_decode -c 1`",
    )
    args = ap.parse_args(argv)
    if args.skew:  # every build of this run records the skew points (csrc/probes.cuh)
        flags = f"{envs.MONOKERNEL_NVCC_FLAGS} -DMK_SKEW=1".strip()
        with envs.overridden(MONOKERNEL_NVCC_FLAGS=flags):
            return measure(args)
    return measure(args)


def measure(args: argparse.Namespace) -> int:
    from monokernel.runtime.backends.monokernel.verify_pass import PassKernel

    cfg, dev = SHAPES[args.shape], torch.device("cuda")
    weights = random_weights(cfg, device=dev, seed=51)
    n_max = args.passes * args.positions
    # --relaunch decodes RELAUNCH_TOKENS after the prompt, whatever the passes need.
    total = args.prompt + max(n_max, RELAUNCH_TOKENS if args.relaunch else 0)
    mk = rows_backend(cfg, weights, total, dev, args.quantize)
    seq = random_ids(total, cfg.vocab_size, seed=52)
    mk.teacher_forced_logits(seq[: args.prompt], seq[args.prompt : args.prompt + 8])  # prefill
    forced = torch.tensor(seq[args.prompt - 1 : args.prompt - 1 + args.passes], dtype=torch.int32)
    mk.kernel.timed_decode(forced.to(dev), args.prompt - 1)  # warm-up
    step = min(mk.kernel.timed_decode(forced.to(dev), args.prompt - 1) for _ in range(3))
    passes = PassKernel(mk.kernel, args.positions)
    rows = []
    for n in range(1, args.positions + 1):
        fed = seq[args.prompt - 1 : args.prompt - 1 + args.passes * n]
        passes.teacher_forced(args.prompt - 1, fed, n, logits=False)  # warm-up
        t = min(passes.teacher_forced(args.prompt - 1, fed, n, logits=False)[2] for _ in range(3))
        rows.append({"positions": n, "us_per_pass": t * 1e6, "vs_step": t / step})
    if args.ncu:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        if args.ncu == "step":
            mk.kernel.timed_decode(forced[:16].to(dev), args.prompt - 1)
        else:
            fed = seq[args.prompt - 1 : args.prompt - 1 + 16 * args.positions]
            passes.teacher_forced(args.prompt - 1, fed, args.positions, logits=False)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    profiles = {}
    if args.profile:
        from monokernel.kernels import layout
        from monokernel.runtime.backends.monokernel.probes import stage_profile

        profiles["step"] = mk.probes.profile_step(seq[: args.prompt], 16, 8)
        for n in (1, args.positions):
            buf = torch.zeros(
                layout.timing_words(cfg.num_layers, mk.kernel.grid), dtype=torch.int64, device=dev
            )
            fed = seq[args.prompt - 1 : args.prompt - 1 + 16 * n]
            passes.teacher_forced(args.prompt - 1, fed, n, logits=False, timing=(buf, 8))
            torch.cuda.synchronize()
            profiles[f"pass{n}"] = stage_profile(buf.tolist(), cfg.num_layers)
    if args.skew:
        from monokernel.kernels import layout

        grid, layers = mk.kernel.grid, cfg.num_layers

        def points(raw: list[int]) -> dict[str, tuple[float, float]]:
            per = {name: [raw[layout.skew_slot(layers, c, name)] for c in range(grid)]
                   for name in layout.SKEW_NAMES}  # fmt: skip
            first = min(v for vs in per.values() for v in vs if v)
            return {
                name: (
                    (sorted(v for v in vs if v)[len([v for v in vs if v]) // 2] - first) / 1e3,
                    (max(vs) - first) / 1e3,
                )
                for name, vs in per.items()
                if any(vs)
            }

        skews = {"step": points(mk.probes.timed_run(seq[: args.prompt], 16, 8, skew=True))}
        for n in (1, args.positions):
            size = layout.timing_words(layers, grid, skew=True)
            buf = torch.zeros(size, dtype=torch.int64, device=dev)
            fed = seq[args.prompt - 1 : args.prompt - 1 + 16 * n]
            passes.teacher_forced(args.prompt - 1, fed, n, logits=False, timing=(buf, 8))
            torch.cuda.synchronize()
            skews[f"pass{n}"] = points(buf.tolist())
        print("µs from the layer's first point, median / latest CTA")
        print(f"{'point':<24}" + "".join(f"{n:>16}" for n in skews))
        for name in layout.SKEW_NAMES:
            cells = [skews[n].get(name) for n in skews]
            print(f"{name:<24}" + "".join(
                f"{c[0]:8.2f}{c[1]:8.2f}" if c else f"{'-':>16}" for c in cells))  # fmt: skip
    relaunch = relaunch_cost(mk, seq[: args.prompt]) if args.relaunch else None
    passes.close()
    mk.close()
    out = {"shape": args.shape, "format": args.quantize, "device": torch.cuda.get_device_name(),
           "us_per_step": step * 1e6, "passes": rows, "profiles": profiles,
           "relaunch": relaunch}  # fmt: skip
    if args.json:
        print(json.dumps(out))
    print(f"{args.shape} {args.quantize} on {out['device']}: step {step * 1e6:.1f} µs")
    for r in rows:
        print(f"  pass of {r['positions']}: {r['us_per_pass']:.1f} µs ({r['vs_step']:.3f}x a step)")
    if relaunch is not None:
        us = relaunch["us_per_relaunch"]
        print(f"  one more launch: {us:.1f} µs ({us / (step * 1e6):.3f}x a step); a launch's "
              f"host before it {relaunch['us_host_before_launch']:.1f}, its first token "
              f"{relaunch['us_launch_to_first_token']:.1f}, its return after the last "
              f"{relaunch['us_last_token_to_return']:.1f} µs (medians)")  # fmt: skip
    if profiles:
        names = list(profiles)
        print("µs (CTA 0) " + " ".join(f"{n:>9}" for n in names))
        for key in profiles["step"]:
            print(f"{key:<10} " + " ".join(f"{profiles[n].get(key, 0.0):9.1f}" for n in names))
    return 0


def relaunch_cost(
    mk: Any, prompt: list[int], n: int = RELAUNCH_TOKENS, each: int = 8
) -> dict[str, float]:
    """µs one more launch adds to a greedy request of ``n`` tokens (wall time, host path
    included): the request in launches of ``each`` tokens, each continuing the last
    (RequestDriver.run), against it in one; the best of 3 each. Beside it, the medians
    over the split run's launches of where a launch's time goes: the host before the launch,
    the launch to its first token, the last token to the launch's return."""
    from monokernel.runtime.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)

    started: list[float] = []
    start = mk.kernel.start

    def marked_start(*args: Any, **kwargs: Any) -> None:
        started.append(time.perf_counter())
        start(*args, **kwargs)

    mk.kernel.start = marked_start
    phases: list[tuple[float, float, float]] = []

    def timed(size: int) -> tuple[float, list[int]]:
        tokens, first = list(prompt), True
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while len(tokens) - len(prompt) < n:
            left = min(size, n - (len(tokens) - len(prompt)))
            t_call = time.perf_counter()
            landed = []
            for t in mk.driver.run(tokens, left, greedy, (), None, continued=not first):
                landed.append((t, time.perf_counter()))
            t_done = time.perf_counter()
            phases.append(
                (started[-1] - t_call, landed[0][1] - started[-1], t_done - landed[-1][1])
            )
            tokens += [t for t, _ in landed]
            first = False
        return time.perf_counter() - t0, tokens[len(prompt) :]

    whole = min(timed(n) for _ in range(3))
    phases.clear()
    split = min(timed(each) for _ in range(3))
    mk.kernel.start = start
    if whole[1] != split[1]:
        raise RuntimeError("launches that continue the last gave other tokens than one launch")
    mid = [sorted(p[k] for p in phases[1:])[len(phases) // 2] * 1e6 for k in range(3)]
    return {
        "us_per_relaunch": (split[0] - whole[0]) / (n // each - 1) * 1e6,
        "us_host_before_launch": mid[0],
        "us_launch_to_first_token": mid[1],
        "us_last_token_to_return": mid[2],
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
