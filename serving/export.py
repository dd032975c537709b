"""Where serving replicas send their figures: cumulative request counters pushed to the
model's metrics actor (which the rollout gates read), and ipnext's Prometheus series
(`ipnext_*`), on the bucket layout of `ipnext.contracts.counters` (`LATENCY_LAYOUT`). Each series
is recorded twice from one declaration (`FamilySpec`): into this process's tally for the metrics
actor, which `push_forever` pushes beside the counters and the routing app's keyed `GET /metrics`
serves (`prometheus_text.py`), and into Ray's metrics, still exported on Ray's own port."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import cache
from typing import Any

import ray
from ray.util import metrics

from ipnext.contracts.counters import LATENCY_LAYOUT
from ipnext.serving.layout import RAY_NAMESPACE, head_node_options, metrics_actor_name
from ipnext.serving.metrics import MetricsStore
from ipnext.serving.metrics_hub import hub_store
from ipnext.serving.prometheus_text import FamilySpec, ProcessSeries, valid_name

__all__ = [
    "METRICS_PUSH_SECONDS",
    "ROUTER_FAMILIES",
    "CounterPusher",
    "PartPrometheus",
    "RouterPrometheus",
    "process_series",
    "push_forever",
]

logger = logging.getLogger(__name__)

METRICS_PUSH_SECONDS = 1.0
_ROUTER_TAGS = ("model", "region", "set_app")
_PART_TAGS = (*_ROUTER_TAGS, "part")
_REQUESTS = FamilySpec(
    name="ipnext_requests_total", kind="counter", help="Requests served", labels=_ROUTER_TAGS
)
_ERRORS = FamilySpec(name="ipnext_errors_total", kind="counter", help="Requests failed", labels=_ROUTER_TAGS)
_SHED = FamilySpec(
    name="ipnext_shed_total",
    kind="counter",
    help="Requests shed at once for their expected queue wait (503)",
    labels=_ROUTER_TAGS,
)
# The gates' buckets, so a Prometheus `histogram_quantile` and a gate's percentile are the same
# number on the same requests (tests/unit/test_gate_truth.py renders and parses the exposition).
_LATENCY = FamilySpec(
    name="ipnext_latency_ms",
    kind="histogram",
    help="Request latency through the router (ms)",
    labels=_ROUTER_TAGS,
    bounds=LATENCY_LAYOUT.bounds(),
)
_VARIANT_REQUESTS = FamilySpec(
    name="ipnext_variant_requests_total",
    kind="counter",
    help="Requests sent to a variant of a choice node (a retry on the fallback counts again)",
    labels=(*_ROUTER_TAGS, "choice", "variant"),
)
_FALLBACKS = FamilySpec(
    name="ipnext_variant_fallbacks_total",
    kind="counter",
    help="Requests a choice node moved to its fallback variant, by reason",
    labels=(*_ROUTER_TAGS, "choice", "reason"),
)
ROUTER_FAMILIES = (_REQUESTS, _ERRORS, _SHED, _LATENCY, _VARIANT_REQUESTS, _FALLBACKS)


@cache
def process_series() -> ProcessSeries:
    """This process's tallies of ipnext series, one per metrics actor (made on first use)."""
    return ProcessSeries()


async def push_forever(
    actor_name: str,
    replica: str,
    payload: Callable[[], dict[str, Any]],
    demand: Callable[[], dict[str, int]] | None = None,
    engine_stats: Callable[[], dict[str, Any]] | None = None,
    series: ProcessSeries | None = None,
    hub_region: str | None = None,
) -> None:
    """Push this replica's cumulative counters (set app -> SetCounters) to a model's metrics
    actor every second, until the actor is gone; and after them this process's tally of ipnext
    series for that actor (`series`, by default the process's), under the process's key.

    The actor restarts when its process dies (`max_restarts`), empty: every replica's next push
    refills it, since each push carries the replica's whole cumulative counters. If it was
    killed for good (a deleted model, or by hand), the push fails, this task ends, and the
    replica's next request or reconfigure starts a new one, which creates a new actor.

    With `hub_region` (a pooled model's router), the store of that name lives in the region's
    metrics hub (serving/metrics_hub.py), one process for every pooled model of the region."""
    actor: Any = (
        hub_store(hub_region, actor_name)
        if hub_region is not None
        else ray.remote(MetricsStore)
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
    tallies = series if series is not None else process_series()
    series_refused = False
    while True:
        await asyncio.sleep(METRICS_PUSH_SECONDS)
        try:
            await actor.push.remote(replica, payload())
            if demand is not None:  # a router's requests by source (ipnext.policy.demand)
                await actor.push_demand.remote(replica, demand())
            if engine_stats is not None:  # an LLM part's figures under vLLM's names
                await actor.push_engine_stats.remote(replica, engine_stats())
        except ray.exceptions.RayActorError:
            return  # the next request or reconfigure starts a new pusher
        tally = tallies.get(actor_name)  # after `payload`, which sets a part's gauges
        if tally is None or series_refused:
            continue
        try:
            await actor.push_series.remote(tallies.key, tally.state().model_dump())
        except ray.exceptions.RayActorError:
            return
        except (AttributeError, ray.exceptions.RayTaskError) as err:
            # A metrics actor of an older version (a detached actor outlives an upgrade, and Ray
            # restarts it on its old code) has no `push_series`: the counters still go; the series
            # wait until the actor is made anew.
            series_refused = True
            logger.warning("metrics actor %s takes no series (%s): GET /metrics lacks them", actor_name, err)


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
        series: ProcessSeries | None = None,
        hub_region: str | None = None,
    ) -> None:
        self._actor_name = actor_name
        self._hub_region = hub_region
        self._replica = replica
        self._payload = payload
        self._demand = demand
        self._engine_stats = engine_stats
        self._series = series
        self._task: asyncio.Task[None] | None = None

    def ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                push_forever(
                    self._actor_name,
                    self._replica,
                    self._payload,
                    self._demand,
                    self._engine_stats,
                    self._series,
                    self._hub_region,
                )
            )

    def stop(self) -> None:
        """Push no more (the model left this process: a pool router dropped its router)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None


def _ray_metric(spec: FamilySpec) -> Any:
    """The Ray metric of a family (the same name, help and tags)."""
    if spec.kind == "histogram":
        return metrics.Histogram(spec.name, spec.help, list(spec.bounds), tag_keys=spec.labels)
    if spec.kind == "counter":
        return metrics.Counter(spec.name, spec.help, tag_keys=spec.labels)
    return metrics.Gauge(spec.name, spec.help, tag_keys=spec.labels)


class RouterPrometheus:
    """A router's request counters, latencies and variant choices (`ROUTER_FAMILIES`): into this
    process's tally for the (model, region) metrics actor, and Ray's metrics."""

    def __init__(self, series: ProcessSeries | None = None) -> None:
        self._series = series if series is not None else process_series()
        self._ray = {spec.name: _ray_metric(spec) for spec in ROUTER_FAMILIES}

    def _inc(self, spec: FamilySpec, tags: dict[str, str]) -> None:
        self._series.tally(metrics_actor_name(tags["model"], tags["region"])).inc(spec, tuple(tags.values()))
        self._ray[spec.name].inc(1, tags)

    def record_variant(
        self, model: str, region: str, app: str, choice: str, variant: str, reason: str | None
    ) -> None:
        tags = {"model": model, "region": region, "set_app": app, "choice": choice}
        self._inc(_VARIANT_REQUESTS, {**tags, "variant": variant})
        if reason is not None:
            self._inc(_FALLBACKS, {**tags, "reason": reason})

    def record_shed(self, model: str, region: str, app: str) -> None:
        self._inc(_SHED, {"model": model, "region": region, "set_app": app})

    def record(self, model: str, region: str, app: str, latency_ms: float | None) -> None:
        """One request: its latency, or None for a failed one."""
        tags = {"model": model, "region": region, "set_app": app}
        self._inc(_REQUESTS, tags)
        if latency_ms is None:
            self._inc(_ERRORS, tags)
        else:
            self._series.tally(metrics_actor_name(model, region)).observe(
                _LATENCY, (model, region, app), latency_ms
            )
            self._ray[_LATENCY.name].observe(latency_ms, tags)


class PartPrometheus:
    """A self-measuring part's figures: its latency observations as histograms (`ipnext_ttft_ms`,
    `ipnext_itl_ms`, `ipnext_queue_ms`) and the numbers of its `status()` as gauges
    (`ipnext_part_<name>`), tagged by model, region, set app and part; into this process's tally
    for the (model, region) metrics actor, and Ray's metrics."""

    def __init__(
        self, model: str, region: str, app: str, part: str, series: ProcessSeries | None = None
    ) -> None:
        self._tags = {"model": model, "region": region, "set_app": app, "part": part}
        self._labels = (model, region, app, part)
        self._tally = (series if series is not None else process_series()).tally(
            metrics_actor_name(model, region)
        )
        self._histograms: dict[str, tuple[FamilySpec, Any]] = {}
        self._gauges: dict[str, tuple[FamilySpec, Any]] = {}

    def observe(self, metric: str, value_ms: float) -> None:
        if metric not in self._histograms:
            spec = FamilySpec(
                name=f"ipnext_{metric}",
                kind="histogram",
                help=f"{metric} of a generative part",
                labels=_PART_TAGS,
                bounds=LATENCY_LAYOUT.bounds(),
            )
            self._histograms[metric] = (spec, _ray_metric(spec))
        spec, ray_metric = self._histograms[metric]
        self._tally.observe(spec, self._labels, value_ms)
        ray_metric.observe(value_ms, self._tags)

    def gauges(self, status: dict[str, Any]) -> None:
        for name, value in status.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if name not in self._gauges:
                if not valid_name(f"ipnext_part_{name}"):  # a status key no metric may be named by
                    continue
                spec = FamilySpec(name=f"ipnext_part_{name}", kind="gauge", help=name, labels=_PART_TAGS)
                self._gauges[name] = (spec, _ray_metric(spec))
            spec, ray_metric = self._gauges[name]
            self._tally.set(spec, self._labels, float(value))
            ray_metric.set(float(value), self._tags)
