"""Which models' parts one shared pool replica keeps loaded (pure; the replica calls it around
every load and request): a byte budget the pool counts itself, the least recently used idle
parts evicted to make room, and parts that fail to load or misbehave quarantined.

Bytes, not RSS nor a count: freed torch memory does not shrink RSS, and Serve's
`@serve.multiplexed` evicts by model count. A part holds its estimate (its snapshot manifest's
file sizes) while it loads, then what the loader measured (its tensors' `nbytes`); a key's next
load reserves the larger of its estimate and its last measured size.

Decision, effect, confirmation: no call here changes memory. A part a decision names to unload
(`admit`'s evictions; `loaded` for a part that measured more than it reserved; `quarantine`;
`drop`; `release` of a quarantined part's last request) is *evicting*: its bytes stay counted until the
caller has unloaded it (`del`, `gc.collect()`, `torch.cuda.empty_cache()`) and called
`evicted(key)`, and `loaded` refuses a part whose evictions are not all confirmed. So a replica
may await between decision and effect: what it admits meanwhile sees the bytes not yet freed as
used, and no byte is promised twice.

A `PartKey(model, part, snapshot_id)` is one snapshot's part, so a bad new snapshot is
quarantined alone while the serving one serves. Quarantine (`max_load_failures` failed loads in
a row, or the caller's report: a crash while in flight, memory grown past its size) refuses the
part for `quarantine_s`, doubled at each repeat up to `max_quarantine_s`; after it, one more
failed load quarantines it again (a successful load clears the failures, never the repeats).

Invariants after every call (bad input raises `ValueError` naming the field and the fix, and
changes nothing):

1. `committed_bytes` (ready parts plus loads' reservations) never exceeds the budget.
2. `used_bytes` (ready and evicting parts, plus what each load adds beyond its own evictions: a
   bound on the memory held) never exceeds it while loads measure within their reservations,
   nor, whatever they measure, once every eviction decided is confirmed.
3. Only idle ready parts are evicted (never one in flight, loading or evicting), least recently
   used (last `acquire`, `release` or `loaded`) first.
4. No count goes negative; `now` (the caller's monotonic clock) never goes back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Literal

__all__ = ["Admit", "AdmitKind", "Loaded", "PartKey", "PartView", "PoolCache", "PoolStats", "QuarantinedPart"]


@dataclass(frozen=True, order=True)
class PartKey:
    """One part of one model at one pinned snapshot: what a pool loads, evicts and quarantines."""

    model: str
    part: str
    snapshot_id: str

    def __post_init__(self) -> None:
        for name in ("model", "part", "snapshot_id"):
            if type(value := getattr(self, name)) is not str or not value:
                raise ValueError(f"PartKey.{name}: {value!r} is no name; give a non-empty string")

    def __str__(self) -> str:
        return f"{self.model}/{self.part}@{self.snapshot_id}"


class AdmitKind(Enum):
    HIT = "hit"  # loaded: acquire it and serve
    LOAD = "load"  # unload `evict` (confirming each), then load it
    WAIT = "wait"  # loading or being unloaded: admit it again once that settles
    QUARANTINED = "quarantined"  # refused until `until`
    NO_ROOM = "no_room"  # refused: what could free room is busy; `short_bytes` short
    TOO_LARGE = "too_large"  # refused: more than the whole budget


@dataclass(frozen=True)
class Admit:
    """What `admit` decided for one request's part."""

    kind: AdmitKind
    key: PartKey
    evict: tuple[PartKey, ...] = ()
    reserve_bytes: int = 0
    short_bytes: int = 0
    reason: str = ""
    until: float | None = None

    def describe(self) -> str:
        first = f" after unloading {', '.join(map(str, self.evict))} (confirm each)" if self.evict else ""
        text = {
            AdmitKind.HIT: "loaded: acquire it and serve",
            AdmitKind.LOAD: f"load it, {self.reserve_bytes} bytes reserved,{first}".rstrip(","),
            AdmitKind.WAIT: f"{self.reason}: admit it again once that settles",
            AdmitKind.QUARANTINED: f"quarantined until t={self.until} ({self.reason}); other snapshots serve",
            AdmitKind.NO_ROOM: f"no room for {self.reserve_bytes} bytes: {self.short_bytes} short with every "
            "idle part evicted (the rest is in flight, loading or evicting); retry after a release",
            AdmitKind.TOO_LARGE: f"{self.reserve_bytes} bytes, {self.reason}: serve it from a larger pool",
        }[self.kind]
        return f"{self.key}: {text}"


@dataclass(frozen=True)
class Loaded:
    """What `loaded` decided: keep the part (unloading `evict` first if it measured more than
    it reserved), or unload it (`kept` False) and confirm that with `evicted`."""

    key: PartKey
    kept: bool
    size_bytes: int
    evict: tuple[PartKey, ...] = ()
    reason: str = ""

    def describe(self) -> str:
        if not self.kept:
            return f"{self.key}: unload it ({self.reason}) and confirm with evicted()"
        unload = f", over its reservation: unload {', '.join(map(str, self.evict))}" if self.evict else ""
        return f"{self.key}: kept at {self.size_bytes} bytes{unload}"


@dataclass(frozen=True)
class PartView:
    """One part as the pool holds it (`PoolCache.parts`, least recently used first); the pool
    replaces it on every change, so a view handed out never changes."""

    key: PartKey
    state: Literal["loading", "ready", "evicting"]
    size_bytes: int  # reserved while loading, measured after
    last_used: float
    in_flight: int = 0
    waits_for: tuple[PartKey, ...] = ()  # a load's evictions not yet confirmed
    doomed: bool = False  # quarantined while in flight: unloaded when its last request ends


@dataclass(frozen=True)
class QuarantinedPart:
    key: PartKey
    reason: str
    until: float
    repeats: int


@dataclass(frozen=True)
class PoolStats:
    """One replica's pool, for the metrics actor (the counters are totals since it began)."""

    budget_bytes: int
    used_bytes: int
    committed_bytes: int
    evicting_bytes: int
    parts_ready: int
    parts_loading: int
    parts_evicting: int
    in_flight: int
    hits: int
    misses: int
    waits: int
    refusals: int
    evictions: int  # parts unloaded to make room (quarantine's unloads are not counted)
    load_failures: int
    quarantined: tuple[QuarantinedPart, ...]


def _byte_count(name: str, value: int, what: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{name}: {value!r} is no byte count; give an int >= 0 ({what})")
    return value


def _seconds(name: str, value: float) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: {value!r}; give a finite number of seconds > 0")
    return float(value)


class PoolCache:
    """The parts one pool replica holds, within `budget_bytes` (see the module docstring)."""

    def __init__(
        self,
        budget_bytes: int,
        *,
        max_load_failures: int = 2,
        quarantine_s: float = 60.0,
        max_quarantine_s: float = 3600.0,
    ) -> None:
        if _byte_count("budget_bytes", budget_bytes, "the replica's memory for parts") == 0:
            raise ValueError("budget_bytes: 0 holds no part; give the replica's memory for parts")
        if type(max_load_failures) is not int or max_load_failures < 1:
            raise ValueError(f"max_load_failures: {max_load_failures!r}; give an int >= 1")
        self.budget_bytes = budget_bytes
        self.max_load_failures = max_load_failures
        self.quarantine_s = _seconds("quarantine_s", quarantine_s)
        self.max_quarantine_s = max(self.quarantine_s, _seconds("max_quarantine_s", max_quarantine_s))
        self._parts: dict[PartKey, PartView] = {}  # least recently used first
        self._measured: dict[PartKey, int] = {}
        self._failures: dict[PartKey, int] = {}  # failed loads in a row
        self._repeats: dict[PartKey, int] = {}  # quarantines so far
        self._quarantine: dict[PartKey, tuple[str, float]] = {}  # reason, until
        self._now = -math.inf
        self._hits = self._misses = self._waits = self._refusals = self._evictions = self._load_failures = 0

    def admit(self, key: PartKey, estimate_bytes: int, now: float) -> Admit:
        """Serve `key` from memory, load it (after the evictions named), wait, or refuse it (why)."""
        self._check_key(key)
        estimate = _byte_count("estimate_bytes", estimate_bytes, "the snapshot manifest's file sizes")
        self._tick(now)
        if (quarantine := self._active_quarantine(key, now)) is not None:
            self._refusals += 1
            return Admit(AdmitKind.QUARANTINED, key, reason=quarantine[0], until=quarantine[1])
        if (part := self._parts.get(key)) is not None:
            if part.state == "ready" and not part.doomed:
                self._hits += 1
                return Admit(AdmitKind.HIT, key)
            self._waits += 1
            reason = "quarantined in flight, unloaded after its last request" if part.doomed else ""
            return Admit(AdmitKind.WAIT, key, reason=reason or f"{part.state} now")
        reserve = max(estimate, self._measured.get(key, 0))
        if reserve > self.budget_bytes:
            self._refusals += 1
            reason = f"more than the whole budget of {self.budget_bytes}"
            return Admit(AdmitKind.TOO_LARGE, key, reserve_bytes=reserve, reason=reason)
        victims, short = self._evict_for(self._used() + reserve - self.budget_bytes, exclude=key)
        if short > 0:
            self._refusals += 1
            return Admit(AdmitKind.NO_ROOM, key, reserve_bytes=reserve, short_bytes=short)
        self._misses += 1
        self._parts[key] = PartView(key, "loading", reserve, now, waits_for=victims)
        return Admit(AdmitKind.LOAD, key, evict=victims, reserve_bytes=reserve)

    def loaded(self, key: PartKey, size_bytes: int, now: float) -> Loaded:
        """A load ended, `size_bytes` measured: keep the part (evicting idle parts if it measured
        more than it reserved), or unload it (quarantined meanwhile, or no room for it)."""
        part = self._expect(key, "loading", "call loaded() for a part admit() said to load")
        size = _byte_count("size_bytes", size_bytes, "the sum of the loaded tensors' nbytes")
        if part.waits_for:
            names = ", ".join(map(str, part.waits_for))
            raise ValueError(f"key: {key} waits for the unload of {names}; unload and confirm each first")
        self._tick(now)
        self._measured[key] = size
        self._failures.pop(key, None)
        self._touch(key, now, state="ready", size_bytes=size)
        if (quarantine := self._active_quarantine(key, now)) is not None:
            return self._unload_loaded(key, f"quarantined while loading: {quarantine[0]}", for_room=False)
        if size > self.budget_bytes:
            return self._unload_loaded(key, f"{size} bytes measured, more than the budget")
        victims, short = self._evict_for(self._used() - self.budget_bytes, exclude=key)
        if short > 0:
            return self._unload_loaded(key, f"{size} bytes measured, {part.size_bytes} reserved: no room")
        return Loaded(key, kept=True, size_bytes=size, evict=victims)

    def load_failed(self, key: PartKey, error: str, now: float) -> None:
        """A load ended without the part; `max_load_failures` in a row quarantine it."""
        self._expect(key, "loading", "call load_failed() for a part admit() said to load")
        if type(error) is not str:
            raise ValueError(f"error: {error!r}; give the load's error as a string")
        self._tick(now)
        del self._parts[key]  # its evictions still run: counted as evicting until confirmed
        self._load_failures += 1
        failures = self._failures[key] = self._failures.get(key, 0) + 1
        if failures >= self.max_load_failures:
            self._start_quarantine(key, f"load failed {failures} times in a row; last: {error}", now, None)

    def acquire(self, key: PartKey, now: float) -> None:
        """A request starts on `key`: it is not evicted until the request is released."""
        part = self._expect(key, "ready", "acquire() a part admit() answered HIT for, or loaded()")
        if part.doomed:
            raise ValueError(f"key: {key} is quarantined; admit() it first and serve only a HIT")
        self._tick(now)
        self._touch(key, now, in_flight=part.in_flight + 1)

    def release(self, key: PartKey, now: float) -> bool:
        """A request on `key` ended. True: it was quarantined and this was its last: unload it."""
        part = self._expect(key, "ready", "release() only a part acquire()d")
        if part.in_flight == 0:
            raise ValueError(f"key: {key} has no request in flight; release() once per acquire()")
        self._tick(now)
        unload = part.doomed and part.in_flight == 1
        self._touch(key, now, in_flight=part.in_flight - 1, state="evicting" if unload else "ready")
        return unload

    def evicted(self, key: PartKey) -> None:
        """The caller has unloaded `key` as decided: its bytes are free."""
        self._expect(key, "evicting", "confirm only a part a decision said to unload")
        del self._parts[key]
        for other, part in self._parts.items():  # the load it made room for, if any
            if key in part.waits_for:
                self._parts[other] = replace(part, waits_for=tuple(v for v in part.waits_for if v != key))

    def quarantine(self, key: PartKey, reason: str, now: float, for_s: float | None = None) -> bool:
        """Refuse `key` until `now + for_s` (by default `quarantine_s`, doubled at each repeat,
        capped). True: it is loaded and idle: unload it now and confirm with `evicted`; one in
        flight is unloaded after its last request (`release`), one loading when it ends."""
        self._check_key(key)
        if type(reason) is not str or not reason.strip():
            raise ValueError(f"reason: {reason!r}; say why the part is quarantined (operators read it)")
        duration = None if for_s is None else _seconds("for_s", for_s)
        self._tick(now)
        self._start_quarantine(key, reason, now, duration)
        part = self._parts.get(key)
        if part is None or part.state != "ready":
            return False
        self._parts[key] = replace(part, doomed=True) if part.in_flight else replace(part, state="evicting")
        return not part.in_flight

    def drop(self, key: PartKey) -> bool:
        """Unload `key` on the caller's request (its set left the pool), if it is loaded and idle:
        True, then unload it and confirm with `evicted`. Not a quarantine: it may load again."""
        self._check_key(key)
        part = self._parts.get(key)
        if part is None or part.state != "ready" or part.in_flight or part.doomed:
            return False
        self._parts[key] = replace(part, state="evicting")
        return True

    def parts(self) -> tuple[PartView, ...]:
        return tuple(self._parts.values())

    def stats(self, now: float) -> PoolStats:
        """The pool now (`now` only says which quarantines are still on)."""
        parts = self._parts.values()
        states = [p.state for p in parts]
        return PoolStats(
            budget_bytes=self.budget_bytes,
            used_bytes=self._used(),
            committed_bytes=sum(p.size_bytes for p in parts if p.state != "evicting"),
            evicting_bytes=sum(p.size_bytes for p in parts if p.state == "evicting"),
            parts_ready=states.count("ready"),
            parts_loading=states.count("loading"),
            parts_evicting=states.count("evicting"),
            in_flight=sum(p.in_flight for p in parts),
            hits=self._hits,
            misses=self._misses,
            waits=self._waits,
            refusals=self._refusals,
            evictions=self._evictions,
            load_failures=self._load_failures,
            quarantined=tuple(
                QuarantinedPart(key, reason, until, self._repeats[key])
                for key, (reason, until) in sorted(self._quarantine.items())
                if until > now
            ),
        )

    def _used(self) -> int:
        """Held bytes (ready, evicting) plus what each load adds beyond its own evictions."""
        used = 0
        for part in self._parts.values():
            given_back = sum(self._parts[v].size_bytes for v in part.waits_for)
            used += max(0, part.size_bytes - given_back)  # only a load waits for evictions
        return used

    def _evict_for(self, needed: int, exclude: PartKey) -> tuple[tuple[PartKey, ...], int]:
        """Evict the least recently used idle parts that free `needed` bytes; or none, and how
        many bytes short."""
        victims: list[PartKey] = []
        for key, part in self._parts.items():
            if needed <= 0:
                break
            if part.state == "ready" and part.in_flight == 0 and key != exclude:
                victims.append(key)
                needed -= part.size_bytes
        if needed > 0:
            return (), needed
        for victim in victims:
            self._parts[victim] = replace(self._parts[victim], state="evicting")
        self._evictions += len(victims)
        return tuple(victims), 0

    def _unload_loaded(self, key: PartKey, reason: str, for_room: bool = True) -> Loaded:
        part = self._parts[key] = replace(self._parts[key], state="evicting")
        self._evictions += for_room
        return Loaded(key, kept=False, size_bytes=part.size_bytes, reason=reason)

    def _start_quarantine(self, key: PartKey, reason: str, now: float, for_s: float | None) -> None:
        repeats = self._repeats[key] = self._repeats.get(key, 0) + 1
        if for_s is None:
            for_s = min(self.max_quarantine_s, self.quarantine_s * 2.0 ** min(repeats - 1, 60))
        current = self._active_quarantine(key, now)
        self._quarantine[key] = (reason, max(now + for_s, current[1] if current else now))

    def _active_quarantine(self, key: PartKey, now: float) -> tuple[str, float] | None:
        quarantine = self._quarantine.get(key)
        return quarantine if quarantine is not None and quarantine[1] > now else None

    def _touch(self, key: PartKey, now: float, **changes: Any) -> None:
        """Change a part and make it the most recently used."""
        self._parts[key] = replace(self._parts.pop(key), last_used=now, **changes)

    def _expect(self, key: PartKey, state: str, fix: str) -> PartView:
        self._check_key(key)
        part = self._parts.get(key)
        if part is None or part.state != state:
            found = "not in the pool" if part is None else part.state
            raise ValueError(f"key: {key} is {found}, not {state}; {fix}")
        return part

    def _check_key(self, key: PartKey) -> None:
        if not isinstance(key, PartKey):
            raise ValueError(f"key: {key!r} is no PartKey; build one with PartKey(model, part, snapshot_id)")

    def _tick(self, now: float) -> None:
        """Check `now` and advance to it: the last check of a call (one that raises changes nothing)."""
        if type(now) not in (int, float) or not math.isfinite(now) or now < self._now:
            raise ValueError(f"now: {now!r}; give time.monotonic(), never below the last call's {self._now}")
        self._now = float(now)
