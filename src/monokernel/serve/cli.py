"""``monokernel serve``: parse options, build the app and run uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from monokernel.cli import validate
from monokernel.serve.settings import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    ServerSettings,
)

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="monokernel serve",
        description="Serve one model over an OpenAI-compatible HTTP API, with a playground at /.",
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF directory, .gguf file or hub id (default: SmolLM2-135M-Instruct, downloaded once)",
    )
    validate.add_engine_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=validate.port, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require the key on /v1 ('Authorization: Bearer KEY' or 'x-api-key: KEY')",
    )
    p.add_argument(
        "--max-queue",
        type=validate.non_negative_int,
        default=DEFAULT_MAX_QUEUE,
        help=f"requests that may wait behind the running one; more get 503 "
        f"(default {DEFAULT_MAX_QUEUE})",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send and /v1/models lists (default: MODEL as typed, or "
        f"{DEFAULT_SERVED_NAME} for the default model)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=validate.positive_int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"larger request bodies get 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    p.add_argument(
        "--allowed-origins",
        type=origins,
        default=(),
        metavar="ORIGINS",
        help="comma-separated browser origins allowed to call the API (CORS), e.g. "
        "'https://app.example.com' or '*' for any; default: none (no CORS headers)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=seconds,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="S",
        help="on SIGTERM or Ctrl-C, new requests get 503 and running ones have S seconds to "
        "finish; then open streams end with an error event and [DONE] and queued requests "
        f"get 503 (default {DEFAULT_SHUTDOWN_TIMEOUT_S:g})",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def origins(text: str) -> tuple[str, ...]:
    """'*' or origins as browsers send them (scheme://host[:port]), comma-separated."""
    items = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    if not items:
        raise argparse.ArgumentTypeError("give at least one origin, or '*'")
    for o in items:
        scheme, _, host = o.partition("://")
        if o != "*" and (scheme not in ("http", "https") or not host or "/" in host):
            raise argparse.ArgumentTypeError(
                f"{o!r} is not an origin like https://app.example.com (or '*')"
            )
    return items


def served_name(model: str | None, explicit: str | None) -> str:
    """As vLLM: the name given, else MODEL exactly as typed, so vLLM client configs work."""
    if explicit:
        return explicit
    return DEFAULT_SERVED_NAME if model is None else model


def main(argv: Sequence[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    # What this machine cannot run is refused before the server listens, not in its load.
    error = validate.machine_error(args.device, args.engine, args.tp)
    if error:
        parser.error(error)
    speculative, error = validate.speculative_config(args)
    if error:
        parser.error(error)
    try:
        import uvicorn

        from monokernel.serve.app import create_app
        from monokernel.serve.server import DrainingServer
    except ModuleNotFoundError as e:
        print(
            f"monokernel serve: {e.name} is missing; install the server extras with "
            "pip install 'monokernel[serve]'",
            file=sys.stderr,
        )
        return 2
    from monokernel.runtime.engine import Engine, EngineConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    config = EngineConfig(
        engine=args.engine,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        tp=args.tp,
        quantize=args.quantize,
        speculative=speculative,
    )
    settings = ServerSettings(
        served_model_name=served_name(args.model, args.served_model_name),
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        allowed_origins=args.allowed_origins,
        shutdown_timeout_s=args.shutdown_timeout,
    )
    failed: list[BaseException] = []
    server: uvicorn.Server | None = None

    def stop_on_load_error(e: BaseException) -> None:
        # A server that can never answer would only hide the error: exit instead.
        failed.append(e)
        if server is not None:
            server.should_exit = True

    def load_engine() -> Engine:
        engine = Engine(args.model, config)
        for note in engine.startup_notes:  # the engine fallback, if any, and the context
            print(f"monokernel serve: {note}", file=sys.stderr)
        return engine

    app = create_app(settings, load_engine, stop_on_load_error)
    server = DrainingServer(
        # The drain has ended every request before uvicorn's own shutdown starts; its
        # timeout only bounds writing their last bytes to slow clients.
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
        ),
        app.state.monokernel,
    )
    print(
        f"monokernel serve: http://{args.host}:{args.port}/ (playground), "
        f"OpenAI base_url http://{args.host}:{args.port}/v1, model "
        f"{settings.served_model_name!r}; loading it now",
        file=sys.stderr,
    )
    server.run()
    state = app.state.monokernel
    state.close()
    if failed:
        print(f"monokernel serve: error: could not load the model: {failed[0]}", file=sys.stderr)
        return 1
    if state.exit_status:
        print(f"monokernel serve: error: {state.engine_failure()}", file=sys.stderr)
    return int(state.exit_status)
