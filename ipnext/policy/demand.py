"""Observed demand: how many requests each caller's source region sent a model, over time.

Routers count the requests they admit by the caller's source (the `x-ipnext-source` header the
SDK and CLI send; the serving region when absent) and push their cumulative counts; a model's
metrics actor folds them into a `DemandHistory` of fixed slots, and a `DemandReport` reads rates
over any window that is a whole number of slots; `plan_demand` decides what the fleet replan
plans each source for. No Ray, no Temporal, no clock (callers pass `now`); the only side effect
is a history's own file (`save_history`, `load_history`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from ipnext.contracts.fleet import DemandSizing, SourceSizing

__all__ = [
    "DEMAND_SLOT_S",
    "SOURCE_HEADER",
    "DemandHistory",
    "DemandReport",
    "ModelDemand",
    "SourceDemand",
    "SourceView",
    "declared_only",
    "demand_report",
    "load_history",
    "model_demand",
    "plan_demand",
    "rates",
    "save_history",
    "valid_source",
]

logger = logging.getLogger(__name__)

SOURCE_HEADER = "x-ipnext-source"
DEMAND_SLOT_S = 5.0  # the history's resolution; report windows are whole numbers of slots
_SOURCE = re.compile(r"^[a-z][a-z0-9-]{0,62}$")  # a fleet region's name (ipnext.spec.fleet.Name)


def valid_source(value: str) -> bool:
    return bool(_SOURCE.fullmatch(value))


class DemandHistory(BaseModel):
    """Every router replica's latest cumulative counts, and per slot (its start, in seconds
    since the epoch) the requests each source sent in it, for the last `keep_seconds`.

    A replica's counts are diffed against its previous push: one new here counts from zero,
    one whose counts went down restarted and counts from zero too, so restarts never make
    demand go backwards or count twice."""

    keep_seconds: float = Field(default=6 * 3600.0, gt=0)
    replicas: dict[str, dict[str, int]] = Field(default_factory=dict)  # replica -> source -> total
    slots: dict[int, dict[str, int]] = Field(default_factory=dict)  # slot index -> source -> requests
    first_slot: int | None = None  # the first slot anything was recorded in (how long history is)
    seen: dict[str, int] = Field(default_factory=dict)  # replica -> the slot of its last push

    def record(self, replica: str, counts: dict[str, int], now: float) -> None:
        before = self.replicas.get(replica, {})
        went_down = any(counts.get(source, 0) < n for source, n in before.items())
        base = {} if went_down else before
        slot = int(now // DEMAND_SLOT_S)
        for source, total in counts.items():
            delta = total - base.get(source, 0)
            if delta > 0:
                bucket = self.slots.setdefault(slot, {})
                bucket[source] = bucket.get(source, 0) + delta
        self.replicas[replica] = dict(counts)
        if self.first_slot is None:
            self.first_slot = slot
        self.seen[replica] = slot
        oldest = slot - int(self.keep_seconds // DEMAND_SLOT_S)
        for old in [s for s in self.slots if s < oldest]:
            del self.slots[old]
        # Replicas long gone (a restarted Ray gives routers new ids) would pile up in a saved
        # history: one silent for as long as history is kept is forgotten.
        for gone in [r for r, last in self.seen.items() if last < oldest]:
            del self.seen[gone]
            self.replicas.pop(gone, None)

    def adopt(self, replica: str, counts: dict[str, int], now: float) -> None:
        """Take a replica's cumulative counts as its baseline without counting them: what a
        restarted actor that lost its history does with each replica's first push, so that
        requests of hours ago do not all land in this slot as one false peak."""
        self.replicas[replica] = dict(counts)
        self.seen[replica] = int(now // DEMAND_SLOT_S)


def save_history(history: DemandHistory, path: Path) -> None:
    """Write the history as JSON, atomically (a temporary file renamed over the old one), so a
    reader or a crash mid-write never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(history.model_dump_json())
    tmp.replace(path)


def load_history(path: Path, keep_seconds: float | None = None) -> DemandHistory | None:
    """The history saved at `path`; None when there is none or it cannot be read. A corrupt or
    foreign file is logged and left for the next save to replace: demand then starts empty
    (the replan plans declared demand until enough history builds up again), never fails."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        logger.warning("demand history %s is unreadable (%s): starting empty", path, err)
        return None
    try:
        history = DemandHistory.model_validate_json(text)
    except (ValidationError, json.JSONDecodeError, ValueError) as err:
        logger.warning("demand history %s is corrupt, starting empty: %s", path, str(err)[:200])
        return None
    if keep_seconds is not None:
        history.keep_seconds = keep_seconds
    return history


class SourceDemand(BaseModel):
    requests: int  # in the whole history kept
    rate_qps: float  # over the last whole window
    peak_qps: float  # the highest rate over any whole window kept


class DemandReport(BaseModel):
    window_seconds: float
    history_seconds: float  # how long requests have been recorded (since the first push)
    sources: dict[str, SourceDemand] = Field(default_factory=dict)
    # Per window (its start, seconds since the epoch): requests by source. Reports of several
    # regions add up window by window, since windows start on the same clock boundaries.
    windows: dict[int, dict[str, int]] = Field(default_factory=dict)


def demand_report(history: DemandHistory, now: float, window_seconds: float) -> DemandReport:
    """Rates over windows of `window_seconds` (rounded to whole slots, at least one), counting
    only windows that have ended: the current one is still filling."""
    per_window = max(1, round(window_seconds / DEMAND_SLOT_S))
    span = per_window * DEMAND_SLOT_S
    windows: dict[int, dict[str, int]] = {}
    for slot, counts in history.slots.items():
        bucket = windows.setdefault(int((slot // per_window) * span), {})
        for source, n in counts.items():
            bucket[source] = bucket.get(source, 0) + n
    first = history.first_slot
    return DemandReport(
        window_seconds=span,
        history_seconds=0.0 if first is None else max(0.0, now - first * DEMAND_SLOT_S),
        sources=rates(windows, span, now),
        windows=dict(sorted(windows.items())),
    )


def rates(windows: dict[int, dict[str, int]], span: float, now: float) -> dict[str, SourceDemand]:
    """Per source, from windows keyed by their start: all requests, the rate over the last
    window that has ended, the peak over every ended window (the current one is filling)."""
    current = int((now // span) * span)
    ended = {start: counts for start, counts in windows.items() if start < current}
    last = ended.get(int(current - span), {})
    answer = {}
    for source in sorted({source for counts in windows.values() for source in counts}):
        answer[source] = SourceDemand(
            requests=sum(counts.get(source, 0) for counts in windows.values()),
            rate_qps=last.get(source, 0) / span,
            peak_qps=max((counts.get(source, 0) for counts in ended.values()), default=0) / span,
        )
    return answer


class SourceView(BaseModel):
    """One source of one model: what its owner declared beside what its callers sent."""

    declared_qps: float | None  # traffic.peak_qps, None for a source the spec does not name
    requests: int
    rate_qps: float
    peak_qps: float


class ModelDemand(BaseModel):
    """`ipnext model demand`: a model's declared against observed demand, per source, summed
    over the regions that served it (a source's requests may land in several)."""

    model: str
    window_seconds: float
    history_seconds: float
    regions: list[str]  # the regions whose routers reported
    sources: dict[str, SourceView]


def model_demand(
    model: str,
    declared: dict[str, float],
    reports: dict[str, DemandReport],
    now: float,
    window_seconds: float,
    since: float | None = None,
) -> ModelDemand:
    """Add the regions' reports window by window, then read rates as one report would; with
    `since`, only windows that start at or after it count (the replan's peak over its interval)."""
    span = max((r.window_seconds for r in reports.values()), default=window_seconds)
    summed: dict[int, dict[str, int]] = {}
    for report in reports.values():
        for start, counts in report.windows.items():
            if since is not None and start < since:
                continue
            bucket = summed.setdefault(start, {})
            for source, n in counts.items():
                bucket[source] = bucket.get(source, 0) + n
    observed = rates(summed, span, now)
    views = {}
    for source in sorted(set(declared) | set(observed)):
        seen = observed.get(source, SourceDemand(requests=0, rate_qps=0.0, peak_qps=0.0))
        views[source] = SourceView(declared_qps=declared.get(source), **seen.model_dump())
    return ModelDemand(
        model=model,
        window_seconds=span,
        history_seconds=max((r.history_seconds for r in reports.values()), default=0.0),
        regions=sorted(reports),
        sources=views,
    )


def declared_only(declared: dict[str, float], note: str) -> DemandSizing:
    sources = {
        s: SourceSizing(declared_qps=q, observed_peak_qps=None, planned_qps=q, used="declared")
        for s, q in sorted(declared.items())
    }
    return DemandSizing(note=note, sources=sources)


def plan_demand(
    declared: dict[str, float],
    observed: ModelDemand | None,
    margin: float,
    min_history_seconds: float,
    regions: Iterable[str],
) -> DemandSizing:
    """Each source planned for max(declared, observed peak x (1 + margin)) once the history is
    at least `min_history_seconds` long; declared alone before. A source the spec does not name
    is planned for its observed figure when it is one of the fleet's `regions` (the planner
    needs its latencies) and left out, with a note, when it is not."""
    if observed is None:
        return declared_only(declared, "no observed demand")
    if observed.history_seconds < min_history_seconds:
        note = f"{observed.history_seconds:.0f} s of history, {min_history_seconds:.0f} s needed"
        return declared_only(declared, note).model_copy(
            update={"history_seconds": observed.history_seconds, "window_seconds": observed.window_seconds}
        )
    known = set(regions)
    sources: dict[str, SourceSizing] = {}
    ignored = []
    for source in sorted(set(declared) | set(observed.sources)):
        if source not in declared and source not in known:
            ignored.append(source)
            continue
        view = observed.sources.get(source)
        peak = view.peak_qps if view is not None else 0.0
        if source not in declared and peak == 0:
            continue  # requests only in the window still filling: nothing to plan for yet
        budget = declared.get(source, 0.0)
        wanted = round(peak * (1 + margin), 6)
        sources[source] = SourceSizing(
            declared_qps=budget,
            observed_peak_qps=peak,
            planned_qps=max(budget, wanted),
            used="observed" if wanted > budget else "declared",
            over_budget=peak > budget,
        )
    note = f"sources not in the fleet, not planned: {', '.join(ignored)}" if ignored else ""
    return DemandSizing(
        history_seconds=observed.history_seconds,
        window_seconds=observed.window_seconds,
        margin=margin,
        observed=True,
        note=note,
        sources=sources,
    )
