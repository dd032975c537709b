"""The metrics store: the detached actor per (model, region) that router replicas and
self-measuring parts push their cumulative counters to (`ipnext.contracts.counters`), and that rollout
gates read and diff; routers also push their requests by source, its observed demand
(`ipnext.policy.demand`), which the actor saves to a file so that it outlives the actor. Every
process pushes its ipnext Prometheus series too (`prometheus_text.SeriesState`), which the
routing app's `GET /metrics` reads summed (`series`)."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import ValidationError

from ipnext.contracts.counters import LATENCY_LAYOUT, MetricsSnapshot, SetCounters, percentile
from ipnext.policy.demand import DemandHistory, demand_report, load_history, save_history
from ipnext.serving.llm.vllm_metrics import EngineStats
from ipnext.serving.prometheus_text import SeriesState, replicas_total

__all__ = [
    "LATENCY_LAYOUT",
    "DemandPlace",
    "MetricsSnapshot",
    "MetricsStore",
    "SetCounters",
    "demand_file",
    "percentile",
    "settings_place",
    "store_key",
]

logger = logging.getLogger(__name__)

# The actor's name (`serving.layout.metrics_actor_name`) past its prefix is `<model>/<region>`.
ENGINE_STATS_STALE_S = 30.0  # an LLM replica silent this long is gone from GET /metrics
# The same rule for the gauges of a process's series (its counters stay: they must never go down).
SERIES_GAUGES_STALE_S = ENGINE_STATS_STALE_S
_ACTOR_NAME = re.compile(r"^ipnext-metrics/([a-z][a-z0-9-]*)/([a-z][a-z0-9-]*)$")
DEMAND_SAVE_SECONDS = 5.0  # how often demand is saved where no settings say (`demand.save_seconds`)


class DemandPlace(NamedTuple):
    """Where a metrics store saves its demand history (None: in memory only), how often, and
    whether Ray restarted the process it lives in (then each router's first push is a baseline)."""

    path: Path | None
    save_seconds: float
    reconstructed: bool = False


def demand_file(folder: Path, model: str, region: str) -> Path:
    """Where the metrics actor of (model, region) saves its demand history."""
    return folder / model / f"{region}.json"


def store_key(name: str) -> tuple[str, str] | None:
    """The (model, region) of a metrics store's name (`serving.layout.metrics_actor_name`), or
    None for a name not of that shape."""
    match = _ACTOR_NAME.fullmatch(name)
    return (match[1], match[2]) if match is not None else None


class MetricsStore:
    """Body of the detached actor `ipnext-metrics/<model>/<region>` (wrapped by ray.remote).

    Counters live in memory only: the routers' next pushes refill them. Demand history is saved
    to `demand_file` every `demand.save_seconds` and loaded when the actor is (re)created, so a
    restart loses at most those last seconds, and not even those for a router that keeps running
    (its next cumulative push is diffed against the counts saved for it). No file, or a corrupt
    one: the history starts empty and the actor says so in its log."""

    def __init__(
        self,
        demand_path: str | None = None,
        save_seconds: float | None = None,
        *,
        place: DemandPlace | None = None,
    ) -> None:
        """`place` is for a store hosted by another actor (`serving.metrics_hub`), which knows
        where its (model, region) saves; without it, the store finds out from its actor's name."""
        if place is not None and (demand_path is not None or save_seconds is not None):
            raise ValueError("MetricsStore: give `place`, or `demand_path` and `save_seconds`, not both")
        self._by_replica: dict[str, dict[str, SetCounters]] = {}
        self._engine_stats: dict[str, tuple[float, EngineStats]] = {}  # replica -> (pushed at, stats)
        self._series: dict[str, tuple[float, SeriesState]] = {}  # process -> (pushed at, series)
        self._demand_path, self._save_seconds, reconstructed = (
            place if place is not None else _demand_place(demand_path, save_seconds)
        )
        loaded = load_history(self._demand_path) if self._demand_path is not None else None
        self._demand = loaded or DemandHistory()
        # Restarted without its history: each router's first push is its baseline, not new demand
        # (its cumulative counts since it started would land in one slot as a false peak).
        self._adopt = reconstructed and loaded is None
        self._saved_at = time.monotonic()
        self._dirty = False
        if self._demand_path is not None:
            how = "loaded" if loaded is not None else "no saved history, starting empty"
            logger.info("demand history %s: %s", self._demand_path, how)

    def push_demand(self, replica: str, counts: dict[str, int]) -> None:
        """A router replica's cumulative requests by source."""
        parsed = {str(k): int(v) for k, v in counts.items()}
        if self._adopt and replica not in self._demand.replicas:
            self._demand.adopt(replica, parsed, time.time())
        else:
            self._demand.record(replica, parsed, time.time())
        self._dirty = True
        if time.monotonic() - self._saved_at >= self._save_seconds:
            self.save_demand()

    def save_demand(self) -> None:
        """Write the history now (the actor does every `save_seconds` as routers push)."""
        self._saved_at = time.monotonic()
        if self._demand_path is None or not self._dirty:
            return
        try:
            save_history(self._demand, self._demand_path)
            self._dirty = False
        except OSError as err:  # a full or read-only disk: keep serving from memory, say so
            logger.warning("cannot save demand history to %s: %s", self._demand_path, err)

    def demand(self, window_seconds: float = 60.0) -> dict[str, Any]:
        """The `ipnext.policy.demand.DemandReport` of this (model, region), over windows of that length."""
        return demand_report(self._demand, time.time(), window_seconds).model_dump(mode="json")

    def push_engine_stats(self, replica: str, raw: dict[str, Any]) -> None:
        """An LLM part replica's figures under vLLM's names, cumulative (the latest replaces the
        previous; a malformed push is dropped, as for counters)."""
        try:
            self._engine_stats[replica] = (time.monotonic(), EngineStats.model_validate(raw))
        except ValidationError as err:
            logger.warning("dropping malformed engine stats of replica %s: %s", replica, err)

    def engine_stats(self) -> dict[str, Any] | None:
        """The sum over the replicas that pushed within ENGINE_STATS_STALE_S (a replica gone
        stops counting, as a vLLM instance's figures go with it); None when none did."""
        now = time.monotonic()
        fresh = [s for at, s in self._engine_stats.values() if now - at <= ENGINE_STATS_STALE_S]
        if not fresh:
            return None
        total = fresh[0]
        for stats in fresh[1:]:
            total = total.plus(stats)
        return total.model_dump()

    def push_series(self, process: str, raw: dict[str, Any]) -> None:
        """A process's ipnext series, cumulative (the latest replaces the previous; a malformed
        push is dropped, the process's last good one staying)."""
        try:
            self._series[process] = (time.monotonic(), SeriesState.model_validate(raw))
        except ValidationError as err:
            logger.warning("dropping malformed series of process %s: %s", process, err)

    def series(self) -> dict[str, Any]:
        """What `GET /metrics` serves of this (model, region) (`prometheus_text.replicas_total`):
        counters and histograms summed over every process that ever pushed, since this actor
        started (a gone replica's counts stay in the sum, which so never goes down), and the gauges
        of the processes that pushed within SERIES_GAUGES_STALE_S, each under its `replica`."""
        now = time.monotonic()
        live = [process for process, (at, _) in self._series.items() if now - at <= SERIES_GAUGES_STALE_S]
        return replicas_total({process: s for process, (_, s) in self._series.items()}, live).model_dump()

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


def settings_place(model: str, region: str, save_seconds: float | None = None) -> DemandPlace:
    """Where the metrics store of (model, region) saves its demand history, and how often: the
    file under the settings' `demand_store()`, by the settings of the stack's `IPNEXT_CONFIG`,
    which every Ray process of the dev stack inherits. With settings that cannot be read, or with
    no config file and no absolute `IPNEXT_DEMAND_DIR`, the history stays in memory only (logged):
    it is then lost with the process that holds it."""
    from ipnext.errors import IpnextError
    from ipnext.spec.settings import load_settings

    every = save_seconds if save_seconds is not None else DEMAND_SAVE_SECONDS
    try:
        settings = load_settings()
    except (IpnextError, OSError) as err:
        logger.warning("demand history kept in memory only (settings unreadable: %s)", err)
        return DemandPlace(None, every)
    every = save_seconds if save_seconds is not None else settings.demand.save_seconds
    chosen = settings.demand_dir
    if settings.source is None and (chosen is None or not chosen.is_absolute()):
        # No config file reached this process (a Ray cluster ipnext did not start, without
        # IPNEXT_CONFIG): a relative default would land in whatever folder the worker runs in.
        logger.warning("demand history kept in memory only: no IPNEXT_CONFIG says where to save it")
        return DemandPlace(None, every)
    return DemandPlace(demand_file(settings.demand_store(), model, region), every)


def _demand_place(path: str | None, save_seconds: float | None) -> DemandPlace:
    """Where this actor saves its demand history, how often, and whether Ray restarted it.

    Given a path (tests), that one. Inside the Ray actor, the file of its own name by the
    settings (`settings_place`). Outside an actor the history stays in memory only."""
    every = save_seconds if save_seconds is not None else DEMAND_SAVE_SECONDS
    if path is not None:
        return DemandPlace(Path(path), every)
    import ray

    if not ray.is_initialized():  # a bare MetricsStore (unit tests)
        return DemandPlace(None, every)
    context = ray.get_runtime_context()
    key = store_key(context.get_actor_name() or "")
    if key is None:
        return DemandPlace(None, every)
    return settings_place(*key, save_seconds)._replace(reconstructed=context.was_current_actor_reconstructed)
