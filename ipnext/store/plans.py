"""Where fleet plans are kept between replans (`PlanStore`, one JSON file per revision, written atomically),
and the replan interval's grammar."""

from __future__ import annotations

import fcntl
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pydantic import Field

from ipnext.contracts.fleet import DemandSizing
from ipnext.contracts.plan import Plan, PlanMove
from ipnext.errors import IpnextError
from ipnext.names import Frozen
from ipnext.policy.regions import Relaxation
from ipnext.spec.fleet import Pool

__all__ = ["PlanStore", "StoredPlan", "now", "parse_every"]


class StoredPlan(Frozen):
    """A fleet plan as kept on disk: the plan itself and how it came to be."""

    revision: int
    created_at: datetime
    made_by: str  # the workflow run that solved it
    models: list[str]
    moves: list[PlanMove]
    plan: dict[str, Any]  # Plan.to_report()
    pools: list[Pool]  # the fleet's pools when it was solved
    units: dict[str, dict[str, int]]  # deployment -> hardware -> units one replica takes
    # Plans stored before lost regions existed have neither: none was down, nothing relaxed.
    down_regions: list[str] = Field(default_factory=list)
    relaxed: list[Relaxation] = Field(default_factory=list)
    solve_started_at: datetime | None = None  # when its solve began (see PlanStore.save)
    # What each model was planned for, per source (plans stored before observed demand: empty).
    demand: dict[str, DemandSizing] = Field(default_factory=dict)

    def as_plan(self) -> Plan:
        return Plan.from_report(self.plan)


class PlanStore:
    def __init__(self, state_dir: Path) -> None:
        self.folder = state_dir / "plans"

    def latest_revision(self) -> int:
        pointer = self.folder / "latest.json"
        if not pointer.exists():
            return 0
        return int(json.loads(pointer.read_text())["revision"])

    def next_revision(self) -> int:
        """The number the next plan would take: above every stored or claimed one (the latest
        may not be the highest). A peek: a solve takes its number with `claim_revision`."""
        numbers = [int(p.name[4:10]) for p in self.folder.glob("rev-*") if p.name[4:10].isdigit()]
        return max([self.latest_revision(), *numbers]) + 1

    def claim_revision(self) -> int:
        """A revision number no other solve gets: taken under the store's lock and marked by a
        claim file (`rev-<n>.claim`) until `save` writes the plan. Two solves finishing together
        (the Schedule's and an emergency replan's) once both read the same next number and the
        second overwrote the first's plan. A solve that fails after its claim leaves a gap."""
        with self._locked():
            revision = self.next_revision()
            (self.folder / f"rev-{revision:06d}.claim").touch(exist_ok=False)
            return revision

    def save(self, stored: StoredPlan) -> Path:
        """Write the revision, then move `latest.json` to it (each write atomic by rename),
        unless the latest plan's solve began after this one's: a solve that began earlier knew
        less (an emergency replan started while the Schedule's run solved, the latter cancelled
        and finishing last), so it is kept as a revision but never becomes the latest. Under the
        store's lock, so two saves cannot both read the latest and each move it."""
        with self._locked():
            path = self.folder / f"rev-{stored.revision:06d}.json"
            _write_atomic(path, stored.model_dump_json(indent=2))
            (self.folder / f"rev-{stored.revision:06d}.claim").unlink(missing_ok=True)
            latest = self.latest_revision()
            if (
                latest
                and stored.solve_started_at is not None
                and (self.folder / f"rev-{latest:06d}.json").exists()
            ):
                newer = self.load(latest).solve_started_at
                if newer is not None and newer > stored.solve_started_at:
                    return path
            _write_atomic(self.folder / "latest.json", json.dumps({"revision": stored.revision}))
            return path

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The store's lock (an flock on `plans/.lock`: processes of one machine, and the
        worker's threads, each open the file themselves)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with (self.folder / ".lock").open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def load(self, revision: int | None = None) -> StoredPlan:
        revision = revision or self.latest_revision()
        path = self.folder / f"rev-{revision:06d}.json"
        if not revision or not path.exists():
            known = sorted(int(p.stem[4:]) for p in self.folder.glob("rev-*.json"))
            raise IpnextError(
                f"no fleet plan revision {revision or '(latest)'} in the plan store; "
                f"stored revisions: {known or 'none'}. Fix: run `ipnext plan schedule --trigger` "
                "or wait for the replan schedule."
            )
        return StoredPlan.model_validate_json(path.read_text())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


_EVERY = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d)$")


def parse_every(text: str) -> timedelta:
    """`90s`, `30m`, `6h`, `1d` -> a timedelta (at least one minute)."""
    match = _EVERY.match(text.strip())
    if not match:
        raise IpnextError(f"--every {text!r}: write a number and a unit, like 30m, 6h or 1d.")
    value, unit = float(match[1]), match[2]
    every = timedelta(seconds=value * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit])
    if every < timedelta(minutes=1):
        raise IpnextError(f"--every {text!r}: replanning more often than once a minute is not supported.")
    return every


def now() -> datetime:
    return datetime.now(UTC)
