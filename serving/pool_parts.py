"""The parts one shared pool replica holds, as live objects: `PoolParts` carries out what
`policy.pool_cache.PoolCache` decides (load on first use, unload the least recently used,
refuse a quarantined part) around every request, and batches each part's calls on their own.

No Ray here: `serving/pool_app.py` wraps it in the Serve deployment and gives it the loader;
unit tests drive it with loaders of their own. What happens when things go wrong:

- A load that raises fails the requests waiting on it with `PartLoadError`; after
  `max_load_failures` failed loads in a row the part is quarantined and refused
  (`PartRefusedError`) while every other part serves.
- A load that kills the replica is counted by the pool's ledger (`LoadGate`, asked before and
  told after every load): once its loads killed `max_load_failures` replicas, every replica of
  the pool refuses the part. So is a call that kills it among the part's first
  `probation_calls` calls after each load (each written down in the ledger, as a load is); a
  part that kills its replica on a later call is restarted with it by Serve and loaded again,
  and so is on probation again.
- A load that outlasts `load_timeout_s` counts as failed (its thread cannot be stopped: what it
  builds afterwards is dropped, never served).
- Loads of one part are one task, shared by every request that needs it; a request that gives
  up (its deadline) leaves the load running for the others, so the cache's books stay true.
- A part whose health check fails is quarantined and unloaded once its last request ends; the
  replica stays healthy for its other parts.
- A part whose calls grow the replica's resident memory by more than `leak_bytes` (net, over
  its calls that ran alone: `policy.leak_watch.LeakWatch`) leaks: it is quarantined here and
  across the pool (the gate's `quarantine`), and unloaded once its last request ends.
- Loads of different parts run at once, each in a thread; the event loop keeps serving the
  parts already loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from ipnext.policy.leak_watch import LeakWatch
from ipnext.policy.pool_cache import AdmitKind, PartKey, PoolCache, PoolStats
from ipnext.serving.pool_layout import PoolEntry

__all__ = [
    "LoadGate",
    "LoadPart",
    "OpenGate",
    "PartBatcher",
    "PartLoadError",
    "PartRefusedError",
    "PoolParts",
]

logger = logging.getLogger("ray.serve")

# Builds one entry's part in a worker thread: (the part object, the bytes it holds as measured).
LoadPart = Callable[[PoolEntry], tuple[Any, int]]


class LoadGate(Protocol):
    """Asked around each load and probation call, `kind` "load" or "call" (a pool's ledger across
    its replicas: serving/pool_ledger.py): `begin` answers None to go on, or why the pool refuses
    the part; `end` reports how it ended; `quarantine` refuses a part across the pool at once
    (it leaks)."""

    async def begin(self, key: PartKey, kind: str = "load") -> str | None: ...

    async def end(self, key: PartKey, error: str | None, kind: str = "load") -> None: ...

    async def quarantine(self, key: PartKey, reason: str) -> None: ...


class OpenGate:
    """No ledger: every load and call may start (unit tests, and a replica outside Ray)."""

    async def begin(self, key: PartKey, kind: str = "load") -> str | None:
        return None

    async def end(self, key: PartKey, error: str | None, kind: str = "load") -> None:
        return None

    async def quarantine(self, key: PartKey, reason: str) -> None:
        return None


class PartRefusedError(RuntimeError):
    """The pool will not serve this part now (quarantined, or larger than a replica's budget):
    the model's set failed this request, and its gates see it."""


class PartLoadError(RuntimeError):
    """The part's load failed for this request (the next request loads it again, until the
    part is quarantined)."""


class PartBatcher:
    """One part's calls gathered into batches for its `batch` method: up to `max_batch_size`
    at once, waiting at most `wait_s` for a batch to fill. Serve's `@serve.batch` batches a
    method of the replica, that is every part of a pool together; this batches per part."""

    def __init__(self, batch: Callable[[list[Any]], Any], max_batch_size: int, wait_s: float) -> None:
        self._batch = batch
        self._max = max_batch_size
        self._wait_s = wait_s
        self._queue: list[tuple[Any, asyncio.Future[Any]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._running: set[asyncio.Task[None]] = set()
        self.batches = 0
        self.calls = 0

    async def submit(self, inputs: Any) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((inputs, future))
        if len(self._queue) >= self._max:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._wait_s, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._queue:
            batch, self._queue = self._queue[: self._max], self._queue[self._max :]
            live = [(inputs, future) for inputs, future in batch if not future.done()]  # callers gone
            if live:
                task = asyncio.ensure_future(self._run(live))
                self._running.add(task)
                task.add_done_callback(self._running.discard)

    async def _run(self, batch: list[tuple[Any, asyncio.Future[Any]]]) -> None:
        self.batches += 1
        self.calls += len(batch)
        try:
            results = self._batch([inputs for inputs, _ in batch])
            if inspect.isawaitable(results):
                results = await results
            results = list(results)
            if len(results) != len(batch):
                raise RuntimeError(f"batch answered {len(results)} of {len(batch)} inputs")
        except Exception as err:  # the whole batch failed: every call in it fails with it
            for _, future in batch:
                if not future.done():
                    future.set_exception(err)
            return
        for (_, future), result in zip(batch, results, strict=True):
            if future.done():
                continue
            if isinstance(result, Exception):  # one call's own failure; the batch went on
                future.set_exception(result)
            else:
                future.set_result(result)


class PoolParts:
    """The live parts of one pool replica within its `PoolCache`'s byte budget."""

    def __init__(
        self,
        cache: PoolCache,
        load: LoadPart,
        load_timeout_s: float,
        on_change: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        gate: LoadGate | None = None,
        probation_calls: int = 0,
        rss: Callable[[], int] = lambda: 0,
        leak_bytes: int = 0,
    ) -> None:
        self._cache = cache
        self._rss = rss  # the process's resident bytes now
        self._leaks = LeakWatch(leak_bytes)  # 0: not watched
        self._gate = gate or OpenGate()
        self._probation_calls = probation_calls
        self._probation: dict[PartKey, int] = {}  # calls still written down in the gate, per part
        self._load = load
        self._load_timeout_s = load_timeout_s
        self._on_change = on_change  # the parts held changed (Serve's routing hears of it)
        self._clock = clock
        self._objects: dict[PartKey, Any] = {}
        self._batchers: dict[PartKey, PartBatcher] = {}
        self._loads: dict[PartKey, asyncio.Task[None]] = {}
        self._settled = asyncio.Event()  # set at each load's end, unload and release: admit again

    def held(self) -> set[PartKey]:
        """The parts loaded or loading here (what Serve should route their requests to)."""
        return set(self._objects) | set(self._loads)

    def stats(self) -> PoolStats:
        return self._cache.stats(self._clock())

    def grown(self) -> dict[PartKey, int]:
        """Each held part's net memory growth charged to its lone calls since its load."""
        return self._leaks.grown()

    async def call(self, entry: PoolEntry, inputs: Any) -> Any:
        """Run `entry`'s part on `inputs`, loading it first if it is not held."""
        key = entry.key
        part = await self._hold(entry)
        try:
            async with self._watched(key), self._measured(key):
                return await self._run(entry, part, inputs)
        finally:
            self._release(key)

    async def _run(self, entry: PoolEntry, part: Any, inputs: Any) -> Any:
        """One call of a held part: through its batcher when its set batches it."""
        batching = entry.host.batching
        if batching is not None:
            batcher = self._batcher(entry.key, part, batching.max_batch_size, batching.wait_ms)
            return await batcher.submit(inputs)
        result = part(inputs)
        return await result if inspect.isawaitable(result) else result

    @contextlib.asynccontextmanager
    async def _watched(self, key: PartKey) -> AsyncIterator[None]:
        """A probation call (one of the part's first `probation_calls` since its load) is
        written down in the gate before it runs and reported after, so the pool counts a call
        that kills this replica; a part the pool refuses meanwhile is quarantined here too."""
        left = self._probation.get(key, 0)
        if left <= 0:
            yield
            return
        self._probation[key] = left - 1
        refused = await self._gate.begin(key, "call")
        if refused is not None:
            self.quarantine(key, f"quarantined by the pool: {refused}")
            raise PartRefusedError(f"{key}: quarantined by the pool: {refused}")
        try:
            yield
        finally:
            # A call that raised is the caller's or the model's error, for its gates: it did not
            # kill the replica, which is all the ledger counts.
            await self._gate.end(key, None, "call")

    @contextlib.asynccontextmanager
    async def _measured(self, key: PartKey) -> AsyncIterator[None]:
        """The call's net change of the process's memory, charged to its part when it ran alone
        (`LeakWatch`); a part found leaking is quarantined here and across the pool."""
        if not self._leaks.on:
            yield
            return
        call = self._leaks.begin(key, self._rss())
        try:
            yield
        finally:
            why = self._leaks.end(call, self._rss())
            if why is not None:
                self.quarantine(key, f"leaks memory: {why}")
                await self._gate.quarantine(key, f"leaks memory: {why}")

    async def stream(self, entry: PoolEntry, inputs: Any) -> AsyncIterator[Any]:
        """The part's answer piece by piece (one piece for a part without `stream`); the part
        is held until the stream ends or its caller goes away."""
        key = entry.key
        part = await self._hold(entry)
        try:
            async with self._watched(key), self._measured(key):
                if not hasattr(part, "stream"):
                    result = part(inputs)
                    yield await result if inspect.isawaitable(result) else result
                    return
                pieces = part.stream(inputs)
                try:
                    async for piece in pieces:
                        yield piece
                finally:
                    await pieces.aclose()
        finally:
            self._release(key)

    async def check_health(self) -> list[str]:
        """Each loaded part's own `check_health`; a part that fails it is quarantined (and
        unloaded once idle), the others serve on. What was quarantined, one line each."""
        failed = []
        for key, part in list(self._objects.items()):
            check = getattr(part, "check_health", None)
            if not callable(check):
                continue
            try:
                result = check()
                if inspect.isawaitable(result):
                    await result
            except Exception as err:
                failed.append(self.quarantine(key, f"health check failed: {err!r}"))
        return failed

    def quarantine(self, key: PartKey, reason: str) -> str:
        """Refuse `key` here from now on (for the cache's quarantine time), unloading it now if
        idle, else after its last request."""
        if self._cache.quarantine(key, reason, self._clock()):
            self._unload(key)
        self._changed()
        logger.warning("pool: quarantined %s: %s", key, reason)
        return f"{key}: {reason}"

    def retire(self, keep: set[PartKey]) -> list[PartKey]:
        """Unload the idle parts no entry of the catalogue names any more (their sets were
        removed); a part in flight stays until the next retire. The parts unloaded."""
        gone = [
            view.key
            for view in self._cache.parts()
            if view.key not in keep and view.state == "ready" and view.in_flight == 0 and not view.doomed
        ]
        for key in gone:
            if self._cache.drop(key):
                self._unload(key)
        if gone:
            self._changed()
        return gone

    async def _hold(self, entry: PoolEntry) -> Any:
        """The part, acquired: admitted, loaded first if it must be, waited for if it is being
        loaded or unloaded, or refused."""
        key = entry.key
        while True:
            decision = self._cache.admit(key, entry.estimate_bytes, self._clock())
            kind = decision.kind
            if kind is AdmitKind.HIT:
                self._cache.acquire(key, self._clock())
                return self._objects[key]
            if kind in (AdmitKind.QUARANTINED, AdmitKind.TOO_LARGE):
                raise PartRefusedError(decision.describe())
            if kind is AdmitKind.LOAD:
                task = self._loads[key] = asyncio.ensure_future(self._load_part(entry, decision.evict))
                task.add_done_callback(self._load_ended)
                self._changed()
                await asyncio.shield(task)  # raises the load's error for this request
                continue
            # WAIT (loading or unloading now) or NO_ROOM (every byte in flight): after a change.
            load = self._loads.get(key)
            if load is not None:
                try:
                    await asyncio.shield(load)
                except PartRefusedError:
                    raise
                except Exception as err:
                    raise PartLoadError(f"{key}: {err}") from err
            else:
                self._settled.clear()
                await self._settled.wait()

    async def _load_part(self, entry: PoolEntry, evict: tuple[PartKey, ...]) -> None:
        key = entry.key
        for victim in evict:
            self._unload(victim)
        refused = await self._gate.begin(key)
        if refused is not None:  # quarantined across the pool (its loads killed replicas)
            self._cache.load_failed(key, refused, self._clock())
            self._cache.quarantine(key, f"quarantined by the pool: {refused}", self._clock())
            self._changed()
            raise PartRefusedError(f"{key}: quarantined by the pool: {refused}")
        self._leaks.load_began()  # memory that is no call's: no call running beside it is charged
        try:
            part, size = await asyncio.wait_for(asyncio.to_thread(self._load, entry), self._load_timeout_s)
        except Exception as err:
            why = (
                f"no answer within {self._load_timeout_s:g} s" if isinstance(err, TimeoutError) else repr(err)
            )
            self._cache.load_failed(key, why, self._clock())
            self._changed()
            await self._gate.end(key, why)
            logger.warning("pool: loading %s failed: %s", key, why)
            raise PartLoadError(f"{key}: loading failed: {why}") from err
        finally:
            self._leaks.load_ended(key)
        await self._gate.end(key, None)
        outcome = self._cache.loaded(key, size, self._clock())
        for victim in outcome.evict:
            self._unload(victim)
        if outcome.kept:
            self._objects[key] = part
            self._probation[key] = self._probation_calls
        else:
            del part
            self._cache.evicted(key)
            logger.warning("pool: %s", outcome.describe())
        self._changed()

    def _load_ended(self, task: asyncio.Task[None]) -> None:
        for key, load in list(self._loads.items()):
            if load is task:
                del self._loads[key]
        if not task.cancelled():
            task.exception()  # retrieved: every request that waited on it has raised it already

    def _release(self, key: PartKey) -> None:
        if self._cache.release(key, self._clock()):  # quarantined in flight: this was its last
            self._unload(key)
        self._changed()

    def _unload(self, key: PartKey) -> None:
        """Drop the part as the cache decided, free its memory, confirm."""
        self._objects.pop(key, None)
        self._batchers.pop(key, None)
        self._probation.pop(key, None)
        self._leaks.unloaded(key)
        gc.collect()  # a part's modules hold reference cycles; their tensors free only now
        self._cache.evicted(key)

    def _batcher(self, key: PartKey, part: Any, max_batch_size: int, wait_ms: float) -> PartBatcher:
        batcher = self._batchers.get(key)
        if batcher is None:
            if not callable(getattr(part, "batch", None)):
                raise PartLoadError(f"{key}: `batching` is set but the part has no `batch` method")
            batcher = self._batchers[key] = PartBatcher(part.batch, max_batch_size, wait_ms / 1000)
        return batcher

    def _changed(self) -> None:
        self._settled.set()
        self._on_change()
