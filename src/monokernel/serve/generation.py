"""One admitted request: wait for the engine slot, generate on a worker thread, and hand
the events to the event loop.

The engine is synchronous, so it runs on its own thread and every event crosses to asyncio
through ``loop.call_soon_threadsafe`` into an ``asyncio.Queue``; the loop never blocks on
it. The slot is given back by the worker thread when the engine has really finished, so
the next request never shares the engine with a cancelled one that is still unwinding.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor
from typing import Any

from starlette.requests import Request

from monokernel.errors import EngineFailedError
from monokernel.runtime.backends.base import CancelToken
from monokernel.runtime.engine import Engine, TokenEvent
from monokernel.serve.errors import APIError
from monokernel.serve.metrics import Metrics
from monokernel.serve.params import Prepared
from monokernel.serve.scheduler import Abandoned, Ticket

log = logging.getLogger("monokernel.serve")


class Generation:
    def __init__(
        self,
        engine: Engine,
        prepared: Prepared,
        ticket: Ticket,
        metrics: Metrics,
        arrival: float,
        engine_thread: Executor,
        choices: int = 1,
    ) -> None:
        """``choices``: the request's n, run one after another in its one engine slot, each
        a seed of its own (the request's seed + i, or a fresh one)."""
        self.engine = engine
        self.prepared = prepared
        self.choices = choices
        self.ticket = ticket
        self.metrics = metrics
        self.engine_thread = engine_thread
        self.arrival = arrival  # time.perf_counter() when the request came in
        self.cancel = CancelToken()
        self.admitted = time.perf_counter()  # validated, tokenised, in line
        self.queue_s = 0.0
        self._started = False
        self.shutting_down = False

    @property
    def prompt_n(self) -> int:
        return len(self.prepared.prompt_ids)

    def stop_for_shutdown(self) -> None:
        """The server is going down: end this request now, with a 503 (in-band for a
        stream whose headers are out), whether it runs or waits."""
        self.shutting_down = True
        self.abandon()

    def _shutdown_error(self) -> APIError:
        state = "running" if self._started else "queued"
        return APIError(
            503,
            f"the server is shutting down and this request was still {state} at the end of "
            "its grace period (--shutdown-timeout); retry it on another instance",
            code="shutting_down",
        )

    def abandon(self) -> None:
        """The client is gone (or the response ended): stop generating, leave the queue.
        Safe to call more than once and after a normal finish."""
        self.cancel.set()
        if not self._started:
            self.ticket.release()

    async def events(self, request: Request) -> AsyncIterator[TokenEvent]:
        """Token events in order; the last has ``finish_reason``. Ends early, without a
        final event, if the client leaves while the request is still queued."""
        watcher = asyncio.create_task(self._watch_disconnect(request))
        try:
            try:
                await self.ticket.wait()
            except Abandoned:
                self.metrics.abandon_queued()
                if self.shutting_down:
                    raise self._shutdown_error() from None
                return
            if self.cancel.is_set():  # the client left (or shutdown came) as the slot freed
                self.metrics.abandon_queued()
                if self.shutting_down:
                    raise self._shutdown_error()
                return
            self.queue_s = time.perf_counter() - self.admitted
            queue: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
            loop = asyncio.get_running_loop()
            self.engine_thread.submit(self._work, loop, queue)
            self._started = True  # from here the worker gives the slot back
            while True:
                item = await queue.get()
                if isinstance(item, EngineFailedError):
                    raise APIError(503, f"the engine failed: {item}", code="engine_failed")
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason == "cancelled" and self.shutting_down:
                    raise self._shutdown_error()
                yield item
                last = item.choice == self.choices - 1 or item.finish_reason == "cancelled"
                if item.finish_reason is not None and last:
                    return
        finally:
            watcher.cancel()
            self.abandon()

    async def _watch_disconnect(self, request: Request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                log.info("client disconnected; cancelling its request")
                self.abandon()
                return
            await asyncio.sleep(0.05)  # an unexpected body message: do not spin

    def _work(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any]) -> None:
        def put(item: TokenEvent | BaseException) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop has closed: the server is shutting down
                self.cancel.set()

        previous: float | None = None
        try:
            # A choice started after a cancel ends at once, with its own "cancelled" event.
            for choice in range(self.choices):
                params = self.prepared.params
                if choice and params.seed is not None:
                    params = dataclasses.replace(params, seed=params.seed + choice)
                events = self.engine.generate(
                    "", params, cancel=self.cancel, prompt_ids=self.prepared.prompt_ids
                )
                previous = self._relay(events, choice, previous, put)
        except BaseException as e:
            log.exception("generation failed")
            put(e)
        finally:
            # RuntimeError: the loop has closed, so nothing waits for the slot any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.ticket.release)

    def _relay(
        self,
        events: Iterator[TokenEvent],
        choice: int,
        previous: float | None,
        put: Callable[[TokenEvent | BaseException], None],
    ) -> float | None:
        """One choice's events to the loop, with the metrics they carry; returns when its
        last token came (for the next choice's inter-token time)."""
        for event in events:
            now = time.perf_counter()
            if event.token_id is not None:
                if previous is None:
                    self.metrics.observe_ttft(now - self.arrival)
                else:
                    self.metrics.observe_itl(now - previous)
                previous = now
            elif event.timings is not None and event.finish_reason is not None:
                t = event.timings
                self.metrics.finish(
                    event.finish_reason,
                    t.prompt_tokens,
                    t.generated_tokens,
                    now - self.arrival,
                    t.drafted_tokens or 0,
                    t.accepted_tokens or 0,
                    queue_s=self.queue_s,
                    prefill_s=t.ttft_s,
                    decode_s=t.decode_s,
                    cached_n=t.cached_tokens,
                )
            put(dataclasses.replace(event, choice=choice) if choice else event)
        return previous
