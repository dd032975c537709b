"""Loads of a shared pool across its replicas (pure; the pool's ledger actor calls it): a part
whose load kills the replica that loads it never reports its own failure, so the loads under way
are written down before they start, and a load whose replica died counts as a failed one.

`PoolCache` quarantines what fails in one replica; this quarantines across the pool what no
replica lives to report. Each replica asks `begin` before a load (refused while the part is
quarantined) and reports `end`; `replica_gone` turns that replica's loads under way into
failures ("its replica died while loading it"). `max_failures` in a row quarantine the part for
`quarantine_s`, doubled at each repeat up to `max_quarantine_s`; a successful load clears the
failures, never the repeats. A `PartKey` is one snapshot's part, so a bad snapshot is
quarantined alone.

Bad input raises `ValueError` naming the field and the fix, and changes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ipnext.policy.pool_cache import PartKey

__all__ = ["LedgerAnswer", "LoadLedger"]


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
        self._under_way: dict[PartKey, dict[str, float]] = {}  # key -> replica -> since
        self._failures: dict[PartKey, int] = {}
        self._repeats: dict[PartKey, int] = {}
        self._quarantine: dict[PartKey, tuple[str, float]] = {}  # reason, until

    def begin(self, key: PartKey, replica: str, now: float) -> LedgerAnswer:
        """Replica `replica` is about to load `key`: allowed (and written down), or refused."""
        self._check(key, replica)
        held = self._quarantine.get(key)
        if held is not None and held[1] > now:
            return LedgerAnswer(False, held[0], held[1])
        self._under_way.setdefault(key, {})[replica] = now
        return LedgerAnswer(True)

    def end(self, key: PartKey, replica: str, error: str | None, now: float) -> None:
        """The load `begin` allowed ended: loaded (`error` None) or failed with `error`."""
        self._check(key, replica)
        loads = self._under_way.get(key, {})
        if loads.pop(replica, None) is None:
            return  # already counted (its replica was reported gone meanwhile), or never begun
        if not loads:
            self._under_way.pop(key, None)
        if error is None:
            self._failures.pop(key, None)
        else:
            self._fail(key, error, now)

    def replica_gone(self, replica: str, now: float) -> list[PartKey]:
        """`replica` died: each load it had under way failed (it may have been what killed it).
        The parts whose loads it had, in order."""
        if type(replica) is not str or not replica:
            raise ValueError(f"replica: {replica!r}; give the replica's id")
        lost = sorted(key for key, loads in self._under_way.items() if replica in loads)
        for key in lost:
            del self._under_way[key][replica]
            if not self._under_way[key]:
                del self._under_way[key]
            self._fail(key, "its replica died while loading it", now)
        return lost

    def loading(self) -> dict[PartKey, dict[str, float]]:
        """Every load under way: part -> replica -> since."""
        return {key: dict(loads) for key, loads in self._under_way.items()}

    def quarantined(self, now: float) -> dict[PartKey, tuple[str, float]]:
        return {key: held for key, held in self._quarantine.items() if held[1] > now}

    def _fail(self, key: PartKey, error: str, now: float) -> None:
        failures = self._failures[key] = self._failures.get(key, 0) + 1
        if failures < self.max_failures:
            return
        repeats = self._repeats[key] = self._repeats.get(key, 0) + 1
        for_s = min(self.max_quarantine_s, self.quarantine_s * 2.0 ** min(repeats - 1, 60))
        self._quarantine[key] = (f"load failed {failures} times in a row; last: {error}", now + for_s)
        self._failures[key] = 0

    def _check(self, key: PartKey, replica: str) -> None:
        if not isinstance(key, PartKey):
            raise ValueError(f"key: {key!r} is no PartKey; build one with PartKey(model, part, snapshot_id)")
        if type(replica) is not str or not replica:
            raise ValueError(f"replica: {replica!r}; give the replica's id")
