"""The gate arithmetic of a rollout (pure): a window's counters, each gate judged on them, replicas scaled
by a step and the weights mixed across sets."""

from __future__ import annotations

import math
from typing import Any

from ipnext.contracts.counters import MetricsSnapshot, SetCounters
from ipnext.contracts.rollout import GateReading

__all__ = [
    "GATE_MIN_SAMPLES",
    "evaluate_gates",
    "judge_window",
    "mix_weights",
    "scaled_replicas",
    "window_counters",
]


# A gate is judged once the new set served this many requests in the window (or min_requests,
# when that is smaller): one slow first request must not roll a healthy set back.
GATE_MIN_SAMPLES = 10


def window_counters(before: dict[str, Any] | None, after: dict[str, Any], apps: set[str]) -> SetCounters:
    """Counters of `apps` between two metrics-actor snapshots (summed over the apps).

    Snapshots with per-replica counters are diffed replica by replica (see
    `MetricsSnapshot.minus`): a metrics actor that restarted, or a replica that did, starts
    nothing over and breaches nothing. Snapshots recorded before replicas were kept carry sums
    only, and are diffed as sums (a workflow replaying its history reads the same window)."""
    earlier = MetricsSnapshot.model_validate(before or {})
    later = MetricsSnapshot.model_validate(after)
    if later.replicas or earlier.replicas:
        window = later.minus(earlier)
        total = SetCounters()
        for app in apps:
            total = total.plus(window.get(app, SetCounters()))
        return total
    total = SetCounters()
    for app in apps:
        now = later.sets.get(app, SetCounters())
        total = total.plus(now.minus(earlier.sets.get(app, SetCounters())))
    return total


def _metric(counters: SetCounters, metric: str) -> float | None:
    if metric == "error_rate":
        return counters.errors / counters.requests if counters.requests else None
    # latency_p99_ms -> latency_ms, read by the rule of the counters' layout (histogram_quantile)
    return counters.quantile_ms(metric.removesuffix("_p99_ms") + "_ms", 0.99)


def evaluate_gates(
    gates: list[Any], region: str, new: SetCounters, old: SetCounters, min_requests: int
) -> list[GateReading]:
    """Each gate (`ipnext.spec.model.GateSpec`) on the new set's window against the old set's.

    A bound is `max`, or `max_ratio_to_old` x the old set's value, whichever is lower; a value
    at or under `floor` never fails. Judged only once the new set has served
    min(min_requests, GATE_MIN_SAMPLES) requests in the window (at least one)."""
    needed = max(1, min(min_requests, GATE_MIN_SAMPLES))
    readings = []
    for gate in gates:
        value = _metric(new, gate.metric)
        old_value = _metric(old, gate.metric)
        limits = []
        if gate.max is not None:
            limits.append(gate.max)
        if gate.max_ratio_to_old is not None and old_value is not None and math.isfinite(old_value):
            limits.append(gate.max_ratio_to_old * old_value)
        limit = min(limits) if limits else None
        judged = new.requests >= needed and value is not None
        breached = judged and limit is not None and value is not None and value > max(limit, gate.floor)
        readings.append(
            GateReading(
                region=region,
                metric=gate.metric,
                value=value,
                old_value=old_value,
                limit=None if limit is None else max(limit, gate.floor),
                requests=new.requests,
                judged=judged,
                breached=breached,
            )
        )
    return readings


def judge_window(
    gates: list[Any],
    min_requests: int,
    regions: list[str],
    before: dict[str, dict[str, Any]],
    after: dict[str, dict[str, Any]],
    new_apps: set[str],
    old_apps: set[str],
) -> tuple[list[GateReading], int]:
    """The gates of every region over the window between two metrics reads (region -> the
    metrics actor's snapshot), and the requests the new set's apps served in it."""
    readings: list[GateReading] = []
    requests = 0
    for region in regions:
        new = window_counters(before.get(region), after.get(region, {}), new_apps)
        old = window_counters(before.get(region), after.get(region, {}), old_apps)
        readings += evaluate_gates(gates, region, new, old, min_requests)
        requests += new.requests
    return readings, requests


# ---- steps --------------------------------------------------------------------------------


def scaled_replicas(replicas: int, share: float) -> int:
    """Replicas a deployment needs for `share` (0-1) of its traffic: the plan's count scaled and
    rounded up, so each replica's load, and so the plan's headroom, is never worse than planned."""
    if replicas <= 0 or share <= 0:
        return 0
    return max(1, math.ceil(replicas * min(share, 1.0) - 1e-9))


def mix_weights(
    start: dict[str, dict[str, float]], end: dict[str, dict[str, float]], percent: float
) -> dict[str, dict[str, float]]:
    """Router weights `percent` of the way from `start` to `end` (region -> app -> percent).
    A region only in `end` (a router the move creates) takes `end` as it is."""
    mixed: dict[str, dict[str, float]] = {}
    share = percent / 100.0
    for region in sorted(set(start) | set(end)):
        if region not in start:
            mixed[region] = dict(end[region])
            continue
        if region not in end:
            mixed[region] = dict(start[region])
            continue
        weights: dict[str, float] = {}
        for app, w in start[region].items():
            weights[app] = weights.get(app, 0.0) + w * (1 - share)
        for app, w in end[region].items():
            weights[app] = weights.get(app, 0.0) + w * share
        mixed[region] = {a: round(w, 6) for a, w in sorted(weights.items()) if w > 1e-9}
    return mixed
