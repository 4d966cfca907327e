"""`monokernel agent-bench`: time a scripted coding-agent session on an engine or endpoint."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from monokernel.cli import validate
from monokernel.workloads.agent_loop import (
    AgentLoopConfig,
    ChatClient,
    EndpointClient,
    EngineClient,
    run_agent_loop,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="monokernel agent-bench",
        description=(
            "Run a scripted coding-agent session (plan, patch, read test logs, fix) and "
            "split its wall time into prefill (TTFT), decode and tool time, per turn."
        ),
    )
    target = p.add_mutually_exclusive_group()
    target.add_argument(
        "--model", help="HF directory, .gguf or hub id, run in-process (default model if absent)"
    )
    target.add_argument(
        "--endpoint", help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000"
    )
    p.add_argument("--engine", default="auto", choices=["auto", "reference", "torch", "monokernel"])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (in-process)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=None, help="context to allocate")
    p.add_argument("--served-model", help="model name for --endpoint (default: first listed)")
    p.add_argument("--api-key", help="bearer key for --endpoint")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--gen-tokens", type=int, default=256, help="tokens generated per turn")
    p.add_argument("--tool-sleep", type=float, default=0.0, help="simulated tool seconds per turn")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--allow-eos", action="store_true", help="let a turn end at EOS (default: exact counts)"
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up request")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON too (- = stdout only)")
    validate.add_speculative_flags(p)  # in-process; a server runs with its own
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.tp = 1  # one GPU in-process (speculative_config's rule for --tp)
    if args.endpoint and args.speculative is not None:
        parser.error("argument --speculative: in-process only; a server has `serve --speculative`")
    speculative, error = validate.speculative_config(args)
    if error is not None:
        parser.error(error)
    config = AgentLoopConfig(
        turns=args.turns,
        gen_tokens=args.gen_tokens,
        tool_sleep_s=args.tool_sleep,
        temperature=args.temperature,
        seed=args.seed,
        ignore_eos=not args.allow_eos,
        warmup=not args.no_warmup,
    )
    client: ChatClient
    if args.endpoint:
        client = EndpointClient(args.endpoint, args.served_model, args.api_key)
    else:
        from monokernel.runtime.engine import Engine, EngineConfig

        engine_config = EngineConfig(
            engine=args.engine,
            device=args.device,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            progress=args.json != "-",
            speculative=speculative,
        )
        client = EngineClient(Engine(args.model, engine_config))
    try:
        report = run_agent_loop(client, config)
    finally:
        if isinstance(client, EndpointClient):
            client.close()
        else:
            client.engine.close()
    if args.json == "-":
        print(json.dumps(report.to_json(), indent=2))
        return 0
    print(report.table())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
