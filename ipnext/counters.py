"""Request counters per set app: the cumulative numbers routers and self-measuring parts push,
and the arithmetic the rollout gates run on them.

Histograms use fixed bucket bounds so snapshots from any replica add up, and a percentile over
a window is the percentile of the difference of two snapshots. Pure: no Ray, no Temporal.
"""

from __future__ import annotations

import bisect

from pydantic import BaseModel, Field

__all__ = [
    "LATENCY_BUCKETS_MS",
    "MetricsSnapshot",
    "SetCounters",
    "percentile",
]

# Upper bounds in ms; the last bucket is everything above the final bound.
LATENCY_BUCKETS_MS: tuple[float, ...] = (
    1,
    2,
    3,
    5,
    7,
    10,
    15,
    20,
    30,
    50,
    75,
    100,
    150,
    200,
    300,
    500,
    750,
    1000,
    2000,
    5000,
    10000,
)


class SetCounters(BaseModel):
    requests: int = 0
    errors: int = 0
    histograms: dict[str, list[int]] = Field(default_factory=dict)  # metric -> bucket counts

    def observe(self, metric: str, value_ms: float) -> None:
        buckets = self.histograms.setdefault(metric, [0] * (len(LATENCY_BUCKETS_MS) + 1))
        buckets[bisect.bisect_left(LATENCY_BUCKETS_MS, value_ms)] += 1

    def minus(self, earlier: SetCounters) -> SetCounters:
        diff = SetCounters(requests=self.requests - earlier.requests, errors=self.errors - earlier.errors)
        for metric, buckets in self.histograms.items():
            old = earlier.histograms.get(metric, [0] * len(buckets))
            diff.histograms[metric] = [a - b for a, b in zip(buckets, old, strict=True)]
        return diff

    def went_down_from(self, earlier: SetCounters) -> bool:
        """Cumulative counters never go down: if these did, they restarted after `earlier`."""
        if self.requests < earlier.requests or self.errors < earlier.errors:
            return True
        for metric, old in earlier.histograms.items():
            new = self.histograms.get(metric, [0] * len(old))
            if any(a < b for a, b in zip(new, old, strict=True)):
                return True
        return False

    def plus(self, other: SetCounters) -> SetCounters:
        merged = SetCounters(requests=self.requests + other.requests, errors=self.errors + other.errors)
        for metric in set(self.histograms) | set(other.histograms):
            a = self.histograms.get(metric, [0] * (len(LATENCY_BUCKETS_MS) + 1))
            b = other.histograms.get(metric, [0] * (len(LATENCY_BUCKETS_MS) + 1))
            merged.histograms[metric] = [x + y for x, y in zip(a, b, strict=True)]
        return merged


class MetricsSnapshot(BaseModel):
    """What a metrics actor holds: every replica's latest cumulative counters, and their sum.

    Gates diff `replicas`, one replica at a time, so a replica's counters that are missing from
    one read (the actor restarted and the replica has not pushed again yet) or new in it (a
    replica started) never make a window's counters go backwards or jump (`ipnext.rollout`)."""

    sets: dict[str, SetCounters] = Field(default_factory=dict)  # set app name -> counters (sum)
    replicas: dict[str, dict[str, SetCounters]] = Field(default_factory=dict)  # replica -> app -> counters

    def minus(self, earlier: MetricsSnapshot) -> dict[str, SetCounters]:
        """Per set app, what happened between `earlier` and this snapshot, replica by replica:
        a replica in both counts its difference; one new here counts from zero (it started in
        between, or restarted: its counters restart with it); one missing here counts nothing
        this time (its counters are not lost: they come back with its next push). A replica
        whose counters went down restarted under the same name: it counts from zero."""
        window: dict[str, SetCounters] = {}
        for replica, apps in self.replicas.items():
            then_apps = earlier.replicas.get(replica, {})
            for app, now in apps.items():
                then = then_apps.get(app)
                diff = now if then is None or now.went_down_from(then) else now.minus(then)
                window[app] = window.get(app, SetCounters()).plus(diff)
        return window


def percentile(buckets: list[int], q: float) -> float | None:
    """The upper bound of the bucket holding the q-quantile (None with no samples)."""
    total = sum(buckets)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, count in enumerate(buckets):
        seen += count
        if seen >= rank:
            return LATENCY_BUCKETS_MS[i] if i < len(LATENCY_BUCKETS_MS) else float("inf")
    return float("inf")
