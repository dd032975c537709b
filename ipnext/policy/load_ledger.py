"""Loads and first calls of a shared pool's parts across its replicas (pure; the pool's ledger
actor calls it): a part whose load or call kills the replica that runs it never reports its own
failure, so what is under way is written down before it starts, and whatever a dead replica had
under way counts as failed.

`PoolCache` quarantines what fails in one replica; this quarantines across the pool what no
replica lives to report. Each replica asks `begin` before a load, and before each of a part's
first calls after a load (`kind` "call": `PoolParts`' probation), and reports `end`;
`replica_gone` turns that replica's loads and calls under way into failures ("its replica died
while loading it", "while running it"). `max_failures` of one kind in a row quarantine the part
for `quarantine_s`, doubled at each repeat up to `max_quarantine_s`; a load that succeeds clears
the load failures, a call the call failures (a replica that loads the part again after a death
its call caused must not clear that death), never the repeats. A `PartKey` is one snapshot's
part, so a bad snapshot is quarantined alone.

Bad input raises `ValueError` naming the field and the fix, and changes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ipnext.policy.pool_cache import PartKey

__all__ = ["KINDS", "LedgerAnswer", "LoadLedger"]

KINDS = ("load", "call")  # what a replica writes down before it runs it
_DIED = {"load": "its replica died while loading it", "call": "its replica died while running it"}


@dataclass(frozen=True)
class LedgerAnswer:
    """Whether a replica may load a part now, and if not why and until when."""

    allowed: bool
    reason: str = ""
    until: float | None = None


class LoadLedger:
    """The loads under way in one pool's replicas, and the parts quarantined for the pool."""

    def __init__(
        self, max_failures: int = 2, quarantine_s: float = 60.0, max_quarantine_s: float = 3600.0
    ) -> None:
        if type(max_failures) is not int or max_failures < 1:
            raise ValueError(f"max_failures: {max_failures!r}; give an int >= 1")
        for name, value in (("quarantine_s", quarantine_s), ("max_quarantine_s", max_quarantine_s)):
            if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}: {value!r}; give a finite number of seconds > 0")
        self.max_failures = max_failures
        self.quarantine_s = float(quarantine_s)
        self.max_quarantine_s = max(self.quarantine_s, float(max_quarantine_s))
        # kind -> key -> replica -> since
        self._under_way: dict[str, dict[PartKey, dict[str, float]]] = {kind: {} for kind in KINDS}
        self._failures: dict[tuple[PartKey, str], int] = {}
        self._repeats: dict[PartKey, int] = {}
        self._quarantine: dict[PartKey, tuple[str, float]] = {}  # reason, until

    def begin(self, key: PartKey, replica: str, now: float, kind: str = "load") -> LedgerAnswer:
        """Replica `replica` is about to load `key` (or run it, `kind` "call"): allowed (and
        written down), or refused."""
        self._check(key, replica, kind)
        held = self._quarantine.get(key)
        if held is not None and held[1] > now:
            return LedgerAnswer(False, held[0], held[1])
        self._under_way[kind].setdefault(key, {})[replica] = now
        return LedgerAnswer(True)

    def end(self, key: PartKey, replica: str, error: str | None, now: float, kind: str = "load") -> None:
        """The load (or call) `begin` allowed ended: done (`error` None) or failed with `error`."""
        self._check(key, replica, kind)
        under_way = self._under_way[kind]
        runs = under_way.get(key, {})
        if runs.pop(replica, None) is None:
            return  # already counted (its replica was reported gone meanwhile), or never begun
        if not runs:
            under_way.pop(key, None)
        if error is None:
            self._failures.pop((key, kind), None)
        else:
            self._fail(key, kind, error, now)

    def replica_gone(self, replica: str, now: float) -> list[PartKey]:
        """`replica` died: each load and call it had under way failed (one may have been what
        killed it). The parts it had under way, in order."""
        if type(replica) is not str or not replica:
            raise ValueError(f"replica: {replica!r}; give the replica's id")
        lost = set()
        for kind, under_way in self._under_way.items():
            for key in sorted(k for k, runs in under_way.items() if replica in runs):
                del under_way[key][replica]
                if not under_way[key]:
                    del under_way[key]
                self._fail(key, kind, _DIED[kind], now)
                lost.add(key)
        return sorted(lost)

    def loading(self) -> dict[PartKey, dict[str, float]]:
        """Every load under way: part -> replica -> since."""
        return {key: dict(runs) for key, runs in self._under_way["load"].items()}

    def replicas_under_way(self) -> dict[str, float]:
        """Each replica with a load or call under way: since when (its oldest)."""
        since: dict[str, float] = {}
        for under_way in self._under_way.values():
            for runs in under_way.values():
                for replica, at in runs.items():
                    since[replica] = min(at, since.get(replica, at))
        return since

    def quarantine(self, key: PartKey, reason: str, now: float) -> float:
        """Quarantine `key` across the pool now, for what one replica saw itself (its calls leak
        memory): as long as a quarantine by failures would last at this repeat. Until when."""
        if not isinstance(key, PartKey):
            raise ValueError(f"key: {key!r} is no PartKey; build one with PartKey(model, part, snapshot_id)")
        if type(reason) is not str or not reason:
            raise ValueError(f"reason: {reason!r}; say why the part is quarantined")
        return self._hold(key, reason, now)

    def quarantined(self, now: float) -> dict[PartKey, tuple[str, float]]:
        return {key: held for key, held in self._quarantine.items() if held[1] > now}

    def _fail(self, key: PartKey, kind: str, error: str, now: float) -> None:
        failures = self._failures[(key, kind)] = self._failures.get((key, kind), 0) + 1
        if failures < self.max_failures:
            return
        self._hold(key, f"{kind} failed {failures} times in a row; last: {error}", now)
        self._failures[(key, kind)] = 0

    def _hold(self, key: PartKey, reason: str, now: float) -> float:
        repeats = self._repeats[key] = self._repeats.get(key, 0) + 1
        for_s = min(self.max_quarantine_s, self.quarantine_s * 2.0 ** min(repeats - 1, 60))
        self._quarantine[key] = (reason, now + for_s)
        return now + for_s

    def _check(self, key: PartKey, replica: str, kind: str = "load") -> None:
        if kind not in KINDS:
            raise ValueError(f"kind: {kind!r}; give one of {', '.join(KINDS)}")
        if not isinstance(key, PartKey):
            raise ValueError(f"key: {key!r} is no PartKey; build one with PartKey(model, part, snapshot_id)")
        if type(replica) is not str or not replica:
            raise ValueError(f"replica: {replica!r}; give the replica's id")
