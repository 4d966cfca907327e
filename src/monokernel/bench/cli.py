"""``monokernel bench``: decode µs/token, tok/s, TTFT and MBU per engine, side by side.

Random bf16 weights in a named real shape unless ``--model`` names a checkpoint. Every engine
runs the same prompts in the same process; ``--prompt-tokens`` and ``--gen-tokens`` take comma
lists and sweep every combination; ``--turn-tokens N`` times an agent's next turn instead (the
warm-up's prompt plus N new tokens, prefix reuse). MBU uses the copy bandwidth measured in
this run. Prints a table; ``--json`` writes every number, ``--plot`` draws the figures
(docs/benchmarks.md). ``--workload`` runs agent-shaped prompts without and with speculative
decoding instead (bench/spec.py, docs/speculative.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from monokernel.bench.engines import (
    BACKENDS,
    ENGINES,
    GPU_ONLY,
    CheckpointWeights,
    EngineOptions,
    WeightSource,
    check_engine_label,
    monokernel_layers,
)
from monokernel.bench.llama_cpp import ENGINE as LLAMA_CPP
from monokernel.bench.llama_cpp import INSTALL_HINT as LLAMA_CPP_HINT
from monokernel.bench.llama_cpp import available as llama_cpp_available
from monokernel.bench.measure import engine_grammar, engine_tp, split_engine
from monokernel.bench.records import prompt_label
from monokernel.bench.sweep import EngineLimits, SweepConfig, run_benchmark
from monokernel.bench.table import format_table
from monokernel.cli.validate import positive_int
from monokernel.models.config import ModelConfig
from monokernel.models.shapes import SHAPES
from monokernel.runtime.speculative import DEFAULT_DRAFT
from monokernel.weights.random_weights import random_weights
from monokernel.workloads.spec_workloads import WORKLOADS

# The module docstring's words for --help, without the reST quoting a terminal would show.
_DESCRIPTION = (
    "Decode µs/token, tok/s, TTFT and MBU per engine, side by side. Random bf16 weights in a "
    "named real shape unless --model names a checkpoint. Every engine runs the same prompts "
    "in the same process; --prompt-tokens and --gen-tokens take comma lists and sweep every "
    "combination; --turn-tokens N times an agent's next turn instead (the warm-up's prompt "
    "plus N new tokens, prefix reuse). MBU uses the copy bandwidth measured in this run. "
    "Prints a table; --json writes every number, --plot draws the figures "
    "(docs/benchmarks.md). --workload runs agent-shaped prompts without and with speculative "
    "decoding instead (docs/speculative.md)."
)

# The reference engine runs one eager op at a time: a short run tells its speed, and a
# long one would take most of the bench's time (the behaviour before sweeps existed).
DEFAULT_LIMITS = {"reference": EngineLimits(gen_cap=64, repeats=1)}
_LIMIT_KEYS = {"max-prompt": "max_prompt", "max-gen": "max_gen", "gen-cap": "gen_cap"}
_LIMIT_KEYS["repeats"] = "repeats"
# The sweep's defaults, filled in after parsing so --workload can tell what was given.
DEFAULT_SHAPE = "llama-3.2-1b"
DEFAULT_ENGINES = "monokernel,torch"
WORKLOAD_ENGINES = "torch"
# Sweep-only flags and their unset values: --workload refuses them rather than ignore them.
_SWEEP_ONLY = {
    "shape": None,
    "prompt_tokens": None,
    "turn_tokens": 0,
    "profile": False,
    "plot": None,
    "endpoint": None,
    "llama_cpp": False,
    "grammar": None,
    "limit": [],
    "hf_cache": "static",
    "endpoint_model": None,
    "endpoint_api_key": None,
    "endpoint_prompt": "ids",
    "llama_cpp_threads": None,
    "seed": 0,
}


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def nonnegative_int(text: str) -> int:
    if not text.strip().isdecimal():  # refuses "-1" as well as "abc"
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def workload_list(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown workload {', '.join(unknown) or repr(text)}; choose from "
            f"{', '.join(WORKLOADS)}"
        )
    return names


def parse_limits(specs: list[str]) -> dict[str, EngineLimits]:
    """``ENGINE:KEY=N`` (keys: max-prompt, max-gen, gen-cap, repeats; N=0 lifts a limit) on
    top of DEFAULT_LIMITS."""
    fields: dict[str, dict[str, int | None]] = {
        name: {f: getattr(lim, f) for f in _LIMIT_KEYS.values()}
        for name, lim in DEFAULT_LIMITS.items()
    }
    for spec in specs:
        engine, _, rest = spec.partition(":")
        key, _, value = rest.partition("=")
        if engine not in ENGINES or key not in _LIMIT_KEYS or not value.isdigit():
            raise ValueError(
                f"bad --limit {spec!r}: expected ENGINE:KEY=N with ENGINE in {', '.join(ENGINES)} "
                f"and KEY in {', '.join(_LIMIT_KEYS)}"
            )
        entry = fields.setdefault(engine, dict.fromkeys(_LIMIT_KEYS.values()))
        entry[_LIMIT_KEYS[key]] = int(value) or None
    return {name: EngineLimits(**f) for name, f in fields.items()}  # type: ignore[arg-type]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="monokernel bench", description=_DESCRIPTION)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint (dir, .gguf or hub id); default: --shape")
    src.add_argument("--shape", choices=sorted(SHAPES), help=f"default {DEFAULT_SHAPE}")
    ap.add_argument(
        "--engines",
        help=f"comma-separated: {', '.join(ENGINES)}; ENGINE:fp8 or ENGINE:int8 (our engines) "
        "quantises the layers' weights at load (--quantize), e.g. monokernel,monokernel:fp8,torch; "
        f"monokernel@tp2 runs it over 2 GPUs (--tp 2); default {DEFAULT_ENGINES} "
        f"(--workload: {WORKLOAD_ENGINES})",
    )
    ap.add_argument("--prompt-tokens", type=int_list, help="e.g. 128,512,2048 (default 64)")
    ap.add_argument(
        "--gen-tokens",
        type=int_list,
        help="e.g. 512,2048,8192 (default 512); with --workload one value, every request's "
        "cap (default: each workload's own)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        help="timed requests per engine and cell (default 3; --workload: 1)",
    )
    ap.add_argument(
        "--workload",
        type=workload_list,
        metavar="NAMES",
        help="instead of the sweep: greedy runs of agent-shaped prompts without and with "
        f"--speculative ngram, comma-separated from {', '.join(WORKLOADS)} (needs a model "
        "with a chat template: --model, default the default model; docs/speculative.md)",
    )
    ap.add_argument(
        "--num-speculative-tokens",
        type=int_list,
        metavar="K",
        help="with --workload: the drafts' K, comma-separated, each run against no drafts "
        f"(default {DEFAULT_DRAFT}, as run's)",
    )
    for bound in ("max", "min"):
        ap.add_argument(
            f"--ngram-{bound}",
            type=positive_int,
            metavar="N",
            help=f"with --workload: the drafts' {bound}imum suffix match, as run's (default "
            "each engine's, as run's)",
        )
    ap.add_argument(
        "--turn-tokens",
        type=nonnegative_int,
        default=0,
        metavar="N",
        help="time an agent's next turn: every timed request is the warm-up's prompt plus N "
        "new tokens, so a prefix cache (monokernel) prefills only those (default 0: a fresh "
        "prompt per request)",
    )
    ap.add_argument(
        "--context",
        type=nonnegative_int,
        default=0,
        metavar="N",
        help="cache positions every engine allocates (as --max-model-len would; default 0: "
        "what each cell needs)",
    )
    ap.add_argument("--json", dest="json_file", help="write the results here (after every cell)")
    ap.add_argument("--plot", metavar="DIR", help="write PNG figures here (needs matplotlib)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="monokernel: time each stage of one step (every GPU's under @tpN)",
    )
    ap.add_argument("--device", default="auto", help="auto | cuda | cuda:N | cpu")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="ENGINE:KEY=N",
        help="spare a slow engine: max-prompt / max-gen (skip larger cells), gen-cap (time "
        "fewer tokens), repeats; default reference:gen-cap=64 and reference:repeats=1",
    )
    ap.add_argument(
        "--hf-cache",
        choices=["static", "dynamic"],
        default="static",
        help="hf engine's KV cache; static (generate compiles the decode step on CUDA) falls "
        "back to dynamic if it fails",
    )
    ap.add_argument("--endpoint", metavar="URL", help="also time an OpenAI-compatible server")
    ap.add_argument("--endpoint-model", metavar="NAME", help="default: the first of /v1/models")
    ap.add_argument("--endpoint-api-key", metavar="KEY")
    ap.add_argument(
        "--endpoint-prompt", choices=["ids", "text"], default="ids", help="send token ids or text"
    )
    ap.add_argument(
        "--llama-cpp",
        action="store_true",
        help="also time llama.cpp (llama-cpp-python, if installed) on the --model GGUF file",
    )
    ap.add_argument(
        "--llama-cpp-threads", type=int, metavar="N", help="llama.cpp's threads (default: torch's)"
    )
    ap.add_argument(
        "--time-budget", type=float, metavar="S", help="start no new cell after S seconds"
    )
    ap.add_argument(
        "--grammar",
        metavar="REGEX",
        help="constrain every request of a +grammar engine (monokernel+grammar) by this "
        "regex, to time constrained decoding beside the same engine unconstrained; needs "
        "llguidance (with --shape: over a small tokenizer padded to the shape's vocabulary)",
    )
    ap.add_argument("--seed", type=int, default=0, help="weights and prompts")
    return ap


def _device(spec: str) -> torch.device:
    """The bench's device, with its index: every engine of the run opens on that one GPU
    (a @tpN engine from it on), whichever GPU an engine before it left current."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(spec)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _load(
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    need_weights: bool,
    names: Sequence[str] = (),
) -> tuple[ModelConfig, WeightSource | None, str, tuple[Path, str | None] | None]:
    """The model's config, weights, label and (with --model) where its tokenizer lies;
    ``names``: the engines of the run."""
    if args.model:
        from monokernel.weights.loader import load_checkpoint, run_formats

        # Read as run reads it: safetensors straight to the device in the bench's dtype (on
        # the host where @tpN ranks shard them, or no engine here computes with them); a
        # GGUF's blocks on the host, its layer matrices made only for the engines that
        # compute with them (CheckpointWeights).
        tp = any(engine_tp(n) > 1 for n in names)
        store = device if need_weights and not tp else None
        ckpt = load_checkpoint(args.model, device=store, dtype=dtype if need_weights else None)
        weights = CheckpointWeights(ckpt, dtype) if need_weights else None
        label = args.model
        if ckpt.quantization is not None:
            layers = monokernel_layers(ckpt.config, run_formats(ckpt, None))
            # The table's header says what the monokernel's rows ran (each record, at its
            # own --tp, says it again: layer_format).
            label += f" ({ckpt.quantization} checkpoint; the monokernel streams {layers.label})"
        return ckpt.config, weights, label, (ckpt.tokenizer_dir, ckpt.gguf_file)
    cfg = SHAPES[args.shape]
    # Made afresh for each engine (a second of GPU time at 32B), so no engine's copy of the
    # model lives beside another's.
    fresh = functools.partial(random_weights, cfg, device=device, dtype=dtype, seed=args.seed)
    return (
        cfg,
        fresh if need_weights else None,
        f"{args.shape} (random {str(dtype).removeprefix('torch.')})",
        None,
    )


def _engines(args: argparse.Namespace) -> list[str]:
    names = [e.strip() for e in args.engines.split(",") if e.strip()]
    if args.endpoint and "endpoint" not in names:
        names.append("endpoint")
    if args.llama_cpp and LLAMA_CPP not in names:
        names.append(LLAMA_CPP)
    return list(dict.fromkeys(names))


def _profile_lines(doc: dict[str, Any]) -> list[str]:
    return [
        f"{c['engine']} stage profile at prompt "
        f"{prompt_label(c['prompt_tokens'], c['turn_tokens'])} gen {c['gen_tokens']} "
        "(µs in one step, summed over layers): "
        + ", ".join(f"{k} {v:.1f}" for k, v in c["stage_profile_us"].items())
        for c in doc["cells"]
        if "stage_profile_us" in c
    ]


def _workload_main(args: argparse.Namespace) -> int:
    """``--workload``: the speculative-decoding runs (bench/spec.py) instead of the sweep."""
    from monokernel.bench.spec import engine_error, run_workloads

    given = [
        "--" + k.replace("_", "-") for k, unset in _SWEEP_ONLY.items() if getattr(args, k) != unset
    ]
    if given:
        print(f"monokernel bench: --workload does not take {', '.join(given)}", file=sys.stderr)
        return 2
    if args.gen_tokens is not None and len(args.gen_tokens) != 1:
        print("monokernel bench: --workload takes one --gen-tokens value", file=sys.stderr)
        return 2
    args.engines = args.engines or WORKLOAD_ENGINES
    args.num_speculative_tokens = args.num_speculative_tokens or (DEFAULT_DRAFT,)
    names = [e.strip() for e in args.engines.split(",") if e.strip()]
    why = engine_error(names, args.num_speculative_tokens, args.ngram_max, args.ngram_min)
    if why is not None:
        print(f"monokernel bench: {why}", file=sys.stderr)
        return 2
    device = _device(args.device)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    try:
        return run_workloads(args, list(dict.fromkeys(names)), device, dtype)
    except ValueError as e:
        print(f"monokernel bench: {e}", file=sys.stderr)
        return 2


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.workload:
        return _workload_main(args)
    for flag in ("num_speculative_tokens", "ngram_max", "ngram_min"):
        if getattr(args, flag) is not None:
            name = "--" + flag.replace("_", "-")
            print(f"monokernel bench: {name} needs --workload", file=sys.stderr)
            return 2
    args.shape = args.shape or DEFAULT_SHAPE
    args.engines = args.engines or DEFAULT_ENGINES
    args.prompt_tokens = args.prompt_tokens or (64,)
    args.gen_tokens = args.gen_tokens or (512,)
    args.repeats = 3 if args.repeats is None else args.repeats
    names = _engines(args)
    for n in names:
        if (why := check_engine_label(n)) is not None:
            print(why, file=sys.stderr)
            return 2
    if "endpoint" in names and not args.endpoint:
        print("engine 'endpoint' needs --endpoint URL", file=sys.stderr)
        return 2
    if LLAMA_CPP in names:
        if not llama_cpp_available():
            print(LLAMA_CPP_HINT, file=sys.stderr)
            return 2
        if not (args.model or "").endswith(".gguf"):
            print("engine 'llama.cpp' runs a GGUF file: pass --model FILE.gguf", file=sys.stderr)
            return 2
    device = _device(args.device)
    gpu_only = [n for n in names if split_engine(n)[0] in GPU_ONLY]
    if device.type != "cuda" and gpu_only:
        print(
            f"monokernel bench needs an NVIDIA GPU for engine(s) {', '.join(gpu_only)} "
            "(on the CPU: --engines reference,torch,hf,endpoint,llama.cpp)",
            file=sys.stderr,
        )
        return 2
    try:
        limits = parse_limits(args.limit)
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(
            args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32
        )
        sweep = SweepConfig(
            engines=tuple(names),
            prompt_tokens=args.prompt_tokens,
            gen_tokens=args.gen_tokens,
            repeats=args.repeats,
            turn_tokens=args.turn_tokens,
            context=args.context,
            seed=args.seed,
            profile=args.profile,
            limits=limits,
            time_budget_s=args.time_budget,
            options=EngineOptions(
                hf_cache=args.hf_cache,
                endpoint_url=args.endpoint,
                endpoint_model=args.endpoint_model,
                endpoint_api_key=args.endpoint_api_key,
                endpoint_prompt=args.endpoint_prompt,
                gguf_path=args.model if LLAMA_CPP in names else None,
                # Read now: a CPU engine run before it may have lowered torch's count
                # (runtime/cpu_threads.py).
                threads=args.llama_cpp_threads or torch.get_num_threads(),
            ),
        )
    except ValueError as e:
        print(f"monokernel bench: {e}", file=sys.stderr)
        return 2
    need_weights = any(split_engine(n)[0] in (*BACKENDS, "hf") for n in names)
    cfg, weights, label, tokenizer = _load(args, device, dtype, need_weights, names)
    if any(engine_grammar(n) for n in names):
        if not args.grammar:
            print("a +grammar engine needs --grammar REGEX", file=sys.stderr)
            return 2
        from monokernel.bench.grammar import matcher_factory
        from monokernel.runtime.constrained import ConstraintError

        try:
            grammar = matcher_factory(args.grammar, cfg.vocab_size, *(tokenizer or (None,)))
        except ConstraintError as e:
            print(f"monokernel bench: --grammar: {e}", file=sys.stderr)
            return 2
        sweep = dataclasses.replace(
            sweep, options=dataclasses.replace(sweep.options, grammar=grammar)
        )
    recorded = {k: v for k, v in vars(args).items() if k != "endpoint_api_key"}  # no secrets
    doc = run_benchmark(
        cfg, weights, label, sweep, device, recorded, dtype, json_path=args.json_file
    )
    print(format_table(doc))
    for line in _profile_lines(doc):
        print(line)
    if args.plot:
        from monokernel.bench.plot import draw

        try:
            for path in draw(doc, args.plot):
                print(f"figure: {path}")
        except ImportError:
            print("--plot needs matplotlib: pip install 'monokernel[bench]'", file=sys.stderr)
            return 1
    return 0 if all(c["status"] == "ok" for c in doc["cells"]) else 1
