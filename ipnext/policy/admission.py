"""Admission by time: whether a router sheds a request at once because it would wait in the queue
longer than its caller can use (pure; the router calls it on every request).

The router cannot see Serve's queues inside its part handles, so it reads them from what it
does see, in two steps, as controlled-delay queueing does (CoDel; Meta's "Fail at Scale", ACM
Queue 2015, sheds with it in front of its services):

1. Is a queue standing? The *service time* is the lowest latency of the last `base_window_s` (a
   request that waited for nothing), and a request's *queue delay* is its latency above that. A
   queue that stands, rather than a burst passing through, keeps even the least delayed request
   of a short interval waiting: the standing delay is the smallest queue delay of the requests
   completed in the last `interval_s` (or, when none completed while some are in flight, the age
   of the oldest of those above the service time: a queue that does not drain). Below the
   budget, nothing is shed: a burst passes, and a quiet router never sheds its first requests.
2. If one stands, how long would a request admitted now wait? The requests in flight ahead of it
   drain at the rate requests completed over the last `rate_window_s` (a saturated router's
   rate is its capacity), so it waits `in flight / rate - service time`. It is shed when that
   exceeds its budget: the model's `router.max_queue_wait_ms`, or what its own deadline leaves
   after the service time, whichever is less. So what a router admits is bounded by the rate it
   is actually served at times the budget: a queue bound that follows capacity, not a number.

With no completed request yet, nothing is shed. A request past its own deadline is no longer in
flight here, whether or not `finished` was called for it: the router has answered it (504) and
stopped waiting, so it is no queue a new request waits behind. (A leaked one, never finished, kept
the standing delay growing with its age, and the router shed every request from then on.)

One `QueueDelay` per set app a router routes to: the queue a request waits in is its set's
(a hung canary's requests are no queue for the serving set's).

Limits: latency above the fastest request is taken for waiting, so a model whose requests differ
widely in cost (long generations) reads its slow requests as queueing; set its queue-wait
budget above that spread, or leave it unset (then only requests that would miss their deadline
are shed).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

__all__ = ["Admission", "QueueDelay", "retry_after_seconds"]


class _SlidingMin:
    """The minimum of the values of the last `window_s` (a monotonic deque: O(1) amortized)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._values: deque[tuple[float, float]] = deque()  # (time, value), values increasing

    def add(self, now: float, value: float) -> None:
        while self._values and self._values[-1][1] >= value:
            self._values.pop()
        self._values.append((now, value))

    def min(self, now: float) -> float | None:
        while self._values and self._values[0][0] < now - self.window_s:
            self._values.popleft()
        return self._values[0][1] if self._values else None


@dataclass(frozen=True)
class Admission:
    """A decision: shed or not, the wait expected, and the budget it was held to (seconds)."""

    shed: bool
    expected_wait_s: float
    budget_s: float | None


class QueueDelay:
    """One router replica's view of its queue: completed requests' latencies and completion
    times, and the start times of those in flight (all seconds, on one monotonic clock)."""

    def __init__(
        self,
        interval_s: float = 0.5,
        base_window_s: float = 30.0,
        rate_window_s: float = 2.0,
        capacity_window_s: float = 60.0,
    ) -> None:
        if interval_s <= 0 or base_window_s < interval_s or rate_window_s <= 0 or capacity_window_s <= 0:
            raise ValueError(
                f"interval_s {interval_s}, rate_window_s {rate_window_s} and capacity_window_s "
                f"{capacity_window_s} must be positive, interval_s at most base_window_s {base_window_s}"
            )
        self._base = _SlidingMin(base_window_s)
        self._latencies = _SlidingMin(interval_s)
        self._rate_window_s = rate_window_s
        self._completed: deque[float] = deque()  # completion times within the rate window
        self._capacity = _SlidingMin(capacity_window_s)  # minus the rates seen while a queue stood
        self._in_flight: dict[int, float] = {}  # request token -> start
        self._expiries: list[tuple[float, int]] = []  # (deadline, token), a heap
        self._next = 0

    def started(self, now: float, deadline_s: float | None = None) -> int:
        """A request admitted, with `deadline_s` to answer in: its token for `finished`. Past its
        deadline it no longer counts as in flight (the module's docstring)."""
        self._next += 1
        self._in_flight[self._next] = now
        if deadline_s is not None:
            heapq.heappush(self._expiries, (now + deadline_s, self._next))
        return self._next

    def _expire(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] < now:
            self._in_flight.pop(heapq.heappop(self._expiries)[1], None)

    def finished(self, token: int, now: float, completed: bool = True) -> None:
        """A request done; its latency is learned from only when it `completed` (a failure may
        be fast, and would pass for the service time)."""
        start = self._in_flight.pop(token, None)
        if start is None or not completed:
            return
        latency = now - start
        self._base.add(now, latency)
        self._latencies.add(now, latency)
        self._completed.append(now)

    def in_flight(self, now: float) -> int:
        """Requests admitted and neither finished nor past their deadline."""
        self._expire(now)
        return len(self._in_flight)

    def service_s(self, now: float) -> float | None:
        """The lowest latency of the base window: the service time of a request that did not wait."""
        return self._base.min(now)

    def rate(self, now: float) -> float:
        """Requests completed per second over the rate window."""
        while self._completed and self._completed[0] < now - self._rate_window_s:
            self._completed.popleft()
        return len(self._completed) / self._rate_window_s

    def standing_s(self, now: float) -> float:
        """The queue delay that stands (step 1 of the module's docstring; 0 without history)."""
        service = self.service_s(now)
        if service is None:
            return 0.0
        least = self._latencies.min(now)
        if least is not None:
            return max(0.0, least - service)
        if not self.in_flight(now):
            return 0.0
        oldest = min(self._in_flight.values())
        return max(0.0, now - oldest - service)

    def capacity(self, now: float, planned: float | None = None) -> float | None:
        """The highest rate requests completed at while a queue stood, over the capacity window;
        until one stood, `planned` (what the plan says the set serves, if known); else None."""
        least = self._capacity.min(now)
        if least is None or least == 0.0:
            return planned if planned else None
        return -least

    def expected_wait_s(self, now: float, planned: float | None = None) -> float:
        """How long a request admitted now is expected to wait before it is served: behind the
        requests in flight at the router's capacity once it knows it (measured, else `planned`;
        at least the standing delay while nothing drains), else the standing delay."""
        standing = self.standing_s(now)
        capacity = self.capacity(now, planned)
        if capacity is None:
            return standing
        behind = max(0.0, self.in_flight(now) / capacity - (self.service_s(now) or 0.0))
        drains = self._latencies.min(now) is not None
        return behind if drains else max(behind, standing)

    def admit(
        self, now: float, max_wait_s: float | None, deadline_s: float | None, planned: float | None = None
    ) -> Admission:
        """Whether to shed a request arriving now: its expected wait against the smaller of
        `max_wait_s` (the model's setting) and what `deadline_s` (the request's own, else the
        router's) leaves after the service time. A queue standing beyond that budget teaches the
        router its capacity (the completion rate now); until then the plan's capacity
        (`planned`, requests/s) stands in for it, so a first burst is bounded too."""
        budgets = [b for b in (max_wait_s,) if b is not None]
        service = self.service_s(now)
        if deadline_s is not None and service is not None:
            budgets.append(max(0.0, deadline_s - service))
        budget = min(budgets) if budgets else None
        if budget is not None and self.standing_s(now) > budget:
            self._capacity.add(now, -self.rate(now))
        wait = self.expected_wait_s(now, planned)
        return Admission(shed=budget is not None and wait > budget, expected_wait_s=wait, budget_s=budget)


def retry_after_seconds(admission: Admission, least: int) -> int:
    """What a shed request's Retry-After says: the wait beyond the budget, in whole seconds,
    at least `least` (the model's `router.retry_after_seconds`) and at least 1."""
    over = admission.expected_wait_s - (admission.budget_s or 0.0)
    return max(1, least, math.ceil(over))
