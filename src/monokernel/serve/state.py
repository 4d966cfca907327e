"""What the routes share: settings, the engine (once loaded), the queue and the metrics."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from starlette.requests import Request

from monokernel.runtime.engine import Engine
from monokernel.serve.errors import APIError
from monokernel.serve.metrics import Metrics
from monokernel.serve.scheduler import Scheduler
from monokernel.serve.settings import ServerSettings

log = logging.getLogger("monokernel.serve")


class ServerState:
    def __init__(
        self,
        settings: ServerSettings,
        load_engine: Callable[[], Engine],
        on_load_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.scheduler = Scheduler(settings.max_queue)
        self.engine: Engine | None = None
        self.load_error: str | None = None
        self._load_engine = load_engine
        self._on_load_error = on_load_error
        # Every engine call (load and generate) runs on this one thread: GPU backends keep
        # per-thread state (CUDA streams, graphs), and CPU torch keeps one OpenMP team warm
        # instead of starting one per request.
        self.engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="monokernel")

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
        self.engine = engine
        log.info(
            "model %r ready: %s engine on %s, context %d tokens",
            self.settings.served_model_name,
            engine.engine_name,
            engine.device,
            engine.max_model_len,
        )

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
        if self.engine is not None and self.scheduler.running == 0:
            self.engine.close()


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.monokernel
    return state
