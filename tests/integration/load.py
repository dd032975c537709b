"""Load on loopback: a bounded closed loop (`workers` callers, each sending its next request
when the last one answered, recording every answer until stopped), paced to at most `rate`
requests/s in all, and an open loop of Poisson arrivals in phases of set rates (`OpenLoop`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Answer:
    at: float  # seconds since the load started
    status: int
    set: str | None
    parts: dict[str, str]
    error: str = ""
    variant: str | None = None
    user: int = -1
    latency_s: float = 0.0  # from sending the request to its answer


# The closed loop's pace unless a drill asks otherwise: requests/s in all, shared by the callers.
# Unpaced, one drill's four callers kept this 2-core machine about 95% busy by themselves (CPU
# sampled through the on-call rollout drill), so every control-plane step of both test workers
# (Serve deploys, workflow tasks) waited behind predictions. At 15/s a 10% rollout step still
# sees the drills' request floor (10) within its longest bake window (3 s, 3 times over).
DEFAULT_RATE = 15.0


@dataclass
class Load:
    base_url: str
    path: str
    workers: int = 4
    # user ids cycle through these; the bad snapshot of the tests fails on even users
    users: list[int] = field(default_factory=lambda: list(range(40)))
    # a request's inputs for a user (default: the demo ranker's three items)
    inputs: Callable[[int], dict[str, Any]] = lambda user: {"user": user, "items": [1, 2, 3]}
    answers: list[Answer] = field(default_factory=list)
    # a pause after an answer refused for overload (503) before the caller's next request
    backoff_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)  # sent with every request (the API key)
    # requests/s in all at most (None: as fast as the callers are answered, an overload drill)
    rate: float | None = DEFAULT_RATE
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _next_slot: float = 0.0  # when the next request may go, in seconds since the load started
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _started: float = 0.0

    async def __aenter__(self) -> Load:
        self._started = time.perf_counter()
        self._tasks = [asyncio.create_task(self._caller(i)) for i in range(self.workers)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def failed(self, since: float = 0.0) -> list[Answer]:
        return [a for a in self.answers if a.status != 200 and a.at >= since]

    def elapsed(self) -> float:
        return time.perf_counter() - self._started

    async def _caller(self, index: int) -> None:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=30, headers=self.headers) as http:
            n = index
            while not self._stop.is_set():
                if not await self._paced():
                    break
                user = self.users[n % len(self.users)]
                n += self.workers
                at = self.elapsed()
                try:
                    reply = await http.post(self.path, json={"inputs": self.inputs(user)})
                    latency = self.elapsed() - at
                    try:
                        body: dict[str, Any] = reply.json()
                    except ValueError:  # Serve's proxy answers its refusals in plain text
                        body = {"message": reply.text[:200]}
                    self.answers.append(
                        Answer(
                            at,
                            reply.status_code,
                            body.get("set"),
                            body.get("parts") or {},
                            body.get("message", ""),
                            body.get("variant"),
                            user,
                            latency,
                        )
                    )
                    if reply.status_code == 503 and self.backoff_s:
                        await asyncio.sleep(self.backoff_s)
                except (httpx.HTTPError, ValueError) as err:
                    self.answers.append(Answer(at, 0, None, {}, f"{type(err).__name__}: {err}"))
                    await asyncio.sleep(0.05)  # nothing listens (a restart): do not spin on the cores

    async def _paced(self) -> bool:
        """Wait for this caller's next slot (1/rate after the last one handed out; a caller that
        falls behind goes at once, never in a burst to catch up). False once stopped."""
        if self.rate is None:
            return True
        now = self.elapsed()
        slot = max(self._next_slot, now)
        self._next_slot = slot + 1.0 / self.rate
        if slot > now:
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=slot - now)
            except TimeoutError:
                return True
            return False
        return True


@dataclass
class Sent:
    """One request of an open loop: when it was sent (seconds since the loop started), its
    status (0: no HTTP answer) and how long its answer took."""

    at: float
    status: int
    latency_s: float
    error: str = ""


@dataclass
class OpenLoop:
    """Open-loop load on loopback: Poisson arrivals at `phases`' rates (each (seconds, requests
    per second), one after the other), each request sent at its time whether or not earlier
    ones answered, so a slow server builds a queue instead of slowing the load down."""

    base_url: str
    path: str
    phases: list[tuple[float, float]]
    inputs: Callable[[int], dict[str, Any]] = lambda n: {"user": n % 40, "items": [1, 2, 3]}
    seed: int = 1
    sent: list[Sent] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)  # sent with every request (the API key)
    timeout_s: float = 60.0  # a request not answered by then is failed (status 0)

    def phase_bounds(self) -> list[tuple[float, float]]:
        """(start, end) of each phase, in seconds since the loop started."""
        bounds, start = [], 0.0
        for seconds, _ in self.phases:
            bounds.append((start, start + seconds))
            start += seconds
        return bounds

    async def run(self) -> None:
        import random

        rng = random.Random(self.seed)
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
        async with httpx.AsyncClient(
            base_url=self.base_url, timeout=self.timeout_s, limits=limits, headers=self.headers
        ) as http:
            started = time.perf_counter()
            tasks: list[asyncio.Task[None]] = []
            n = 0
            for (start, end), (_, rate) in zip(self.phase_bounds(), self.phases, strict=True):
                at = start + rng.expovariate(rate)
                while at < end:
                    delay = started + at - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tasks.append(asyncio.create_task(self._send(http, started, at, n)))
                    n += 1
                    at += rng.expovariate(rate)
            await asyncio.gather(*tasks)

    async def _send(self, http: httpx.AsyncClient, started: float, at: float, n: int) -> None:
        sent = time.perf_counter()
        try:
            reply = await http.post(self.path, json={"inputs": self.inputs(n)})
            error = "" if reply.status_code == 200 else reply.text[:200]
            self.sent.append(Sent(at, reply.status_code, time.perf_counter() - sent, error))
        except httpx.HTTPError as err:
            self.sent.append(Sent(at, 0, time.perf_counter() - sent, f"{type(err).__name__}: {err}"))
