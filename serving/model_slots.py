"""One pooled model's caps inside the pool router it shares: `router.max_ongoing_requests` and
`router.max_queued_requests`, as Serve enforces them on a dedicated model's router replica.

A dedicated router is a deployment of its own, so Serve holds its requests to
`max_ongoing_requests` per replica and refuses the caller once `max_queued_requests` more wait.
A pool router is one deployment for every pooled model of its region; Serve's caps on it are the
sum of its models', so without these one hot model could take all of it and its pool-mates
would wait behind it. Here each model has `max_ongoing` slots per pool router replica and at
most `max_queued` requests waiting for one; the next is refused at once (503 with Retry-After,
before the model's router counts it, as Serve's refusal of a full dedicated router is).

No Ray, no Serve: the pool router holds one per model; unit tests drive it directly.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

__all__ = ["ModelSlots", "SlotsFull"]


class SlotsFull(RuntimeError):
    """Every slot taken and the queue full: the request is refused without running."""


class ModelSlots:
    """A model's slots in one pool router replica; `running` and `waiting` for its state."""

    def __init__(self, max_ongoing: int, max_queued: int) -> None:
        if type(max_ongoing) is not int or max_ongoing < 1:
            raise ValueError(f"max_ongoing: {max_ongoing!r}; give the router's max_ongoing_requests (>= 1)")
        if type(max_queued) is not int or max_queued < 0:
            raise ValueError(f"max_queued: {max_queued!r}; give the router's max_queued_requests (>= 0)")
        self.max_ongoing = max_ongoing
        self.max_queued = max_queued
        self._free = asyncio.Semaphore(max_ongoing)
        self.running = 0
        self.waiting = 0
        self.refused = 0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one slot for the block's life (`take`)."""
        release = await self.take()
        try:
            yield
        finally:
            release()

    async def take(self) -> Callable[[], None]:
        """One slot, at once or after waiting in the queue; SlotsFull when every slot is taken
        and the queue is full. A caller that goes away while it waits leaves the queue. Returns
        the slot's release (a second call does nothing), for a request whose answer outlives
        the call that made it (a stream)."""
        if self._free.locked() and self.waiting >= self.max_queued:
            self.refused += 1
            raise SlotsFull(
                f"{self.max_ongoing} requests running and {self.waiting} waiting in its pool router "
                "(the model's router.max_ongoing_requests and max_queued_requests)"
            )
        self.waiting += 1
        try:
            await self._free.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.running -= 1
                self._free.release()

        return release
