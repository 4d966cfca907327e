"""The uvicorn server with a drain on SIGTERM (and Ctrl-C).

uvicorn on its own stops listening, waits ``timeout_graceful_shutdown`` for open
connections, then cancels their tasks: streams end with no final event and a queued
request gets a plain-text 500. Here the first signal drains instead (see
``ServerState.drain``): new requests get an OpenAI-shaped 503, running streams have
``--shutdown-timeout`` to finish, then every stream still open ends with an error event
and ``data: [DONE]`` and every queued request gets a 503. Only then does uvicorn shut
down. A second signal exits at once, as uvicorn does. An engine that fails (a GPU kernel
that faulted, or stalled and would not stop) drains the server the same way, and the
process exits with status 70 for a supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn

from monokernel.serve.state import ServerState

log = logging.getLogger("monokernel.serve")

# The exit status after the engine failed (EX_SOFTWARE): the process must be restarted.
EXIT_FAILED = 70


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def on_tick(self, counter: int) -> bool:
        # An engine that failed (a GPU kernel faulted, or stalled and would not stop) can
        # answer nothing more: drain as on SIGTERM and exit non-zero for a supervisor.
        reason = self.state.engine_failure()
        if reason is not None and not self.state.draining:
            log.error("the engine failed, shutting down (exit status %d): %s", EXIT_FAILED, reason)
            self.state.exit_status = EXIT_FAILED
            self.handle_exit(signal.SIGTERM, None)
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Called by the signal handler on the loop's thread, or from any other thread
        (tests); the drain itself runs on the loop."""
        loop = self._loop
        if loop is None or self.state.draining or loop.is_closed():
            super().handle_exit(sig, frame)
            return
        self.state.draining = True  # refuse from now on, even before the task starts
        loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        log.info(
            "shutting down: refusing new requests; running ones have %.0f s to finish",
            self.state.settings.shutdown_timeout_s,
        )
        self._drain = asyncio.ensure_future(self.state.drain())
        self._drain.add_done_callback(self._drained)

    def _drained(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the drain failed: %r", task.exception())
        self.should_exit = True
