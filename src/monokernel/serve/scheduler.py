"""One engine slot and a bounded FIFO of requests waiting for it.

The engine runs one request at a time, so requests queue here rather than on the engine's
lock: the queue is visible (depth metric), bounded (503 past ``max_queue``), strictly
first come first served, and a request whose client leaves drops out of it at once.
All methods run on the event loop thread.
"""

from __future__ import annotations

import asyncio
from collections import deque


class QueueFullError(Exception):
    pass


class Abandoned(Exception):
    """The ticket was released before its turn came (its client went away)."""


class Ticket:
    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.released = False

    @property
    def granted(self) -> bool:
        return self._turn.done() and not self._turn.cancelled() and self._turn.exception() is None

    async def wait(self) -> None:
        """Return once this ticket holds the slot; raises Abandoned if released first."""
        await asyncio.shield(self._turn)

    def release(self) -> None:
        """Give the slot back (or leave the queue). Idempotent."""
        if self.released:
            return
        self.released = True
        self._scheduler._release(self)


class Scheduler:
    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self._holder: Ticket | None = None
        self._waiting: deque[Ticket] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return 0 if self._holder is None else 1

    def enter(self) -> Ticket:
        """A ticket in line; raises QueueFullError when ``max_queue`` are already waiting."""
        if self._holder is not None and len(self._waiting) >= self.max_queue:
            raise QueueFullError(
                f"the server is busy: 1 request running and {len(self._waiting)} waiting "
                f"(--max-queue {self.max_queue}); retry later"
            )
        ticket = Ticket(self)
        if self._holder is None:
            self._grant(ticket)
        else:
            self._waiting.append(ticket)
        return ticket

    def _grant(self, ticket: Ticket) -> None:
        self._holder = ticket
        ticket._turn.set_result(None)

    def _release(self, ticket: Ticket) -> None:
        if ticket is self._holder:
            self._holder = None
            if self._waiting:
                self._grant(self._waiting.popleft())
            return
        if ticket in self._waiting:
            self._waiting.remove(ticket)
        if not ticket._turn.done():
            ticket._turn.set_exception(Abandoned())
            ticket._turn.exception()  # marks it retrieved: no "never retrieved" warning
