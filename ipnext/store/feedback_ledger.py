"""An experiment's feedback ledger: which (request id, outcome) pairs have been counted, so a
replayed or repeated feedback post counts once, however many routers or regions it reaches.

One ledger per experiment (the serving tier runs it as one actor on the head node,
`serving.feedback_actor`); each pair is kept, as a 16-byte digest and the time its id expires,
until its request id is older than the feedback window, when feedback on it is refused anyway.
So what it holds is bounded by the feedback rate times the window, and by `max_entries`: a full
ledger refuses new pairs (`LedgerFullError`; the router answers 503) rather than forget one
early, which would let that one be counted twice.

Every claim is appended to a log file and flushed to disk before it is answered, and a new
ledger reads the log back, so a restarted actor (its process died, Ray restarted) still refuses
what was counted. The log is rewritten without expired pairs once it holds twice what is live.
Faults: a log line cut short by a crash is skipped on reading (its claim was never answered,
so nothing was counted for it); a log that cannot be written fails the claim, and nothing of it
is counted.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Sequence
from enum import StrEnum
from pathlib import Path

__all__ = ["Claim", "FeedbackLedger", "LedgerFullError"]

# How many claims between sweeps of expired pairs (a sweep reads every pair once).
SWEEP_EVERY = 10_000
# The log is rewritten once it holds this many times the live pairs (and at least COMPACT_MIN).
COMPACT_RATIO = 2
COMPACT_MIN = 1_000


class Claim(StrEnum):
    """What a claim found for one pair."""

    NEW = "new"  # not counted before: count it now
    SEEN = "seen"  # counted already: a repeat, not counted again
    EXPIRED = "expired"  # its request id is older than the window: refused


class LedgerFullError(RuntimeError):
    """The ledger holds `max_entries` live pairs: nothing of the claim was recorded."""


def _digest(request_id: str, outcome: str) -> bytes:
    return hashlib.sha256(f"{request_id}\0{outcome}".encode()).digest()[:16]


class FeedbackLedger:
    """The pairs counted for one experiment, with their expiry, kept in memory and in `path`."""

    def __init__(
        self,
        path: Path | None,
        window_seconds: float,
        max_entries: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if window_seconds <= 0 or max_entries < 1:
            raise ValueError(
                f"window_seconds {window_seconds} and max_entries {max_entries} must be positive"
            )
        self.path = path
        self.window_seconds = window_seconds
        self.max_entries = max_entries
        self._clock = clock
        self._expires: dict[bytes, float] = {}
        self._logged = 0  # lines in the log
        self._claims = 0
        self.last_claim_at = clock()
        if path is not None:
            self._read(path)

    def __len__(self) -> int:
        return len(self._expires)

    def claim(self, request_id: str, issued_at: float, outcomes: Sequence[str]) -> dict[str, Claim]:
        """Record each (request id, outcome) not seen before, and say of each whether it is new,
        seen or expired. All or nothing: a full ledger, or a log that cannot be written, raises
        and records none of them."""
        now = self._clock()
        self.last_claim_at = now
        expires = issued_at + self.window_seconds
        if expires <= now:
            return dict.fromkeys(outcomes, Claim.EXPIRED)
        self._claims += 1
        if self._claims % SWEEP_EVERY == 0:
            self.sweep()
        found: dict[str, Claim] = {}
        fresh: dict[bytes, float] = {}
        for outcome in outcomes:
            key = _digest(request_id, outcome)
            seen = self._expires.get(key)
            if (seen is not None and seen > now) or key in fresh:
                found[outcome] = Claim.SEEN
            else:
                found[outcome] = Claim.NEW
                fresh[key] = expires
        if not fresh:
            return found
        if len(self._expires) + len(fresh) > self.max_entries:
            self.sweep()
            if len(self._expires) + len(fresh) > self.max_entries:
                raise LedgerFullError(
                    f"the feedback ledger holds {len(self._expires)} ids of the last "
                    f"{self.window_seconds:g} s, its limit (feedback.max_entries {self.max_entries})"
                )
        self._append(fresh)
        self._expires.update(fresh)
        return found

    def sweep(self) -> int:
        """Forget the pairs whose ids have expired; rewrite the log once it is mostly those.
        Returns how many were forgotten."""
        now = self._clock()
        gone = [key for key, expires in self._expires.items() if expires <= now]
        for key in gone:
            del self._expires[key]
        if self.path is not None and self._logged > max(COMPACT_MIN, COMPACT_RATIO * len(self._expires)):
            self._rewrite(self.path)
        return len(gone)

    def forget_all(self) -> None:
        """Drop every pair and the log (the experiment's window has passed with nothing live)."""
        self._expires.clear()
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self._logged = 0

    # ---- the log -----------------------------------------------------------------------------

    def _append(self, fresh: dict[bytes, float]) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = "".join(f"{key.hex()} {expires:.3f}\n" for key, expires in fresh.items())
        with self.path.open("a") as log:
            log.write(lines)
            log.flush()
            os.fsync(log.fileno())  # answered only once on disk: a restart must refuse it too
        self._logged += len(fresh)

    def _read(self, path: Path) -> None:
        try:
            text = path.read_text()
        except FileNotFoundError:
            return
        now = self._clock()
        for line in text.splitlines():
            fields = line.split()
            self._logged += 1
            if len(fields) != 2 or len(fields[0]) != 32:
                continue  # cut short by a crash: its claim was never answered
            try:
                key, expires = bytes.fromhex(fields[0]), float(fields[1])
            except ValueError:
                continue
            if expires > now:
                self._expires[key] = expires

    def _rewrite(self, path: Path) -> None:
        scratch = path.with_suffix(f".tmp{os.getpid()}")
        with scratch.open("w") as log:
            log.write("".join(f"{key.hex()} {expires:.3f}\n" for key, expires in self._expires.items()))
            log.flush()
            os.fsync(log.fileno())
        scratch.replace(path)
        self._logged = len(self._expires)
