"""`monokernel` command line: `run` generates; `bench` measures (see `monokernel bench -h`)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence

from monokernel.errors import MonokernelError

_SUBCOMMANDS = {
    # name -> module with `main(argv) -> int`, imported only when used
    "bench": "monokernel.bench.cli",
    "serve": "monokernel.serve.cli",
    "roofline": "monokernel.roofline.cli",
    "agent-bench": "monokernel.workloads.cli",
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
    p.add_argument("--engine", default="auto", choices=["auto", "reference", "torch", "monokernel"])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel GPUs for one request (monokernel engine, N Hopper GPUs)",
    )
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None, help="context size to allocate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap PROMPT in the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    return p


def cmd_run(argv: Sequence[str]) -> int:
    from monokernel.runtime.engine import Engine, EngineConfig
    from monokernel.runtime.sampling import SamplingParams

    args = _run_parser().parse_args(argv)
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
    )
    engine = Engine(args.model, config)
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
                }
            )
        )
    else:
        sys.stdout.write("\n")
        print(
            f"[{engine.engine_name} on {engine.device}] prompt: {t.prompt_tokens} tokens, "
            f"TTFT {t.ttft_s * 1e3:.1f} ms ({t.prompt_tok_s:.1f} tok/s) | decode: "
            f"{t.generated_tokens} tokens, {t.decode_tok_s:.2f} tok/s | finish: "
            f"{final.finish_reason}",
            file=sys.stderr,
        )
    engine.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ["run", *_SUBCOMMANDS]
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: monokernel {" + ",".join(commands) + "} ...\n\n"
            "  run     generate text from a prompt\n"
            "  bench   measure decode speed and TTFT per engine\n"
            "  serve   OpenAI-compatible HTTP server with a playground\n"
            "  roofline     bandwidth ceiling on batch-1 tokens/s per model and GPU\n"
            "  agent-bench  time a scripted coding-agent session (prefill/decode/tool)\n\n"
            "`monokernel COMMAND -h` for a command's options."
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
                print(f"monokernel: `{command}` is not part of this build yet", file=sys.stderr)
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
