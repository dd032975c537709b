"""A router replica's side of shadow traffic: the requests it mirrors to a shadow candidate after
their callers were answered, bounded, timed and compared (`ipnext.policy.shadow`).

What a caller sees never depends on the shadow: the copy starts as a task after the answer is
built, its time is never in the caller's latency, and its failure, hang or answer reaches only
the candidate's counters. A router holds at most `ShadowRoute.max_in_flight` copies at once;
past that, or while the candidate's app has not described itself to this router yet, a mirrored
request is dropped and counted as dropped. A copy past the router's deadline is cancelled and
counted as the candidate's failure, as a canary's would be."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ipnext.contracts.router import ShadowRoute
from ipnext.policy.shadow import DROPPED, compare_answers

__all__ = ["ShadowMirror"]

logger = logging.getLogger("ray.serve")

# What the mirror tells its router: count(app, latency_ms or None for a failure) for the
# candidate's request counters, note(app, outcomes) for the comparison's outcomes.
Count = Callable[[str, float | None], None]
# How long a copy waits before it starts: past the moment its own caller's answer leaves this
# replica (the copy started at once shared the router's event loop with that answer's way out).
COPY_AFTER_S = 0.05
Note = Callable[[str, dict[str, float]], None]


class ShadowMirror:
    def __init__(self, count: Count, note: Note) -> None:
        self._count, self._note = count, note
        self._tasks: set[asyncio.Task[None]] = set()  # held: a task nobody holds may be collected

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def send(
        self,
        route: ShadowRoute,
        served: Any,
        run: Callable[[], Awaitable[Any]] | None,
        deadline_s: float,
    ) -> None:
        """Mirror one answered request: `run` calls the candidate (None: it is not reachable from
        this router yet), `served` is the output the caller got. Returns at once."""
        if run is None or len(self._tasks) >= route.max_in_flight:
            self._note(route.app, {DROPPED: 1.0})
            return
        self._note(route.app, {DROPPED: 0.0})
        task = asyncio.ensure_future(self._mirror(route, served, run, deadline_s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _mirror(
        self, route: ShadowRoute, served: Any, run: Callable[[], Awaitable[Any]], deadline_s: float
    ) -> None:
        await asyncio.sleep(COPY_AFTER_S)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(deadline_s):
                candidate = await run()
        except asyncio.CancelledError:  # the replica is shutting down: nothing to record
            raise
        except Exception as err:  # the candidate failed, or its deadline passed: a canary's failure
            self._count(route.app, None)
            logger.info("shadow call to %s failed: %s", route.app, type(err).__name__)
            return
        self._count(route.app, (time.perf_counter() - started) * 1000)
        self._note(route.app, compare_answers(served, candidate, route.top_k))
