"""Request counters per set app: the cumulative numbers routers and self-measuring parts push,
and the arithmetic the rollout gates run on them.

Histograms count into one bucket layout (`LATENCY_LAYOUT`: log-spaced, each bound `BUCKET_RATIO`
times the one before), the same the Prometheus export uses; a gate's percentile is Prometheus'
`histogram_quantile` over it, so a dashboard's p99 is the gate's. Every `SetCounters` names its
layout, so counters recorded on another one (the legacy fixed bounds) are read by their own rule.
Pure: no Ray, no Temporal.
"""

from __future__ import annotations

import bisect
import math
from decimal import ROUND_FLOOR, Decimal, localcontext
from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ipnext.names import Frozen

__all__ = [
    "BUCKET_RATIO",
    "LATENCY_LAYOUT",
    "LEGACY_BUCKETS_MS",
    "UNIT_BUCKETS",
    "BucketLayout",
    "MetricsSnapshot",
    "OutcomeTotals",
    "SetCounters",
    "bucket_bounds",
    "histogram_quantile",
    "percentile",
]

# The ratio r of consecutive bucket bounds: a percentile read from the buckets is within a
# factor r of the true one (relative error below r - 1). A named constant rather than a setting:
# Ray's metrics agent keeps the bounds a histogram was first registered with on a node and drops
# other processes' points on other bounds, so every replica of a cluster must share them.
BUCKET_RATIO = 1.05
LOWEST_BOUND_MS = 0.1
HIGHEST_BOUND_MS = 120_000.0  # the last finite bound is at least this (a 2-minute request)
_SIGNIFICANT_DIGITS = 6

# The fixed bounds counters carried before they named a layout (read with the legacy rule: a
# percentile is the upper bound of its bucket). Kept so recorded histories replay as they ran.
LEGACY_BUCKETS_MS: tuple[float, ...] = (
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


class BucketLayout(BaseModel):
    """Upper bounds of latency buckets: `lowest_ms`, then each bound `ratio` times the one
    before, rounded down to 6 significant digits (a short decimal, never more than `ratio` above
    the one before), `count` finite bounds in all; a last bucket holds everything above them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lowest_ms: float = Field(gt=0)
    ratio: float = Field(ge=1.001, le=2)
    count: int = Field(ge=1, le=10_000)

    @classmethod
    def spanning(cls, lowest_ms: float, ratio: float, highest_ms: float) -> BucketLayout:
        """The layout from `lowest_ms` whose last finite bound is the first at or above `highest_ms`."""
        layout = cls(lowest_ms=lowest_ms, ratio=ratio, count=10_000)
        return layout.model_copy(update={"count": bisect.bisect_left(layout.bounds(), highest_ms) + 1})

    def bounds(self) -> tuple[float, ...]:
        return _log_bounds(self.lowest_ms, self.ratio, self.count)


@cache
def _log_bounds(lowest_ms: float, ratio: float, count: int) -> tuple[float, ...]:
    # Decimal arithmetic, so every machine computes the same bounds: a gate's reading in workflow
    # code must not depend on a platform's pow().
    with localcontext() as ctx:
        ctx.prec = 40
        step = Decimal(repr(ratio))
        bound = Decimal(repr(lowest_ms))
        bounds = [bound]
        while len(bounds) < count:
            exact = bound * step
            bound = exact.quantize(Decimal(1).scaleb(exact.adjusted() - _SIGNIFICANT_DIGITS + 1), ROUND_FLOOR)
            bounds.append(bound)
    return tuple(float(b) for b in bounds)


LATENCY_LAYOUT = BucketLayout.spanning(LOWEST_BOUND_MS, BUCKET_RATIO, HIGHEST_BOUND_MS)


def bucket_bounds(layout: BucketLayout | None) -> tuple[float, ...]:
    """The finite upper bounds of `layout` (None: the legacy fixed bounds)."""
    return LEGACY_BUCKETS_MS if layout is None else layout.bounds()


def _rank(layout: BucketLayout | None) -> tuple[bool, bool, float, float, int]:
    """Which of two layouts a sum of counters keeps: the current one, else the finest."""
    if layout is None:
        return (False, False, 0.0, 0.0, 0)
    return (layout == LATENCY_LAYOUT, True, -layout.ratio, -layout.lowest_ms, layout.count)


# The unit buckets of an experiment's outcomes: each value is also summed into its unit's bucket
# (`policy.experiments.unit_bucket`), so the statistics can take buckets, not values, as the
# independent samples, and the counters stay bounded and mergeable however many units there are.
UNIT_BUCKETS = 64


def _add_lists(mine: list[Any], other: list[Any], sign: int = 1) -> list[Any]:
    """Element-wise mine + sign * other, an empty list counting as zeros."""
    if not other:
        return list(mine)
    if not mine:
        return [sign * x for x in other]
    return [a + sign * b for a, b in zip(mine, other, strict=True)]


class OutcomeTotals(Frozen):
    """One outcome of one arm: how many values, their sum and sum of squares, and whether every
    value was 0 or 1 (a rate); and the same per unit bucket (`UNIT_BUCKETS` each, empty until a
    value with a bucket is added) for the values fed back with their unit's bucket."""

    count: int = 0
    total: float = 0.0
    squares: float = 0.0
    binary: bool = True
    bucket_counts: list[int] = Field(default_factory=list)
    bucket_totals: list[float] = Field(default_factory=list)
    bucket_squares: list[float] = Field(default_factory=list)

    @model_validator(mode="after")
    def _buckets_whole(self) -> OutcomeTotals:
        sizes = {len(self.bucket_counts), len(self.bucket_totals), len(self.bucket_squares)}
        if sizes not in ({0}, {UNIT_BUCKETS}):
            raise ValueError(f"bucket_counts, bucket_totals, bucket_squares: {UNIT_BUCKETS} each or none")
        return self

    def add(self, value: float, bucket: int | None = None) -> OutcomeTotals:
        if not math.isfinite(value):
            raise ValueError(f"outcome: a finite number, got {value!r}")
        counts, totals, squares = self.bucket_counts, self.bucket_totals, self.bucket_squares
        if bucket is not None:
            if not 0 <= bucket < UNIT_BUCKETS:
                raise ValueError(f"bucket: {bucket} is not in [0, {UNIT_BUCKETS})")
            counts = list(counts) or [0] * UNIT_BUCKETS
            totals = list(totals) or [0.0] * UNIT_BUCKETS
            squares = list(squares) or [0.0] * UNIT_BUCKETS
            counts[bucket] += 1
            totals[bucket] += value
            squares[bucket] += value * value
        return OutcomeTotals(
            count=self.count + 1,
            total=self.total + value,
            squares=self.squares + value * value,
            binary=self.binary and value in (0.0, 1.0),
            bucket_counts=counts,
            bucket_totals=totals,
            bucket_squares=squares,
        )

    def minus(self, earlier: OutcomeTotals) -> OutcomeTotals:
        """What was added since `earlier` (cumulative totals, as counters are diffed)."""
        return OutcomeTotals(
            count=self.count - earlier.count,
            total=self.total - earlier.total,
            squares=self.squares - earlier.squares,
            binary=self.binary,
            bucket_counts=_add_lists(self.bucket_counts, earlier.bucket_counts, -1),
            bucket_totals=_add_lists(self.bucket_totals, earlier.bucket_totals, -1),
            bucket_squares=_add_lists(self.bucket_squares, earlier.bucket_squares, -1),
        )

    def merged(self, other: OutcomeTotals) -> OutcomeTotals:
        return OutcomeTotals(
            count=self.count + other.count,
            total=self.total + other.total,
            squares=self.squares + other.squares,
            binary=self.binary and other.binary,
            bucket_counts=_add_lists(self.bucket_counts, other.bucket_counts),
            bucket_totals=_add_lists(self.bucket_totals, other.bucket_totals),
            bucket_squares=_add_lists(self.bucket_squares, other.bucket_squares),
        )

    def bucketed(self) -> bool:
        """Whether every value was added with its unit's bucket (the buckets hold them all)."""
        return bool(self.bucket_counts) and sum(self.bucket_counts) == self.count

    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def variance(self) -> float | None:
        """The sample variance (n - 1), None under two values."""
        if self.count < 2:
            return None
        mean = self.total / self.count
        return max(0.0, (self.squares - self.count * mean * mean) / (self.count - 1))


class SetCounters(BaseModel):
    requests: int = 0
    errors: int = 0
    # Requests the router shed at once for their expected queue wait (`policy.admission`): not
    # requests of the set, never its errors (gates judge what the set was given to serve).
    shed: int = 0
    histograms: dict[str, list[int]] = Field(default_factory=dict)  # metric -> bucket counts
    # Experiment outcomes reported for answers of this set app (the feedback route): name -> totals.
    outcomes: dict[str, OutcomeTotals] = Field(default_factory=dict)
    # The layout `histograms` count into. None: the legacy fixed bounds (`LEGACY_BUCKETS_MS`),
    # which counters recorded before layouts existed carry: they have histograms and no `layout`.
    layout: BucketLayout | None = LATENCY_LAYOUT

    @model_validator(mode="before")
    @classmethod
    def _legacy_without_layout(cls, data: Any) -> Any:
        if isinstance(data, dict) and "layout" not in data and data.get("histograms"):
            return {**data, "layout": None}
        return data

    @model_validator(mode="after")
    def _histograms_fit_the_layout(self) -> SetCounters:
        size = len(bucket_bounds(self.layout)) + 1
        for metric, buckets in self.histograms.items():
            if len(buckets) != size:
                raise ValueError(
                    f"histogram {metric!r} has {len(buckets)} buckets; its layout {self.layout} has {size}"
                )
        return self

    def _same_layout(self, other: SetCounters) -> bool:
        """Histograms of the two may be added or diffed (counters without any fit every layout)."""
        return not self.histograms or not other.histograms or self.layout == other.layout

    def observe(self, metric: str, value_ms: float) -> None:
        bounds = bucket_bounds(self.layout)
        buckets = self.histograms.setdefault(metric, [0] * (len(bounds) + 1))
        buckets[bisect.bisect_left(bounds, value_ms)] += 1  # a bound holds values up to it (Prometheus' le)

    def quantile_ms(self, metric: str, q: float) -> float | None:
        """The q-quantile of `metric` by the rule of this layout (None with no samples)."""
        buckets = self.histograms.get(metric)
        return percentile(buckets, q, self.layout) if buckets else None

    def minus(self, earlier: SetCounters) -> SetCounters:
        """What happened since `earlier`. Counters on another layout than `earlier` were not
        counted on from it (their process restarted with another layout): they count from zero."""
        if not self._same_layout(earlier):
            return self.model_copy(deep=True)
        diff = SetCounters(
            requests=self.requests - earlier.requests,
            errors=self.errors - earlier.errors,
            shed=self.shed - earlier.shed,
            layout=self.layout,
            outcomes={n: t.minus(earlier.outcomes.get(n, OutcomeTotals())) for n, t in self.outcomes.items()},
        )
        for metric, buckets in self.histograms.items():
            old = earlier.histograms.get(metric, [0] * len(buckets))
            diff.histograms[metric] = [a - b for a, b in zip(buckets, old, strict=True)]
        return diff

    def went_down_from(self, earlier: SetCounters) -> bool:
        """Cumulative counters never go down: if these did, they restarted after `earlier`. So
        did counters whose layout changed (only a new process counts on another layout)."""
        if self.requests < earlier.requests or self.errors < earlier.errors or self.shed < earlier.shed:
            return True
        if any(self.outcomes.get(n, OutcomeTotals()).count < t.count for n, t in earlier.outcomes.items()):
            return True
        if not self._same_layout(earlier):
            return True
        for metric, old in earlier.histograms.items():
            new = self.histograms.get(metric, [0] * len(old))
            if any(a < b for a, b in zip(new, old, strict=True)):
                return True
        return False

    def plus(self, other: SetCounters) -> SetCounters:
        """The sum. Histograms on two layouts never add: the sum keeps those of the current
        layout (else the finer one) and leaves the other side's out, its requests and errors
        still counting. That happens only while replicas of two versions push to one metrics
        actor (an upgrade), and the gates then judge the upgraded replicas' latencies. The choice
        depends on the layouts alone, so a sum is the same in any order (workflow replay)."""
        sides = [c for c in (self, other) if c.histograms]
        layout = max((c.layout for c in sides), key=_rank) if sides else self.layout
        names = sorted(set(self.outcomes) | set(other.outcomes))
        merged = SetCounters(
            requests=self.requests + other.requests,
            errors=self.errors + other.errors,
            shed=self.shed + other.shed,
            layout=layout,
            outcomes={
                n: self.outcomes.get(n, OutcomeTotals()).merged(other.outcomes.get(n, OutcomeTotals()))
                for n in names
            },
        )
        zeros = [0] * (len(bucket_bounds(layout)) + 1)
        for side in (c for c in sides if c.layout == layout):
            for metric, buckets in side.histograms.items():
                total = merged.histograms.get(metric, zeros)
                merged.histograms[metric] = [x + y for x, y in zip(total, buckets, strict=True)]
        return merged


class MetricsSnapshot(BaseModel):
    """What a metrics actor holds: every replica's latest cumulative counters, and their sum.

    Gates diff `replicas`, one replica at a time, so a replica's counters that are missing from
    one read (the actor restarted and the replica has not pushed again yet) or new in it (a
    replica started) never make a window's counters go backwards or jump (`ipnext.policy.gates`)."""

    sets: dict[str, SetCounters] = Field(default_factory=dict)  # set app name -> counters (sum)
    replicas: dict[str, dict[str, SetCounters]] = Field(default_factory=dict)  # replica -> app -> counters

    def minus(self, earlier: MetricsSnapshot) -> dict[str, SetCounters]:
        """Per set app, what happened between `earlier` and this snapshot, replica by replica:
        a replica in both counts its difference; one new here counts from zero (it started in
        between, or restarted: its counters restart with it); one missing here counts nothing
        this time (its counters are not lost: they come back with its next push). A replica
        whose counters went down, or changed layout, restarted under the same name: it counts
        from zero."""
        window: dict[str, SetCounters] = {}
        for replica, apps in self.replicas.items():
            then_apps = earlier.replicas.get(replica, {})
            for app, now in apps.items():
                then = then_apps.get(app)
                diff = now if then is None or now.went_down_from(then) else now.minus(then)
                window[app] = window.get(app, SetCounters()).plus(diff)
        return window


def histogram_quantile(q: float, bounds: tuple[float, ...], counts: list[int]) -> float | None:
    """Prometheus' `histogram_quantile` over per-bucket `counts` (the last one above every bound):
    linear interpolation within the bucket holding rank q x total; the lowest bucket starts at 0
    (its bound being positive); a rank in the last bucket answers the highest finite bound.
    None with no samples."""
    if not 0 < q <= 1:
        raise ValueError(f"quantile {q} is not in (0, 1]")
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    below = 0
    for i, count in enumerate(counts[:-1]):
        if below + count >= rank:
            start = bounds[i - 1] if i else 0.0
            return start + (bounds[i] - start) * (rank - below) / count
        below += count
    return bounds[-1]


def _legacy_percentile(buckets: list[int], q: float) -> float | None:
    """The legacy rule: the upper bound of the bucket holding the q-quantile."""
    total = sum(buckets)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, count in enumerate(buckets):
        seen += count
        if seen >= rank:
            return LEGACY_BUCKETS_MS[i] if i < len(LEGACY_BUCKETS_MS) else float("inf")
    return float("inf")


def percentile(buckets: list[int], q: float, layout: BucketLayout | None) -> float | None:
    """The q-quantile of a histogram counted on `layout`: Prometheus' `histogram_quantile`, or
    for the legacy bounds (None) the legacy rule. None with no samples."""
    if layout is None:
        return _legacy_percentile(buckets, q)
    return histogram_quantile(q, layout.bounds(), buckets)
