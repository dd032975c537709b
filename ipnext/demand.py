"""Observed demand: how many requests each caller's source region sent a model, over time.

Routers count the requests they admit by the caller's source (the `x-ipnext-source` header the
SDK and CLI send; the serving region when absent) and push their cumulative counts; a model's
metrics actor folds them into a `DemandHistory` of fixed slots, and a `DemandReport` reads rates
over any window that is a whole number of slots. Pure: no Ray, no Temporal, no clock (callers
pass `now`).
"""

from __future__ import annotations

import re

from pydantic import BaseModel, Field

__all__ = [
    "DEMAND_SLOT_S",
    "SOURCE_HEADER",
    "DemandHistory",
    "DemandReport",
    "ModelDemand",
    "SourceDemand",
    "SourceView",
    "demand_report",
    "model_demand",
    "rates",
    "valid_source",
]

SOURCE_HEADER = "x-ipnext-source"
DEMAND_SLOT_S = 5.0  # the history's resolution; report windows are whole numbers of slots
_SOURCE = re.compile(r"^[a-z][a-z0-9-]{0,62}$")  # a fleet region's name (ipnext.fleet.Name)


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
        oldest = slot - int(self.keep_seconds // DEMAND_SLOT_S)
        for old in [s for s in self.slots if s < oldest]:
            del self.slots[old]


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
) -> ModelDemand:
    """Add the regions' reports window by window, then read rates as one report would."""
    span = max((r.window_seconds for r in reports.values()), default=window_seconds)
    summed: dict[int, dict[str, int]] = {}
    for report in reports.values():
        for start, counts in report.windows.items():
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
