"""A shared pool's part cache without Ray or torch: what it loads, evicts, waits for and refuses,
its quarantine and back-off, its input errors, and its invariants over random call sequences
that follow (and sometimes break) the protocol."""

from __future__ import annotations

import dataclasses
import math
import pickle
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipnext.policy.pool_cache import Admit, AdmitKind, PartKey, PartView, PoolCache, QuarantinedPart

pytestmark = pytest.mark.timeout(60)

A1 = PartKey("alpha", "encoder", "s1")
A2 = PartKey("alpha", "encoder", "s2")  # the same part at another snapshot
B = PartKey("beta", "ranker", "s1")
C = PartKey("gamma", "ranker", "s1")
D = PartKey("delta", "ranker", "s1")


def load(cache: PoolCache, key: PartKey, size: int, now: float) -> Admit:
    """Admit, evict as told, load: the replica's path for a miss."""
    decision = cache.admit(key, size, now)
    assert decision.kind is AdmitKind.LOAD, decision.describe()
    for victim in decision.evict:
        cache.evicted(victim)
    assert cache.loaded(key, size, now).kept
    return decision


def view(cache: PoolCache, key: PartKey) -> PartView | None:
    return next((part for part in cache.parts() if part.key == key), None)


def test_a_part_loads_once_then_hits() -> None:
    cache = PoolCache(100)
    first = cache.admit(A1, 40, 0.0)
    assert (first.kind, first.evict, first.reserve_bytes) == (AdmitKind.LOAD, (), 40)
    assert cache.loaded(A1, 40, 0.5).kept
    assert cache.admit(A1, 40, 1.0).kind is AdmitKind.HIT
    stats = cache.stats(1.0)
    assert (stats.hits, stats.misses, stats.used_bytes, stats.parts_ready, stats.evictions) == (
        1,
        1,
        40,
        1,
        0,
    )


def test_the_least_recently_released_idle_part_is_evicted_first() -> None:
    cache = PoolCache(100)
    load(cache, A1, 40, 0.0)
    load(cache, B, 40, 1.0)
    cache.acquire(A1, 5.0)
    cache.acquire(B, 6.0)  # acquired after A1, released before it: the least recently used
    cache.release(B, 7.0)
    cache.release(A1, 8.0)
    decision = cache.admit(C, 40, 9.0)
    assert decision.evict == (B,) and "after unloading beta/ranker@s1" in decision.describe()
    assert view(cache, B) == PartView(B, "evicting", 40, 7.0) and cache.stats(9.0).evictions == 1


def test_a_part_in_flight_or_loading_is_never_evicted() -> None:
    cache = PoolCache(100)
    load(cache, A1, 40, 0.0)
    load(cache, B, 40, 1.0)
    cache.acquire(A1, 2.0)  # A1 stays in flight ...
    cache.acquire(B, 3.0)
    cache.release(B, 4.0)
    assert cache.admit(C, 40, 5.0).evict == (B,)  # ... so B goes, though used later
    cache.evicted(B)
    refused = cache.admit(D, 30, 6.0)  # A1 in flight, C loading: 40 + 40 + 30 is 10 over
    assert (refused.kind, refused.short_bytes) == (AdmitKind.NO_ROOM, 10) and "10 short" in refused.describe()
    assert cache.stats(6.0).refusals == 1 and view(cache, D) is None


def test_room_counts_only_idle_ready_parts() -> None:
    cache = PoolCache(100)
    assert cache.admit(A1, 60, 0.0).kind is AdmitKind.LOAD
    refused = cache.admit(B, 60, 1.0)  # A1 is loading: nothing to evict
    assert (refused.kind, refused.short_bytes, refused.reserve_bytes) == (AdmitKind.NO_ROOM, 20, 60)


def test_a_part_larger_than_the_whole_budget_is_refused() -> None:
    cache = PoolCache(100)
    refused = cache.admit(A1, 101, 0.0)
    assert refused.kind is AdmitKind.TOO_LARGE and "budget of 100" in refused.describe()
    assert cache.parts() == () and cache.stats(0.0).refusals == 1


def test_evicted_bytes_stay_counted_until_the_caller_confirms_them() -> None:
    cache = PoolCache(100)
    load(cache, A1, 60, 0.0)
    decision = cache.admit(B, 50, 1.0)
    assert decision.evict == (A1,)
    stats = cache.stats(1.0)  # A1's 60 still held; B adds nothing beyond what A1 gives back
    assert (stats.used_bytes, stats.committed_bytes, stats.evicting_bytes) == (60, 50, 60)
    with pytest.raises(ValueError, match="waits for the unload of alpha/encoder@s1"):
        cache.loaded(B, 50, 2.0)
    assert cache.admit(A1, 60, 2.0).kind is AdmitKind.WAIT
    # Meanwhile: 40 more fit beside A1's 60 (B starts only after A1 is gone); 30 more do not.
    assert cache.admit(C, 40, 3.0).evict == ()
    assert cache.admit(D, 30, 3.0).short_bytes == 30
    cache.evicted(A1)
    assert cache.stats(4.0).used_bytes == 90
    assert cache.loaded(B, 50, 4.0).kept and cache.loaded(C, 40, 4.0).kept
    assert cache.stats(4.0).used_bytes == 90


def test_a_request_for_a_part_loading_or_unloading_waits() -> None:
    cache = PoolCache(100)
    cache.admit(A1, 10, 0.0)
    waiting = cache.admit(A1, 10, 0.5)
    assert waiting.kind is AdmitKind.WAIT and "loading now" in waiting.describe()
    assert not waiting.evict and cache.stats(0.5).waits == 1 and cache.stats(0.5).misses == 1


def test_a_part_measured_over_its_reservation_evicts_to_stay_in_budget() -> None:
    cache = PoolCache(100)
    load(cache, A1, 30, 0.0)
    load(cache, B, 30, 1.0)
    assert cache.admit(C, 30, 2.0).evict == ()
    kept = cache.loaded(C, 50, 3.0)  # 20 over its reservation: 10 over the budget
    assert kept.kept and kept.evict == (A1,) and "unload alpha/encoder@s1" in kept.describe()
    assert cache.stats(3.0).used_bytes == 110  # true until A1 is unloaded
    cache.evicted(A1)
    assert cache.stats(3.0).used_bytes == 80


def test_a_part_measured_over_the_room_it_can_get_is_unloaded_and_reserves_its_size_next() -> None:
    cache = PoolCache(100)
    load(cache, A1, 60, 0.0)
    cache.acquire(A1, 0.0)
    cache.admit(B, 30, 1.0)
    unloaded = cache.loaded(B, 50, 2.0)
    assert not unloaded.kept and "50 bytes measured, 30 reserved" in unloaded.describe()
    assert view(cache, B) == PartView(B, "evicting", 50, 2.0)
    cache.evicted(B)
    again = cache.admit(B, 30, 3.0)  # the estimate says 30; the pinned snapshot measured 50
    assert (again.kind, again.reserve_bytes, again.short_bytes) == (AdmitKind.NO_ROOM, 50, 10)
    cache.admit(C, 10, 4.0)
    assert not cache.loaded(C, 101, 5.0).kept
    cache.evicted(C)
    assert cache.admit(C, 10, 6.0).kind is AdmitKind.TOO_LARGE


def test_two_failed_loads_in_a_row_quarantine_that_snapshot_only() -> None:
    cache = PoolCache(100, quarantine_s=10.0)
    cache.admit(A1, 10, 0.0)
    cache.load_failed(A1, "CUDA error: out of memory", 0.5)
    assert cache.admit(A1, 10, 1.0).kind is AdmitKind.LOAD  # one failure: tried again
    cache.load_failed(A1, "checksum mismatch in model.safetensors", 1.5)
    refused = cache.admit(A1, 10, 2.0)
    assert (refused.kind, refused.until) == (AdmitKind.QUARANTINED, 11.5)
    assert "load failed 2 times in a row; last: checksum mismatch" in refused.describe()
    assert cache.admit(A2, 10, 2.0).kind is AdmitKind.LOAD  # the model's other snapshot loads
    assert cache.stats(2.0).quarantined == (QuarantinedPart(A1, refused.reason, 11.5, 1),)
    assert cache.stats(2.0).load_failures == 2
    assert cache.stats(11.5).quarantined == () and cache.admit(A1, 10, 11.5).kind is AdmitKind.LOAD


def test_a_repeated_quarantine_backs_off_exponentially_up_to_its_cap() -> None:
    cache = PoolCache(100, quarantine_s=10.0, max_quarantine_s=35.0)
    now, lengths = 0.0, []
    for _ in range(4):
        while cache.admit(A1, 10, now).kind is AdmitKind.LOAD:  # after a quarantine, one failure
            cache.load_failed(A1, "boom", now)
        until = cache.admit(A1, 10, now).until
        assert until is not None
        lengths.append(until - now)
        now = until
    assert lengths == [10.0, 20.0, 35.0, 35.0]
    assert cache.quarantine(A1, "crashed its replica", now, for_s=3.0) is False
    assert cache.admit(A1, 10, now).until == now + 3.0


def test_a_successful_load_clears_the_failures() -> None:
    cache = PoolCache(100)
    cache.admit(A1, 10, 0.0)
    cache.load_failed(A1, "timeout", 0.0)
    load(cache, A1, 10, 1.0)
    cache.acquire(A1, 1.0)
    cache.release(A1, 1.0)
    cache.quarantine(A1, "drill", 1.0, for_s=1.0)
    cache.evicted(A1)
    cache.admit(A1, 10, 2.0)
    cache.load_failed(A1, "timeout", 2.0)  # the first in a row since the success
    assert cache.admit(A1, 10, 2.0).kind is AdmitKind.LOAD


def test_quarantine_unloads_an_idle_part_now_one_in_flight_after_its_last_request() -> None:
    cache = PoolCache(100, quarantine_s=5.0)
    load(cache, A1, 10, 0.0)
    load(cache, B, 10, 0.0)
    assert cache.quarantine(A1, "RSS grew 2 GiB past its size", 1.0) is True
    assert view(cache, A1) is not None and view(cache, A1).state == "evicting"  # type: ignore[union-attr]
    cache.acquire(B, 1.0)
    cache.acquire(B, 1.0)
    assert cache.quarantine(B, "its replica crashed with it in flight", 2.0) is False
    assert cache.admit(B, 10, 2.0).kind is AdmitKind.QUARANTINED
    with pytest.raises(ValueError, match="quarantined"):
        cache.acquire(B, 2.0)
    assert cache.admit(B, 10, 8.0).kind is AdmitKind.WAIT  # the quarantine ended; it is still doomed
    assert cache.release(B, 9.0) is False and cache.release(B, 9.0) is True
    assert view(cache, B) == PartView(B, "evicting", 10, 9.0, doomed=True)
    cache.admit(C, 10, 9.0)
    cache.quarantine(C, "drill", 9.0)
    assert not cache.loaded(C, 10, 9.5).kept  # quarantined while loading
    assert cache.stats(9.5).evictions == 0  # quarantine's unloads are not evictions for room


BAD_CALLS: list[tuple[str, Callable[[PoolCache], object], str]] = [
    ("negative estimate", lambda c: c.admit(C, -1, 5.0), "estimate_bytes: -1 is no byte count"),
    ("bool estimate", lambda c: c.admit(C, True, 5.0), "estimate_bytes"),
    ("float estimate", lambda c: c.admit(C, 1.5, 5.0), "estimate_bytes"),
    ("not a key", lambda c: c.admit("alpha", 1, 5.0), "key: 'alpha' is no PartKey"),  # type: ignore[arg-type]
    ("nan now", lambda c: c.admit(C, 1, math.nan), "now: nan"),
    ("now going back", lambda c: c.admit(C, 1, 1.0), "never below the last call's 4.0"),
    ("loaded unknown", lambda c: c.loaded(D, 1, 5.0), "key: delta/ranker@s1 is not in the pool"),
    ("negative size", lambda c: c.loaded(C, -5, 5.0), "size_bytes: -5"),
    ("loaded twice", lambda c: c.loaded(A1, 10, 5.0), "is ready, not loading"),
    ("release without acquire", lambda c: c.release(A1, 5.0), "release\\(\\) once per acquire\\(\\)"),
    ("acquire unknown", lambda c: c.acquire(D, 5.0), "not in the pool"),
    ("acquire loading", lambda c: c.acquire(C, 5.0), "is loading, not ready"),
    ("evicted not evicting", lambda c: c.evicted(A1), "is ready, not evicting"),
    ("load_failed ready", lambda c: c.load_failed(A1, "x", 5.0), "is ready, not loading"),
    ("load_failed error", lambda c: c.load_failed(C, None, 5.0), "error: None"),  # type: ignore[arg-type]
    ("empty reason", lambda c: c.quarantine(A1, " ", 5.0), "reason: ' '"),
    ("zero for_s", lambda c: c.quarantine(A1, "x", 5.0, for_s=0), "for_s: 0"),
    ("infinite for_s", lambda c: c.quarantine(A1, "x", 5.0, for_s=math.inf), "for_s: inf"),
]


@pytest.mark.parametrize(("case", "call", "message"), BAD_CALLS, ids=[case for case, _, _ in BAD_CALLS])
def test_bad_input_raises_naming_the_field_and_changes_nothing(
    case: str, call: Callable[[PoolCache], object], message: str
) -> None:
    cache = PoolCache(100)
    load(cache, A1, 10, 0.0)
    cache.admit(C, 10, 4.0)
    before = (cache.parts(), cache.stats(4.0))
    with pytest.raises(ValueError, match=message):
        call(cache)
    assert (cache.parts(), cache.stats(4.0)) == before
    assert cache.admit(B, 1, 4.0).kind is AdmitKind.LOAD  # the clock did not move either


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: PoolCache(0), "budget_bytes: 0"),
        (lambda: PoolCache(-1), "budget_bytes: -1"),
        (lambda: PoolCache(10, max_load_failures=0), "max_load_failures: 0"),
        (lambda: PoolCache(10, quarantine_s=-1.0), "quarantine_s: -1.0"),
        (lambda: PartKey("", "part", "s1"), "PartKey.model: ''"),
        (lambda: PartKey("m", "part", 3), "PartKey.snapshot_id: 3"),  # type: ignore[arg-type]
    ],
)
def test_bad_settings_and_keys_are_refused(build: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_stats_are_a_frozen_value_for_the_metrics_actor_and_every_decision_reads() -> None:
    cache = PoolCache(100)
    load(cache, A1, 10, 0.0)
    stats = cache.stats(0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.hits = 3  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(stats)) == stats
    for kind in AdmitKind:
        text = Admit(kind, A1, evict=(B,), reserve_bytes=5, reason="why", until=1.0).describe()
        assert text.startswith("alpha/encoder@s1: ") and len(text) > 25, text


# -- the invariants over random call sequences -----------------------------------------------------

KEYS = [PartKey(m, p, s) for m in ("m1", "m2") for p in ("enc", "dec") for s in ("s1", "s2")]
BUDGET = 60
CALLS = (
    ("admit",) * 3
    + ("loaded",) * 3
    + ("acquire", "release") * 2
    + ("evicted",) * 3
    + ("load_failed", "quarantine")
)
STEP = st.tuples(
    st.sampled_from(CALLS),
    st.integers(0, 63),  # which key: among those the call fits, or (when `aim` is 0) any key
    st.integers(0, 7),  # aim
    st.integers(5, 65),  # an estimate; a loaded size is the reservation, less or (above 50) more
    st.integers(0, 3),  # seconds passing before the call
)
FITS: dict[str, Callable[[PartView], bool]] = {
    "loaded": lambda p: p.state == "loading" and not p.waits_for,
    "load_failed": lambda p: p.state == "loading",
    "acquire": lambda p: p.state == "ready" and not p.doomed,
    "release": lambda p: p.state == "ready" and p.in_flight > 0,
    "evicted": lambda p: p.state == "evicting",
}

# Each call the protocol can refuse, as (cache, key, size, now) -> whatever it returns.
PROTOCOL_CALLS: dict[str, Callable[[PoolCache, PartKey, int, float], object]] = {
    "loaded": lambda cache, key, size, now: cache.loaded(key, size, now),
    "load_failed": lambda cache, key, size, now: cache.load_failed(key, "boom", now),
    "acquire": lambda cache, key, size, now: cache.acquire(key, now),
    "release": lambda cache, key, size, now: cache.release(key, now),
    "evicted": lambda cache, key, size, now: cache.evicted(key),
}


def check_admit(before: tuple[PartView, ...], decision: Admit, estimate: int, used: int) -> None:
    """`used`: the pool's used bytes before the call."""
    idle = [p for p in before if p.state == "ready" and p.in_flight == 0 and p.key != decision.key]
    needed = used + decision.reserve_bytes - BUDGET
    if decision.kind is AdmitKind.LOAD:
        # The least recently used idle parts, oldest first, and no more than the room needs.
        victims = idle[: len(decision.evict)]
        assert decision.evict == tuple(p.key for p in victims) and decision.reserve_bytes >= estimate
        assert sum(p.size_bytes for p in victims) >= needed
        assert not victims or sum(p.size_bytes for p in victims[:-1]) < needed
    if decision.kind is AdmitKind.NO_ROOM:
        assert sum(p.size_bytes for p in idle) + decision.short_bytes == needed


def check_invariants(cache: PoolCache, now: float, honest: bool, last: dict[str, int]) -> None:
    stats, parts = cache.stats(now), cache.parts()
    assert stats.committed_bytes == sum(p.size_bytes for p in parts if p.state != "evicting") <= BUDGET
    assert stats.used_bytes <= BUDGET or (not honest and stats.evicting_bytes > 0)
    assert all(p.in_flight >= 0 and p.size_bytes >= 0 for p in parts)
    assert all(p.in_flight == 0 for p in parts if p.state != "ready")
    assert [p.last_used for p in parts] == sorted(p.last_used for p in parts)  # LRU first
    evicting = {p.key for p in parts if p.state == "evicting"}
    assert all(set(p.waits_for) <= evicting for p in parts)
    for part in parts:  # a quarantined part serves no new request
        if any(q.key == part.key for q in stats.quarantined):
            assert part.state != "ready" or part.doomed
    counters = {
        f: getattr(stats, f) for f in ("hits", "misses", "waits", "refusals", "evictions", "load_failures")
    }
    assert all(counters[f] >= last.get(f, 0) >= 0 for f in counters)
    last.update(counters)


@settings(max_examples=250, deadline=None, derandomize=True)
@given(st.lists(STEP, min_size=10, max_size=80))
def test_invariants_hold_after_every_call(steps: list[tuple[str, int, int, int, int]]) -> None:
    cache = PoolCache(BUDGET, quarantine_s=4.0, max_quarantine_s=16.0)
    now, honest, last = 0.0, True, dict[str, int]()
    for call, pick, aim, amount, wait in steps:
        now += wait
        before = cache.parts()
        fits = [p.key for p in before if FITS[call](p)] if call in FITS else KEYS
        key = KEYS[pick % len(KEYS)] if aim == 0 or not fits else fits[pick % len(fits)]
        part = next((p for p in before if p.key == key), None)
        used = cache.stats(now).used_bytes
        valid = call not in FITS or (part is not None and FITS[call](part))
        if not valid:
            stats = cache.stats(now)
            with pytest.raises(ValueError, match="key: "):
                PROTOCOL_CALLS[call](cache, key, amount, now)
            assert (cache.parts(), cache.stats(now)) == (before, stats)
        elif call == "admit":
            check_admit(before, cache.admit(key, amount, now), amount, used)
        elif call == "loaded":
            assert part is not None
            size = part.size_bytes + amount - 50 if amount > 50 else max(0, part.size_bytes - amount % 7)
            honest = honest and size <= part.size_bytes
            decision = cache.loaded(key, size, now)
            idle = [p.key for p in before if p.state == "ready" and p.in_flight == 0]
            assert decision.evict == tuple(idle[: len(decision.evict)])
        elif call == "load_failed":
            cache.load_failed(key, "boom", now)
        elif call in ("acquire", "release"):
            getattr(cache, call)(key, now)
            assert cache.parts()[-1].key == key and cache.parts()[-1].last_used == now  # most recent
        elif call == "evicted":
            cache.evicted(key)
        else:
            cache.quarantine(key, "drill", now, for_s=float(amount) if amount % 2 else None)
        check_invariants(cache, now, honest, last)


def test_drop_unloads_only_an_idle_loaded_part_and_is_no_quarantine() -> None:
    cache = PoolCache(1000)
    load(cache, A1, 100, 1.0)
    load(cache, B, 100, 1.0)
    cache.acquire(B, 2.0)
    assert not cache.drop(B)  # in flight: stays
    assert not cache.drop(C)  # not here
    assert cache.drop(A1)
    assert view(cache, A1) is not None and view(cache, A1).state == "evicting"  # type: ignore[union-attr]
    cache.evicted(A1)
    assert cache.stats(3.0).quarantined == ()
    assert cache.admit(A1, 100, 3.0).kind is AdmitKind.LOAD  # it may come back at once
