"""A bounded closed-loop client on loopback: `workers` callers, each sending its next request
when the last one answered, recording every answer (status, set, parts) until stopped."""

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
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
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
        async with httpx.AsyncClient(base_url=self.base_url, timeout=30) as http:
            n = index
            while not self._stop.is_set():
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
