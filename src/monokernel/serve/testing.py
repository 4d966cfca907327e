"""Test helpers: a live uvicorn server on a free port in a thread, and a backend wrapper
that slows decoding down so tests can catch a request mid-generation, or replays given
tokens so tests can see what the server makes of a known model output (``Served``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI

from monokernel.runtime.backends.base import Backend, CancelToken, DecodeRequest
from monokernel.runtime.engine import Engine, EngineConfig

if TYPE_CHECKING:
    from monokernel.serve.server import DrainingServer


class SlowBackend:
    """Delegates to a real backend, sleeping ``delay_s`` before each token; with
    ``fail_after`` set, raises after that many tokens (a backend crashing mid-request);
    with ``script`` set, yields those token ids instead of the model's (end it with an EOS
    id for a "stop" finish)."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name
        self.delay_s = 0.0
        self.fail_after: int | None = None
        self.script: list[int] | None = None

    def stream(self, request: DecodeRequest, cancel: CancelToken) -> Iterator[int]:
        if self.script is not None:
            tokens: Iterator[int] = iter(list(self.script))
        else:
            tokens = self.inner.stream(request, cancel)
        try:
            for i, token in enumerate(tokens):
                if self.script is not None and cancel.is_set():
                    return  # a real backend ends its stream on cancel; so does a script
                if self.fail_after is not None and i >= self.fail_after:
                    raise RuntimeError("injected backend failure")
                if self.delay_s:
                    time.sleep(self.delay_s)
                yield token
        finally:
            close = getattr(tokens, "close", None)
            if close is not None:
                close()

    def close(self) -> None:
        self.inner.close()


def wait_ready(base_url: str, timeout_s: float = 20.0) -> None:
    """Poll /health until the model is loaded."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(base_url + "/health").status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("the server never became ready")
        time.sleep(0.02)


@contextmanager
def live_server(app: FastAPI, timeout_s: float = 20.0) -> Iterator[str]:
    """Run ``app`` on 127.0.0.1 at a free port; yields its base URL."""
    with serving(app, timeout_s) as (url, _):
        yield url


@contextmanager
def serving(app: FastAPI, timeout_s: float = 20.0) -> Iterator[tuple[str, DrainingServer]]:
    """As ``live_server``, also yielding the server, whose ``handle_exit`` is what a
    SIGTERM calls (signals reach only the main thread, and this one runs in another)."""
    import uvicorn

    from monokernel.serve.server import DrainingServer

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
    server = DrainingServer(config, app.state.monokernel)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def scripted_engine(model_dir: Path, template: str, special: str | None = None) -> Engine:
    """The tiny model with ``template`` as its chat template and a backend that replays
    scripts (``Served.say``)."""
    eng = Engine(model_dir, EngineConfig(engine="reference", device="cpu", progress=False))
    eng.tokenizer.hf.chat_template = template
    if special is not None:
        # Registered as special, the marker is skipped when decoding, as real Mistral
        # tokenizers skip [TOOL_CALLS]; the server must see the call all the same.
        eng.tokenizer.hf.add_special_tokens({"additional_special_tokens": [special]})
    eng.backend = SlowBackend(eng.backend)
    # The backend replays scripts and never runs the model, so the tiny model's 256
    # positions need not bound prompts that carry tool schemas in a 320-token vocabulary.
    eng.max_model_len = 4096
    return eng


class Served:
    """A live server on a scripted engine; ``say`` sets what the "model" writes next."""

    def __init__(self, engine: Engine, url: str) -> None:
        self.engine = engine
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=30)

    def say(self, text: str, special: str | None = None) -> None:
        hf = self.engine.tokenizer.hf
        ids: list[int] = []
        if special is not None:
            ids.append(hf.convert_tokens_to_ids(special))
        ids += hf(text, add_special_tokens=False)["input_ids"]
        eos = min(self.engine.eos_token_ids)
        self.engine.backend.script = [*ids, eos]  # type: ignore[attr-defined]

    def post(self, body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
        return self.http.post(path, json=body)


def refused_as(
    r: httpx.Response,
    param: str,
    fragment: str,
    statuses: tuple[int, ...] = (400,),
    code: str | None = None,
) -> bool:
    """Whether ``r`` is an OpenAI-shaped error with one of ``statuses`` that names ``param``
    (and ``code``, when given) and whose message holds ``fragment``: what each refusal
    table of the server tests checks."""
    if r.status_code not in statuses:
        return False
    error = r.json().get("error", {})
    if code and error.get("code") != code:
        return False
    return error.get("param") == param and fragment in error.get("message", "")


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_process(*args: str) -> subprocess.Popen[str]:
    """`monokernel serve ARGS` in a child process (stderr piped, for the failure message)."""
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "monokernel.cli.main", "serve", *args]
    return subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )


def wait_serving(proc: subprocess.Popen[str], url: str, timeout_s: float = 60.0) -> None:
    """Poll the child server's /health until it answers 200; fail with its stderr if it
    exits first, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "monokernel serve never became healthy"
        time.sleep(0.05)
