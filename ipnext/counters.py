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

    def plus(self, other: SetCounters) -> SetCounters:
        merged = SetCounters(requests=self.requests + other.requests, errors=self.errors + other.errors)
        for metric in set(self.histograms) | set(other.histograms):
            a = self.histograms.get(metric, [0] * (len(LATENCY_BUCKETS_MS) + 1))
            b = other.histograms.get(metric, [0] * (len(LATENCY_BUCKETS_MS) + 1))
            merged.histograms[metric] = [x + y for x, y in zip(a, b, strict=True)]
        return merged


class MetricsSnapshot(BaseModel):
    sets: dict[str, SetCounters] = Field(default_factory=dict)  # set app name -> counters


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
