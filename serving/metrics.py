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
        """Every replica's latest counters, and their sum per set app."""
        total: dict[str, SetCounters] = {}
        replicas: dict[str, dict[str, SetCounters]] = {}
        for replica, counters in self._by_replica.items():
            replicas[replica] = {app: SetCounters.model_validate(raw) for app, raw in counters.items()}
            for app, parsed in replicas[replica].items():
                total[app] = total.get(app, SetCounters()).plus(parsed)
        return MetricsSnapshot(sets=total, replicas=replicas).model_dump()
