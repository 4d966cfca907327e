"""``monokernel bench``: decode µs/token, tok/s, TTFT and MBU per engine, side by side.

Random bf16 weights in a named real shape unless ``--model`` names a checkpoint; every
engine runs the same prompt in the same process, and MBU uses the copy bandwidth measured in
this run. Prints a table; ``--json`` writes every number to a file.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
from typing import Any

import torch

from monokernel.bench.measure import bytes_per_token, copy_bandwidth, time_request
from monokernel.bench.shapes import SHAPES, random_weights
from monokernel.models.config import ModelConfig
from monokernel.weights.names import Weights

ENGINE_CLASSES = {
    "monokernel": ("monokernel.runtime.backends.monokernel", "MonokernelBackend"),
    "torch": ("monokernel.runtime.backends.torch_compiled", "TorchBackend"),
    "reference": ("monokernel.runtime.backends.reference", "ReferenceBackend"),
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="monokernel bench", description=__doc__)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint (dir, .gguf or hub id); default: --shape")
    src.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    ap.add_argument("--engines", default="monokernel,torch", help="comma-separated")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3, help="timed requests per engine")
    ap.add_argument("--json", dest="json_file", help="write the results here")
    ap.add_argument(
        "--profile", action="store_true", help="monokernel: time each stage of one step"
    )
    return ap


def _load(args: argparse.Namespace, device: torch.device) -> tuple[ModelConfig, Weights, str]:
    if args.model:
        from monokernel.weights.loader import load_checkpoint

        ckpt = load_checkpoint(args.model)
        weights = {k: v.to(device=device, dtype=torch.bfloat16) for k, v in ckpt.weights.items()}
        return ckpt.config, weights, args.model
    cfg = SHAPES[args.shape]
    return cfg, random_weights(cfg, device=device, seed=0), f"{args.shape} (random bf16)"


def _bench_engine(
    name: str, cfg: ModelConfig, weights: Weights, args: argparse.Namespace
) -> dict[str, Any]:
    import importlib

    module, cls = ENGINE_CLASSES[name]
    device = torch.device("cuda")
    max_len = args.prompt_tokens + args.gen_tokens + 1
    backend = getattr(importlib.import_module(module), cls)(cfg, weights, max_len, device)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
    gen_tokens = args.gen_tokens
    repeats = args.repeats
    if name == "reference":  # eager, one op at a time: a short run tells its speed
        gen_tokens, repeats = min(gen_tokens, 64), 1
    time_request(backend, prompt, min(gen_tokens, 32))  # warm-up: build, compile, capture
    runs = [time_request(backend, prompt, gen_tokens) for _ in range(repeats)]
    profile = None
    if args.profile and hasattr(backend, "profile_step"):
        profile = backend.profile_step(prompt, gen_tokens, gen_tokens // 2)
    backend.close()
    del backend
    gc.collect()
    torch.cuda.empty_cache()
    per_tok = statistics.median(r.decode_s_per_token for r in runs)
    return {
        "us_per_token": per_tok * 1e6,
        "tok_per_s": 1.0 / per_tok,
        "ttft_ms": statistics.median(r.ttft_s for r in runs) * 1e3,
        "tokens": runs[0].tokens,
        "runs_us_per_token": [r.decode_s_per_token * 1e6 for r in runs],
        **({"stage_profile_us": profile} if profile else {}),
    }


def _table(res: dict[str, Any]) -> str:
    lines = [
        f"device: {res['device']} | model: {res['model']} | prompt {res['prompt_tokens']} "
        f"gen {res['gen_tokens']} | copy bw {res['copy_bw_GBps']:.0f} GB/s | "
        f"{res['bytes_per_token'] / 1e9:.3f} GB/token (floor {res['floor_us']:.0f} µs)",
        f"{'engine':<11} {'µs/token':>9} {'tok/s':>8} {'TTFT ms':>8} {'MBU':>6} {'vs torch':>9}",
    ]
    for name, e in res["engines"].items():
        if "error" in e:
            lines.append(f"{name:<11} error: {e['error']}")
            continue
        ratio = f"{e['speedup_vs_torch']:.2f}x" if e.get("speedup_vs_torch") else "-"
        lines.append(
            f"{name:<11} {e['us_per_token']:>9.1f} {e['tok_per_s']:>8.1f} {e['ttft_ms']:>8.2f} "
            f"{e['mbu'] * 100:>5.1f}% {ratio:>9}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("monokernel bench needs an NVIDIA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    cfg, weights, label = _load(args, device)
    bw = copy_bandwidth(device)
    bpt = bytes_per_token(cfg, args.prompt_tokens + args.gen_tokens / 2)
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "host": platform.node(),
        "model": label,
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "copy_bw_GBps": bw / 1e9,
        "bytes_per_token": bpt,
        "floor_us": bpt / bw * 1e6,
        "engines": {},
    }
    for name in [e.strip() for e in args.engines.split(",") if e.strip()]:
        if name not in ENGINE_CLASSES:
            print(
                f"unknown engine {name!r}; choose from {', '.join(ENGINE_CLASSES)}", file=sys.stderr
            )
            return 2
        try:
            e = _bench_engine(name, cfg, weights, args)
        except Exception as exc:  # one engine failing must not hide the others' numbers
            res["engines"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        e["mbu"] = bpt / (e["us_per_token"] * 1e-6) / bw
        res["engines"][name] = e
    torch_us = res["engines"].get("torch", {}).get("us_per_token")
    for e in res["engines"].values():
        if torch_us and "us_per_token" in e:
            e["speedup_vs_torch"] = torch_us / e["us_per_token"]
    print(_table(res))
    for name, e in res["engines"].items():
        if "stage_profile_us" in e:
            prof = e["stage_profile_us"]
            print(
                f"{name} stage profile (µs in one step, summed over layers): "
                + ", ".join(f"{k} {v:.1f}" for k, v in prof.items())
            )
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if all("error" not in e for e in res["engines"].values()) else 1
