"""The metrics store: the detached actor per (model, region) that router replicas and
self-measuring parts push their cumulative counters to (`ipnext.counters`), and that rollout
gates read and diff; routers also push their requests by source, its observed demand
(`ipnext.demand`)."""

from __future__ import annotations

import logging
import time
from typing import Any

from pydantic import ValidationError

from ipnext.counters import LATENCY_LAYOUT, MetricsSnapshot, SetCounters, percentile
from ipnext.demand import DemandHistory, demand_report

__all__ = [
    "LATENCY_LAYOUT",
    "MetricsSnapshot",
    "MetricsStore",
    "SetCounters",
    "percentile",
]

logger = logging.getLogger(__name__)


class MetricsStore:
    """Body of the detached actor `ipnext-metrics/<model>/<region>` (wrapped by ray.remote)."""

    def __init__(self) -> None:
        self._by_replica: dict[str, dict[str, SetCounters]] = {}
        # Lost with the actor (it restarts empty): the routers' next pushes count from zero.
        self._demand = DemandHistory()

    def push_demand(self, replica: str, counts: dict[str, int]) -> None:
        """A router replica's cumulative requests by source."""
        self._demand.record(replica, {str(k): int(v) for k, v in counts.items()}, time.time())

    def demand(self, window_seconds: float = 60.0) -> dict[str, Any]:
        """The `ipnext.demand.DemandReport` of this (model, region), over windows of that length."""
        return demand_report(self._demand, time.time(), window_seconds).model_dump(mode="json")

    def push(self, replica: str, counters: dict[str, dict[str, Any]]) -> None:
        # Counters are cumulative per replica, so the latest push replaces the previous one. A
        # push whose histograms do not fit the layout it names is dropped (the replica's last
        # good one stays): one replica's garbage must not fail every read the gates make.
        try:
            parsed = {app: SetCounters.model_validate(raw) for app, raw in counters.items()}
        except ValidationError as err:
            logger.warning("dropping a malformed push of replica %s: %s", replica, err)
            return
        self._by_replica[replica] = parsed

    def snapshot(self) -> dict[str, Any]:
        """Every replica's latest counters, and their sum per set app."""
        total: dict[str, SetCounters] = {}
        for counters in self._by_replica.values():
            for app, parsed in counters.items():
                total[app] = total.get(app, SetCounters()).plus(parsed)
        return MetricsSnapshot(sets=total, replicas=self._by_replica).model_dump()
