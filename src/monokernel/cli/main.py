"""`monokernel` command line: `run` generates; `bench` measures (see `monokernel bench -h`)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence

from monokernel.cli import validate
from monokernel.errors import MonokernelError

_MAX_TOKENS = 256

_SUBCOMMANDS = {
    # name -> module with `main(argv) -> int`, imported only when used
    "bench": "monokernel.bench.cli",
    "serve": "monokernel.serve.cli",
    "roofline": "monokernel.roofline.cli",
    "agent-bench": "monokernel.workloads.cli",
    "perplexity": "monokernel.runtime.perplexity_cli",
}


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="monokernel run",
        description="Generate text from a prompt, streaming it to stdout; timings on stderr.",
    )
    p.add_argument("prompt", help="the prompt text (with --chat: one user message)")
    p.add_argument(
        "--model",
        default=None,
        help="HF directory, .gguf file or hub id (default: SmolLM2-135M-Instruct, downloaded once)",
    )
    validate.add_engine_flags(p)
    p.add_argument("--max-tokens", type=validate.positive_int, default=_MAX_TOKENS)
    p.add_argument(
        "--temperature", type=validate.non_negative_float, default=0.0, help="0 = greedy (default)"
    )
    p.add_argument("--top-p", type=validate.probability, default=1.0, help="in (0, 1]")
    p.add_argument("--top-k", type=validate.top_k, default=0, help="0 or -1 = off")
    p.add_argument("--seed", type=validate.non_negative_int, default=None)
    p.add_argument(
        "--stop",
        action="append",
        type=validate.non_empty,
        default=[],
        help="stop string (repeatable)",
    )
    p.add_argument("--chat", action="store_true", help="wrap PROMPT in the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    return p


def _parse_run(argv: Sequence[str]) -> argparse.Namespace:
    """The parsed flags, or exit 2 naming the bad one: everything the user can get wrong is
    refused here, before the model load (tens of seconds) that would otherwise find it."""
    parser = _run_parser()
    args = parser.parse_args(argv)
    if not args.prompt and not args.chat:
        # Engine.encode's rule: a plain prompt must not be empty (a chat turn may be).
        parser.error("argument prompt: must not be empty")
    if args.max_model_len is not None and args.max_tokens >= args.max_model_len:
        parser.error(
            f"argument --max-tokens: {args.max_tokens} leaves no room for the prompt in "
            f"--max-model-len {args.max_model_len}; lower --max-tokens (default {_MAX_TOKENS}) "
            "or raise --max-model-len"
        )
    error = validate.machine_error(args.device, args.engine, args.tp)
    if error is not None:
        parser.error(error)
    args.speculative_config, error = validate.speculative_config(args)
    if error is not None:
        parser.error(error)
    return args


def cmd_run(argv: Sequence[str]) -> int:
    args = _parse_run(argv)
    from monokernel.runtime.engine import Engine, EngineConfig
    from monokernel.runtime.sampling import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    config = EngineConfig(
        engine=args.engine,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        progress=not args.json,
        tp=args.tp,
        quantize=args.quantize,
        speculative=args.speculative_config,
    )
    engine = Engine(args.model, config)
    for note in engine.startup_notes:  # the engine fallback, if any, and the context chosen
        print(note, file=sys.stderr)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    ids = engine.encode(prompt)
    parts: list[str] = []
    token_ids: list[int] = []
    final = None
    for event in engine.generate(prompt, params, prompt_ids=ids):
        if event.token_id is not None:
            token_ids.append(event.token_id)
        else:
            final = event
        if args.json:
            parts.append(event.text)
        elif event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    assert final is not None and final.timings is not None
    t = final.timings
    # The layers' weights as the engine holds them: the quantisation in effect (--quantize,
    # or the checkpoint's own: a Q4_1 GGUF's int4 groups), else the dtype.
    weights = engine.quantize or str(engine.dtype).removeprefix("torch.")
    if args.json:
        print(
            json.dumps(
                {
                    "text": "".join(parts),
                    "token_ids": token_ids,
                    "finish_reason": final.finish_reason,
                    "prompt_tokens": t.prompt_tokens,
                    "ttft_ms": round(t.ttft_s * 1e3, 3),
                    "decode_tok_s": round(t.decode_tok_s, 3),
                    "engine": engine.engine_name,
                    "device": str(engine.device),
                    "weights": weights,
                }
                | (
                    {"drafted_tokens": t.drafted_tokens, "accepted_tokens": t.accepted_tokens}
                    if t.drafted_tokens is not None
                    else {}
                )
            )
        )
    else:
        sys.stdout.write("\n")
        print(
            f"[{engine.engine_name} on {engine.device}, {weights} weights] prompt: "
            f"{t.prompt_tokens} tokens, "
            f"TTFT {t.ttft_s * 1e3:.1f} ms ({t.prompt_tok_s:.1f} tok/s) | decode: "
            f"{t.generated_tokens} tokens, {t.decode_tok_s:.2f} tok/s | finish: "
            f"{final.finish_reason}"
            + (
                f" | speculative: {t.accepted_tokens} of {t.drafted_tokens} drafted tokens accepted"
                if t.drafted_tokens is not None
                else ""
            ),
            file=sys.stderr,
        )
    engine.close()
    return 0


def version() -> str:
    """The installed distribution's version; the package's own when run from a source tree
    that was never installed (no metadata to read)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("monokernel")
    except PackageNotFoundError:
        import monokernel

        return str(getattr(monokernel, "__version__", "unknown"))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ["run", *_SUBCOMMANDS]
    if argv and argv[0] == "--version":
        print(f"monokernel {version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: monokernel [--version] {" + ",".join(commands) + "} ...\n\n"
            "  run     generate text from a prompt\n"
            "  bench   measure decode speed and TTFT per engine\n"
            "  serve   OpenAI-compatible HTTP server with a playground\n"
            "  roofline     bandwidth ceiling on batch-1 tokens/s per model and GPU\n"
            "  agent-bench  time a scripted coding-agent session (prefill/decode/tool)\n"
            "  perplexity   a model's perplexity on a fixed text (to compare --quantize)\n\n"
            "Run 'monokernel COMMAND -h' for a command's options."
        )
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "run":
            return cmd_run(rest)
        if command in _SUBCOMMANDS:
            try:
                module = importlib.import_module(_SUBCOMMANDS[command])
            except ModuleNotFoundError:
                print(f"monokernel: {command!r} is not part of this build yet", file=sys.stderr)
                return 2
            return int(module.main(rest))
    except MonokernelError as e:
        print(f"monokernel: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(
        f"monokernel: unknown command {command!r}; choose from {', '.join(commands)}",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
