"""The metrics store: the detached actor per (model, region) that router replicas and
self-measuring parts push their cumulative counters to (`ipnext.counters`), and that rollout
gates read and diff."""

from __future__ import annotations

from typing import Any

from ipnext.counters import LATENCY_BUCKETS_MS, MetricsSnapshot, SetCounters, percentile

__all__ = [
    "LATENCY_BUCKETS_MS",
    "MetricsSnapshot",
    "MetricsStore",
    "SetCounters",
    "percentile",
]


class MetricsStore:
    """Body of the detached actor `ipnext-metrics/<model>/<region>` (wrapped by ray.remote)."""

    def __init__(self) -> None:
        self._by_replica: dict[str, dict[str, dict[str, Any]]] = {}

    def push(self, replica: str, counters: dict[str, dict[str, Any]]) -> None:
        # Counters are cumulative per replica, so the latest push replaces the previous one.
        self._by_replica[replica] = counters

    def snapshot(self) -> dict[str, Any]:
        total: dict[str, SetCounters] = {}
        for counters in self._by_replica.values():
            for app, raw in counters.items():
                total[app] = total.get(app, SetCounters()).plus(SetCounters.model_validate(raw))
        return MetricsSnapshot(sets=total).model_dump()
