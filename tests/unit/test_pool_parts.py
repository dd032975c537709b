"""A pool replica's live parts without Ray: loads shared by concurrent requests, eviction by
bytes with the evicted part really let go, failed and hung loads, quarantine that spares the
other parts, health checks, batching per part, retirement, and a caller that gives up mid-load.
The loader is a test double (the seam `pool_app.load_entry` fills with real snapshots)."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from collections.abc import Callable
from typing import Any

import pytest

from ipnext.policy.pool_cache import PartKey, PoolCache
from ipnext.serving.layout import PartHostArgs
from ipnext.serving.pool_layout import PoolEntry
from ipnext.serving.pool_parts import PartLoadError, PartRefusedError, PoolParts
from ipnext.spec.model import BatchingSpec

pytestmark = pytest.mark.timeout(60)


def entry(
    model: str, size: int = 100, snapshot: str = "s1", batching: BatchingSpec | None = None
) -> PoolEntry:
    host = PartHostArgs(
        model=model,
        part="ranker",
        factory="tests.parts:Nothing",
        uri="file:///nowhere",
        sha256="0" * 64,
        snapshot_id=snapshot,
        pinned_store="/nowhere",
        batching=batching,
    )
    return PoolEntry(host=host, estimate_bytes=size)


class Part:
    """A part that answers its model's name and counts its calls; `batch` answers a list."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0
        self.batches: list[int] = []
        self.healthy = True

    def __call__(self, inputs: Any) -> str:
        self.calls += 1
        return f"{self.name}:{inputs}"

    async def batch(self, inputs: list[Any]) -> list[Any]:
        self.batches.append(len(inputs))
        return [ValueError("bad input") if x == "bad" else f"{self.name}:{x}" for x in inputs]

    def check_health(self) -> None:
        if not self.healthy:
            raise RuntimeError("engine stalled")


class Loader:
    """Builds a `Part` per entry, counting loads; a model named in `fails` raises, one named in
    `hangs` blocks until released (the thread cannot be stopped, as in a replica)."""

    def __init__(self, fails: set[str] = frozenset(), hangs: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.fails = set(fails)
        self.hangs = set(hangs)
        self.loads: list[str] = []
        self.built: dict[str, weakref.ref[Part]] = {}
        self.release = threading.Event()
        self.entered = threading.Event()

    def __call__(self, e: PoolEntry) -> tuple[Any, int]:
        model = e.host.model
        self.loads.append(model)
        self.entered.set()
        if model in self.hangs:
            self.release.wait(10)
        if model in self.fails:
            raise RuntimeError(f"{model}: tensor 'w' is missing from the snapshot")
        part = Part(model)
        self.built[model] = weakref.ref(part)
        return part, e.estimate_bytes


def pool(
    loader: Loader, budget: int = 300, timeout_s: float = 5.0, clock: Callable[[], float] | None = None
) -> PoolParts:
    cache = PoolCache(budget, max_load_failures=2, quarantine_s=60)
    return PoolParts(cache, loader, timeout_s, clock=clock) if clock else PoolParts(cache, loader, timeout_s)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_first_use_loads_once_for_concurrent_requests_then_hits() -> None:
    loader = Loader()

    async def go() -> list[str]:
        parts = pool(loader)
        first = await asyncio.gather(*(parts.call(entry("alpha"), i) for i in range(5)))
        return [*first, await parts.call(entry("alpha"), 9)]

    assert run(go()) == [f"alpha:{i}" for i in range(5)] + ["alpha:9"]
    assert loader.loads == ["alpha"]


def test_budget_evicts_least_recently_used_and_lets_it_go() -> None:
    loader = Loader()

    async def go() -> PoolParts:
        parts = pool(loader, budget=300)
        for model in ("alpha", "beta", "gamma"):
            await parts.call(entry(model), 0)
        await parts.call(entry("alpha"), 1)  # beta is now the least recently used
        await parts.call(entry("delta"), 0)
        return parts

    parts = run(go())
    gc.collect()
    assert {key.model for key in parts.held()} == {"alpha", "gamma", "delta"}
    assert loader.built["beta"]() is None, "the evicted part is still referenced"
    stats = parts.stats()
    assert (stats.evictions, stats.used_bytes, stats.misses) == (1, 300, 4)


def test_failed_loads_quarantine_that_part_and_the_pool_serves_the_rest() -> None:
    loader = Loader(fails={"bad"})

    async def go() -> list[str]:
        parts = pool(loader)
        seen = []
        for _ in range(3):
            try:
                await parts.call(entry("bad"), 0)
            except (PartLoadError, PartRefusedError) as err:
                seen.append(type(err).__name__)
            seen.append(await parts.call(entry("good"), 1))
        assert [q.key.model for q in parts.stats().quarantined] == ["bad"]
        return seen

    assert run(go()) == ["PartLoadError", "good:1", "PartLoadError", "good:1", "PartRefusedError", "good:1"]
    assert loader.loads.count("bad") == 2  # quarantined after two: the third was refused unloaded


def test_a_new_snapshot_of_a_quarantined_part_still_loads() -> None:
    loader = Loader(fails={"alpha"})

    async def go() -> str:
        parts = pool(loader)
        for _ in range(2):
            with pytest.raises(PartLoadError):
                await parts.call(entry("alpha"), 0)
        loader.fails.clear()
        with pytest.raises(PartRefusedError, match="quarantined"):
            await parts.call(entry("alpha"), 0)
        return str(await parts.call(entry("alpha", snapshot="s2"), 0))

    assert run(go()) == "alpha:0"


def test_a_load_past_its_timeout_fails_and_its_late_part_is_never_served() -> None:
    loader = Loader(hangs={"slow"})

    async def go() -> None:
        parts = pool(loader, timeout_s=0.2)
        with pytest.raises(PartLoadError, match=r"no answer within 0\.2 s"):
            await parts.call(entry("slow"), 0)
        loader.release.set()
        await asyncio.sleep(0.1)
        assert PartKey("slow", "ranker", "s1") not in parts.held()
        assert parts.stats().used_bytes == 0
        assert await parts.call(entry("quick"), 1) == "quick:1"

    run(go())


def test_a_caller_that_gives_up_leaves_the_load_to_finish_for_the_next() -> None:
    loader = Loader(hangs={"alpha"})

    async def go() -> None:
        parts = pool(loader)
        waiting = asyncio.ensure_future(parts.call(entry("alpha"), 0))
        await asyncio.to_thread(loader.entered.wait, 5)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        loader.release.set()
        assert await parts.call(entry("alpha"), 1) == "alpha:1"
        assert loader.loads == ["alpha"]
        assert parts.stats().in_flight == 0

    run(go())


def test_failing_health_check_quarantines_the_part_after_its_last_request() -> None:
    loader = Loader()

    async def go() -> None:
        parts = pool(loader)
        await parts.call(entry("alpha"), 0)
        await parts.call(entry("beta"), 0)
        part = loader.built["alpha"]()
        assert part is not None
        part.healthy = False
        del part
        failed = await parts.check_health()
        assert len(failed) == 1 and "alpha/ranker@s1: health check failed" in failed[0]
        assert {key.model for key in parts.held()} == {"beta"}
        with pytest.raises(PartRefusedError):
            await parts.call(entry("alpha"), 1)
        assert await parts.call(entry("beta"), 1) == "beta:1"

    run(go())
    gc.collect()
    assert loader.built["alpha"]() is None


def test_batching_gathers_each_parts_calls_on_their_own() -> None:
    loader = Loader()
    batching = BatchingSpec(max_batch_size=4, wait_ms=20)

    async def go() -> list[Any]:
        parts = pool(loader)
        calls = [
            parts.call(entry(model, batching=batching), i) for i in range(4) for model in ("alpha", "beta")
        ]
        calls.append(parts.call(entry("alpha", batching=batching), "bad"))
        return await asyncio.gather(*calls, return_exceptions=True)

    answers = run(go())
    assert answers[:8] == [f"{m}:{i}" for i in range(4) for m in ("alpha", "beta")]
    assert isinstance(answers[8], ValueError)  # one call's failure; its batch-mates answered
    for model in ("alpha", "beta"):
        part = loader.built[model]()
        assert part is not None and sum(part.batches) == (5 if model == "alpha" else 4)
        assert len(part.batches) < sum(part.batches), f"{model} was never batched: {part.batches}"


def test_retire_unloads_idle_parts_no_entry_names() -> None:
    loader = Loader()

    async def go() -> None:
        parts = pool(loader)
        for model in ("alpha", "beta"):
            await parts.call(entry(model), 0)
        gone = parts.retire({entry("beta").key})
        assert [key.model for key in gone] == ["alpha"]
        assert {key.model for key in parts.held()} == {"beta"}
        assert parts.stats().quarantined == ()  # retired, not quarantined: it may come back
        assert await parts.call(entry("alpha"), 1) == "alpha:1"

    run(go())
    assert loader.loads == ["alpha", "beta", "alpha"]


def test_no_room_waits_for_a_release_instead_of_failing() -> None:
    loader = Loader()
    gate = asyncio.Event

    async def go() -> list[str]:
        parts = pool(loader, budget=100)
        hold = gate()

        class Slow(Part):
            async def __call__(self, inputs: Any) -> str:  # type: ignore[override]
                await hold.wait()
                return f"{self.name}:{inputs}"

        loader_call = loader.__call__

        def build(e: PoolEntry) -> tuple[Any, int]:
            part, size = loader_call(e)
            return (Slow(e.host.model) if e.host.model == "alpha" else part), size

        parts._load = build  # the seam, swapped for this one test's slow part
        busy = asyncio.ensure_future(parts.call(entry("alpha"), 0))
        await asyncio.sleep(0.05)
        other = asyncio.ensure_future(parts.call(entry("beta"), 0))  # no room while alpha runs
        await asyncio.sleep(0.05)
        assert not other.done()
        hold.set()
        return [await busy, await other]

    assert run(go()) == ["alpha:0", "beta:0"]


class Gate:
    """A pool ledger double: refuses the loads and calls of the models in `refuse`, and the calls
    of those in `refuse_calls`; records what it was told of loads (`told`) and every begin and
    end (`log`)."""

    def __init__(self, refuse: set[str], refuse_calls: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.refuse = refuse
        self.refuse_calls = set(refuse_calls)
        self.told: list[tuple[str, str | None]] = []
        self.log: list[tuple[str, str, str]] = []

    async def begin(self, key: PartKey, kind: str = "load") -> str | None:
        self.log.append(("begin", kind, key.model))
        if kind == "call" and key.model in self.refuse_calls:
            return "its calls killed 2 replicas"
        return "its loads killed 2 replicas" if key.model in self.refuse else None

    async def end(self, key: PartKey, error: str | None, kind: str = "load") -> None:
        self.log.append(("end", kind, key.model))
        if kind == "load":
            self.told.append((key.model, error))

    async def quarantine(self, key: PartKey, reason: str) -> None:
        self.log.append(("quarantine", reason, key.model))


def test_the_pools_ledger_is_asked_before_each_load_and_told_after() -> None:
    loader = Loader(fails={"beta"})
    gate = Gate(refuse={"alpha"})

    async def go() -> None:
        parts = PoolParts(PoolCache(300), loader, 5.0, gate=gate)
        with pytest.raises(PartRefusedError, match="quarantined by the pool: its loads killed 2 replicas"):
            await parts.call(entry("alpha"), 0)
        with pytest.raises(PartRefusedError):  # refused here from now on, the ledger not asked again
            await parts.call(entry("alpha"), 0)
        with pytest.raises(PartLoadError):
            await parts.call(entry("beta"), 0)
        assert await parts.call(entry("gamma"), 0) == "gamma:0"

    run(go())
    assert "alpha" not in loader.loads  # refused before loading
    assert gate.told[0][0] == "beta" and "missing from the snapshot" in str(gate.told[0][1])
    assert gate.told[1] == ("gamma", None)


def test_a_parts_first_calls_after_each_load_are_written_down_in_the_pools_ledger() -> None:
    """Probation: the first `probation_calls` calls after a load are begun and ended in the
    gate (a call that raised ends as one that did not kill the replica); later calls are not;
    a part evicted and loaded again is on probation again; a probation call the pool refuses
    quarantines the part here while its pool-mates serve."""
    loader = Loader()
    gate = Gate(refuse=set(), refuse_calls={"gamma"})

    async def go() -> list[Any]:
        parts = PoolParts(PoolCache(200), loader, 5.0, gate=gate, probation_calls=2)
        answers = [await parts.call(entry("alpha"), n) for n in range(3)]
        answers.append(await parts.call(entry("beta"), 0))
        answers.append(await parts.call(entry("delta"), 0))  # evicts alpha (200 bytes: two parts)
        answers.append(await parts.call(entry("alpha"), 3))  # loaded again: on probation again
        with pytest.raises(PartRefusedError, match="its calls killed 2 replicas"):
            await parts.call(entry("gamma"), 0)
        with pytest.raises(PartRefusedError, match="quarantined"):  # refused here from now on
            await parts.call(entry("gamma"), 0)
        answers.append(await parts.call(entry("alpha"), 4))
        return answers

    answers = run(go())
    assert answers == ["alpha:0", "alpha:1", "alpha:2", "beta:0", "delta:0", "alpha:3", "alpha:4"]
    calls = [(what, model) for what, kind, model in gate.log if kind == "call"]
    assert calls[:4] == [("begin", "alpha"), ("end", "alpha"), ("begin", "alpha"), ("end", "alpha")]
    assert calls.count(("begin", "alpha")) == 4  # two after each of its two loads, none for its third call
    assert ("begin", "gamma") in calls and ("end", "gamma") not in calls  # refused before it ran
    assert loader.loads.count("gamma") == 1


def test_a_probation_call_that_raises_is_ended_as_one_that_did_not_kill_the_replica() -> None:
    gate = Gate(refuse=set())

    class Raises(Part):
        def __call__(self, inputs: Any) -> str:
            raise ValueError("bad input")

    async def go() -> None:
        parts = PoolParts(
            PoolCache(300), lambda e: (Raises(e.host.model), 100), 5.0, gate=gate, probation_calls=1
        )
        with pytest.raises(ValueError, match="bad input"):
            await parts.call(entry("alpha"), 0)

    run(go())
    assert [(what, kind) for what, kind, _ in gate.log] == [
        ("begin", "load"),
        ("end", "load"),
        ("begin", "call"),
        ("end", "call"),
    ]


MIB = 1024 * 1024


class Memory:
    """The process's resident bytes as the replica reads them: each call of a model named in
    `leaks` keeps 8 MiB; every other call uses 2 MiB and gives it back."""

    def __init__(self, leaks: set[str]) -> None:
        self.rss = 500 * MIB
        self.leaks = leaks

    def part(self, name: str) -> Part:
        memory = self

        class Measured(Part):
            def __call__(self, inputs: Any) -> str:
                memory.rss += 8 * MIB if name in memory.leaks else 0
                return super().__call__(inputs)

        return Measured(name)


def test_a_part_whose_calls_grow_the_replica_is_quarantined_here_and_across_the_pool() -> None:
    memory = Memory(leaks={"leaky"})
    gate = Gate(refuse=set())

    def load(e: PoolEntry) -> tuple[Any, int]:
        memory.rss += 3 * MIB  # a load's own memory is never a call's
        return memory.part(e.host.model), e.estimate_bytes

    async def go() -> list[str]:
        parts = PoolParts(PoolCache(300), load, 5.0, gate=gate, rss=lambda: memory.rss, leak_bytes=64 * MIB)
        outcomes = []
        for i in range(20):
            assert await parts.call(entry("steady"), i) == f"steady:{i}"
            try:
                await parts.call(entry("leaky"), i)
                outcomes.append("answered")
            except PartRefusedError as err:
                outcomes.append(str(err))
        assert parts.grown()[PartKey("steady", "ranker", "s1")] == 0
        assert PartKey("leaky", "ranker", "s1") not in parts.held()  # unloaded after its last call
        return outcomes

    outcomes = run(go())
    # 3 warm calls not charged, then 8 MiB a call: the ninth charged call passes 64 MiB.
    assert outcomes[:12] == ["answered"] * 12
    assert all("leaks memory" in o for o in outcomes[12:]), outcomes[12:]
    [(_, reason, model)] = [entry_ for entry_ in gate.log if entry_[0] == "quarantine"]
    assert model == "leaky" and "grew the replica's memory by 72 MiB over 9 lone calls" in reason


def test_calls_that_overlap_are_never_charged() -> None:
    memory = Memory(leaks={"leaky"})

    def load(e: PoolEntry) -> tuple[Any, int]:
        if e.host.model == "slow":

            class Slow(Part):
                async def __call__(self, inputs: Any) -> str:  # type: ignore[override]
                    await asyncio.sleep(0.5)
                    return "slow"

            return Slow("slow"), e.estimate_bytes
        return memory.part(e.host.model), e.estimate_bytes

    async def overlapped() -> dict[PartKey, int]:
        parts = PoolParts(PoolCache(300), load, 5.0, rss=lambda: memory.rss, leak_bytes=64 * MIB)
        await parts.call(entry("slow"), 0)  # loaded, its calls sleep half a second
        slow = asyncio.ensure_future(parts.call(entry("slow"), 1))
        await asyncio.sleep(0.05)
        for i in range(20):  # each beside the slow call still running: nothing charged
            await parts.call(entry("leaky"), i)
        await slow
        return parts.grown()

    grown = run(overlapped())
    assert grown.get(PartKey("leaky", "ranker", "s1"), 0) == 0
