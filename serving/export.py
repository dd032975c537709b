"""Where serving replicas send their figures: cumulative request counters pushed to the
model's metrics actor (which the rollout gates read), and the same figures through Ray's
Prometheus endpoint, on the bucket layout of `ipnext.contracts.counters` (`LATENCY_LAYOUT`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import ray
from ray.util import metrics

from ipnext.contracts.counters import LATENCY_LAYOUT
from ipnext.serving.layout import RAY_NAMESPACE, head_node_options
from ipnext.serving.metrics import MetricsStore

__all__ = ["METRICS_PUSH_SECONDS", "CounterPusher", "PartPrometheus", "RouterPrometheus", "push_forever"]

METRICS_PUSH_SECONDS = 1.0
# The gates' buckets, so a Prometheus `histogram_quantile` and a gate's percentile are the same
# number on the same requests (tests/unit/test_gate_truth.py renders and parses the exposition).
_BOUNDARIES = list(LATENCY_LAYOUT.bounds())


async def push_forever(
    actor_name: str,
    replica: str,
    payload: Callable[[], dict[str, Any]],
    demand: Callable[[], dict[str, int]] | None = None,
    engine_stats: Callable[[], dict[str, Any]] | None = None,
) -> None:
    """Push this replica's cumulative counters (set app -> SetCounters) to a model's metrics
    actor every second, until the actor is gone.

    The actor restarts when its process dies (`max_restarts`), empty: every replica's next push
    refills it, since each push carries the replica's whole cumulative counters. If it was
    killed for good (a deleted model, or by hand), the push fails, this task ends, and the
    replica's next request or reconfigure starts a new one, which creates a new actor."""
    actor = (
        ray.remote(MetricsStore)
        .options(
            name=actor_name,
            namespace=RAY_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=-1,
            # On the head node: the gates read it and demand history lives in it, so it must
            # not die with the region whose replicas push to it.
            **head_node_options(),
        )
        .remote()
    )
    while True:
        await asyncio.sleep(METRICS_PUSH_SECONDS)
        try:
            await actor.push.remote(replica, payload())  # type: ignore[attr-defined]
            if demand is not None:  # a router's requests by source (ipnext.policy.demand)
                await actor.push_demand.remote(replica, demand())  # type: ignore[attr-defined]
            if engine_stats is not None:  # an LLM part's figures under vLLM's names
                await actor.push_engine_stats.remote(replica, engine_stats())  # type: ignore[attr-defined]
        except ray.exceptions.RayActorError:
            return  # the next request or reconfigure starts a new pusher


class CounterPusher:
    """One replica's `push_forever` task, started (again, once the metrics actor went away) by
    `ensure_running`, which a replica calls on each request or reconfigure."""

    def __init__(
        self,
        actor_name: str,
        replica: str,
        payload: Callable[[], dict[str, Any]],
        demand: Callable[[], dict[str, int]] | None = None,
        engine_stats: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self._actor_name = actor_name
        self._replica = replica
        self._payload = payload
        self._demand = demand
        self._engine_stats = engine_stats
        self._task: asyncio.Task[None] | None = None

    def ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                push_forever(self._actor_name, self._replica, self._payload, self._demand, self._engine_stats)
            )


class RouterPrometheus:
    """A router's request counters and variant choices through Ray's Prometheus endpoint."""

    def __init__(self) -> None:
        tags = ("model", "region", "set_app")
        self._requests = metrics.Counter("ipnext_requests_total", "Requests served", tag_keys=tags)
        self._errors = metrics.Counter("ipnext_errors_total", "Requests failed", tag_keys=tags)
        self._shed = metrics.Counter(
            "ipnext_shed_total", "Requests shed at once for their expected queue wait (503)", tag_keys=tags
        )
        self._latency = metrics.Histogram(
            "ipnext_latency_ms", "Request latency through the router (ms)", _BOUNDARIES, tag_keys=tags
        )
        self._variant_requests = metrics.Counter(
            "ipnext_variant_requests_total",
            "Requests sent to a variant of a choice node (a retry on the fallback counts again)",
            tag_keys=(*tags, "choice", "variant"),
        )
        self._fallbacks = metrics.Counter(
            "ipnext_variant_fallbacks_total",
            "Requests a choice node moved to its fallback variant, by reason",
            tag_keys=(*tags, "choice", "reason"),
        )

    def record_variant(
        self, model: str, region: str, app: str, choice: str, variant: str, reason: str | None
    ) -> None:
        tags = {"model": model, "region": region, "set_app": app, "choice": choice}
        self._variant_requests.inc(1, {**tags, "variant": variant})
        if reason is not None:
            self._fallbacks.inc(1, {**tags, "reason": reason})

    def record_shed(self, model: str, region: str, app: str) -> None:
        self._shed.inc(1, {"model": model, "region": region, "set_app": app})

    def record(self, model: str, region: str, app: str, latency_ms: float | None) -> None:
        """One request: its latency, or None for a failed one."""
        tags = {"model": model, "region": region, "set_app": app}
        self._requests.inc(1, tags)
        if latency_ms is None:
            self._errors.inc(1, tags)
        else:
            self._latency.observe(latency_ms, tags)


class PartPrometheus:
    """A self-measuring part's figures through Ray's Prometheus endpoint: its latency
    observations as histograms (`ipnext_ttft_ms`, `ipnext_itl_ms`, `ipnext_queue_ms`) and the
    numbers of its `status()` as gauges (`ipnext_part_<name>`), tagged by model, region, set
    app and part."""

    def __init__(self, model: str, region: str, app: str, part: str) -> None:
        self._tags = {"model": model, "region": region, "set_app": app, "part": part}
        self._histograms: dict[str, metrics.Histogram] = {}
        self._gauges: dict[str, metrics.Gauge] = {}

    def observe(self, metric: str, value_ms: float) -> None:
        if metric not in self._histograms:
            self._histograms[metric] = metrics.Histogram(
                f"ipnext_{metric}", f"{metric} of a generative part", _BOUNDARIES, tag_keys=tuple(self._tags)
            )
        self._histograms[metric].observe(value_ms, self._tags)

    def gauges(self, status: dict[str, Any]) -> None:
        for name, value in status.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if name not in self._gauges:
                self._gauges[name] = metrics.Gauge(f"ipnext_part_{name}", name, tag_keys=tuple(self._tags))
            self._gauges[name].set(float(value), self._tags)
