"""What the routes share: settings, the engine (once loaded), the queue and the metrics."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from starlette.requests import Request

from monokernel.runtime.engine import Engine
from monokernel.serve.errors import APIError
from monokernel.serve.metrics import Metrics
from monokernel.serve.params import prompt_char_limit
from monokernel.serve.responses_protocol import ResponseStore
from monokernel.serve.scheduler import Scheduler
from monokernel.serve.settings import ServerSettings

if TYPE_CHECKING:
    from monokernel.serve.generation import Generation

log = logging.getLogger("monokernel.serve")
# After the grace period, how long ended streams get to write their last events.
_FINAL_WRITE_S = 2.0


class ServerState:
    def __init__(
        self,
        settings: ServerSettings,
        load_engine: Callable[[], Engine],
        on_load_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = Metrics(settings.served_model_name)
        self.scheduler = Scheduler(settings.max_queue)
        self.engine: Engine | None = None
        self.load_error: str | None = None
        self._load_engine = load_engine
        self._on_load_error = on_load_error
        # Every engine call (load and generate) runs on this one thread: GPU backends keep
        # per-thread state (CUDA streams, graphs), and CPU torch keeps one OpenMP team warm
        # instead of starting one per request.
        self.engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="monokernel")
        # Tokenising runs off the event loop, one request at a time: HF's fast tokenizers
        # may fail with "Already borrowed" when called from two threads at once, and one
        # thread also caps the CPU that prompts being admitted take from a running stream.
        self.tokenize_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.prompt_char_limit = 0  # set once the engine is loaded
        self.draining = False  # set on SIGTERM: no request is admitted any more
        self.exit_status = 0  # the process's, once the server stops (server.py EXIT_FAILED)
        self.generations: set[Generation] = set()  # admitted and not yet over
        self.responses = ResponseStore()  # past responses, for previous_response_id

    def start_loading(self) -> None:
        """Load off the event loop so the server answers /health (503) meanwhile."""
        self.engine_thread.submit(self._load)

    def _load(self) -> None:
        try:
            engine = self._load_engine()
        except BaseException as e:
            self.load_error = f"{type(e).__name__}: {e}"
            log.error("loading the model failed: %s", self.load_error)
            if self._on_load_error is not None:
                self._on_load_error(e)
            return
        self.prompt_char_limit = prompt_char_limit(engine)
        self.engine = engine
        log.info(
            "model %r ready: %s engine on %s, context %d tokens",
            self.settings.served_model_name,
            engine.engine_name,
            engine.device,
            engine.max_model_len,
        )

    def engine_failure(self) -> str | None:
        """Why the loaded engine can serve no more requests (None: it can, or none is
        loaded yet)."""
        return None if self.engine is None else self.engine.failure

    def check_admitting(self) -> None:
        failure = self.engine_failure()
        if failure is not None:
            raise APIError(503, f"the engine failed: {failure}", code="engine_failed")
        if self.draining:
            raise APIError(
                503,
                "the server is shutting down; send the request to another instance",
                code="shutting_down",
                headers={"Connection": "close"},
            )

    async def drain(self) -> None:
        """Stop admitting (``draining``), give admitted requests ``shutdown_timeout_s`` to
        finish, then end the rest: streams with an error event and ``[DONE]``, queued
        and non-streamed requests with a 503. Returns once they have answered, or after
        a bound."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.shutdown_timeout_s
        while self.generations and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.generations:
            log.warning(
                "ending %d request(s) still open after %.0f s",
                len(self.generations),
                self.settings.shutdown_timeout_s,
            )
        for gen in list(self.generations):
            gen.stop_for_shutdown()
        deadline = loop.time() + _FINAL_WRITE_S
        while self.generations and loop.time() < deadline:
            await asyncio.sleep(0.02)

    def require_engine(self) -> Engine:
        if self.engine is not None:
            return self.engine
        retry = {"Retry-After": str(self.settings.retry_after_s)}
        if self.load_error is not None:
            raise APIError(503, f"the model failed to load: {self.load_error}", code="load_failed")
        raise APIError(503, "the model is still loading; retry shortly", None, "loading", retry)

    def close(self) -> None:
        """Free the engine once the server has stopped (a generation thread that is still
        unwinding keeps it: the process is about to exit anyway)."""
        # A failed engine's GPU may still be running its kernel: freeing would wait for it.
        if self.engine is not None and self.scheduler.running == 0 and not self.engine_failure():
            self.engine.close()


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.monokernel
    return state
