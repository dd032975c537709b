"""The metrics hub: one detached actor per region that hosts the metrics stores
(`serving.metrics.MetricsStore`) of many models, so that the models of a shared pool do not each
cost a process, and the handles (`StoreRef`) through which callers reach a store alike whether it
is a model's own actor or a hub's."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, overload

from ipnext.serving.layout import RAY_NAMESPACE, head_node_options, metrics_actor_name
from ipnext.serving.metrics import (
    DEMAND_SAVE_SECONDS,
    DemandPlace,
    MetricsStore,
    demand_file,
    settings_place,
    store_key,
)

__all__ = [
    "HUB_ANSWER_TIMEOUT_S",
    "STORE_METHODS",
    "MetricsHub",
    "StoreRef",
    "drop_stores",
    "find_stores",
    "hub_actor",
    "hub_actor_name",
    "hub_store",
]

logger = logging.getLogger(__name__)

# What a hub forwards: MetricsStore's public methods, and nothing else of it or of Python's.
STORE_METHODS = (
    "push",
    "push_demand",
    "push_engine_stats",
    "push_series",
    "snapshot",
    "demand",
    "engine_stats",
    "series",
    "save_demand",
)
# How long find_stores and drop_stores wait on a hub's answer (a hub that Ray is restarting
# answers once it is back; one that hangs must not hang a gate or a delete with it).
HUB_ANSWER_TIMEOUT_S = 30.0
_REGION = re.compile(r"[a-z][a-z0-9-]*")  # the region part of metrics.py's store names


def hub_actor_name(region: str) -> str:
    """The actor name of a region's hub: its prefix is not `ipnext-metrics/`, so it never meets
    the name of a model's own metrics actor (`metrics_actor_name`)."""
    return f"ipnext-metrics-hub/{region}"


def _store_model(store: str, region: str) -> str:
    """The model of a store name that a hub of `region` may hold; ValueError naming the fix."""
    key = store_key(store)
    if key is None:
        raise ValueError(
            f"store {store!r} is not a metrics store name: expected 'ipnext-metrics/<model>/<region>'"
            " as serving.layout.metrics_actor_name(model, region) builds it"
        )
    if key[1] != region:
        raise ValueError(
            f"store {store!r} is of region {key[1]!r}, not of this hub's region {region!r}:"
            f" reach it through hub_store({key[1]!r}, ...), the hub of its own region"
        )
    return key[0]


class MetricsHub:
    """Body of the detached actor `hub_actor_name(region)` (wrapped by ray.remote): one
    MetricsStore per store name (`metrics_actor_name(model, region)`), made on its first call.

    Each store saves its demand history to the file the model's own actor would use, so a model
    moving between a pool and its own actor keeps its history. Ray restarts a hub that died empty
    (`max_restarts`); its stores are made again by their next push, and take each router's first
    push as a baseline (`DemandHistory.adopt`) as a restarted model's actor does."""

    def __init__(
        self,
        region: str,
        demand_dir: str | None = None,
        save_seconds: float | None = None,
        *,
        reconstructed: bool | None = None,
    ) -> None:
        """`demand_dir` and `reconstructed` are for tests: without them the settings say where
        demand is saved (`settings_place`), and Ray whether this actor was restarted."""
        if not _REGION.fullmatch(region):
            raise ValueError(f"region {region!r} is not a region name: lower-case letters, digits and '-'")
        self._region = region
        self._demand_dir = Path(demand_dir) if demand_dir is not None else None
        self._save_seconds = save_seconds
        self._reconstructed = _was_reconstructed() if reconstructed is None else reconstructed
        self._stores: dict[str, MetricsStore] = {}
        if self._reconstructed:
            logger.info("metrics hub %s restarted: its stores adopt each router's next push", region)

    def call(self, store: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """What `MetricsStore.<method>(*args, **kwargs)` of that store returns."""
        if method not in STORE_METHODS:
            raise ValueError(
                f"method {method!r} is not a metrics store's: use one of {', '.join(STORE_METHODS)}"
            )
        return getattr(self._store(store), method)(*args, **kwargs)

    def push_many(self, process: str, pushes: dict[str, dict[str, Any]]) -> int:
        """One pool router's pushes for all its models at once (one call a second for any
        number of them, where a router of its own makes three): per store name, its router's
        `replica` key with its cumulative `counters` and `demand`, and the process's `series`
        for that store (absent: none yet). A bad entry is logged and skipped, never the rest.
        How many stores took their push."""
        taken = 0
        for store, push in pushes.items():
            try:
                replica = str(push["replica"])  # before the store is made: a bad push makes none
                held = self._store(store)
                held.push(replica, push.get("counters") or {})
                held.push_demand(replica, push.get("demand") or {})
                if push.get("series") is not None:
                    held.push_series(process, push["series"])
            except (ValueError, KeyError, TypeError) as err:
                logger.warning("metrics hub %s: push for %r refused: %s", self._region, store, err)
                continue
            taken += 1
        return taken

    def holds(self, store: str) -> bool:
        _store_model(store, self._region)
        return store in self._stores

    def stores(self) -> list[str]:
        return sorted(self._stores)

    def drop(self, store: str) -> bool:
        """Save the store's demand history and forget it (its model was deleted); False when
        not held. A push that comes after makes it anew."""
        _store_model(store, self._region)
        held = self._stores.get(store)
        if held is None:
            return False
        held.save_demand()
        del self._stores[store]
        return True

    def _store(self, store: str) -> MetricsStore:
        held = self._stores.get(store)
        if held is not None:
            return held
        model = _store_model(store, self._region)
        if self._demand_dir is not None:
            every = self._save_seconds if self._save_seconds is not None else DEMAND_SAVE_SECONDS
            place = DemandPlace(demand_file(self._demand_dir, model, self._region), every)
        else:
            place = settings_place(model, self._region, self._save_seconds)
        made = MetricsStore(place=place._replace(reconstructed=self._reconstructed))
        self._stores[store] = made
        return made


def _was_reconstructed() -> bool:
    """Whether this process is an actor that Ray restarted (False outside Ray, as in tests)."""
    import ray

    if not ray.is_initialized():
        return False
    context = ray.get_runtime_context()
    return context.get_actor_id() is not None and bool(context.was_current_actor_reconstructed)


class _StoreCall:
    """One method of a StoreRef: `.remote(*args)` as on an actor handle's method."""

    def __init__(self, ref: StoreRef, method: str) -> None:
        self._ref = ref
        self._method = method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """The ObjectRef of the call: await it, or `ray.get` it."""
        if self._ref.pooled:
            return self._ref.actor.call.remote(self._ref.store, self._method, *args, **kwargs)
        return getattr(self._ref.actor, self._method).remote(*args, **kwargs)


class _Forward:
    """A StoreRef attribute named after a MetricsStore method."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._method = name

    @overload
    def __get__(self, ref: None, owner: type) -> _Forward: ...
    @overload
    def __get__(self, ref: StoreRef, owner: type) -> _StoreCall: ...
    def __get__(self, ref: StoreRef | None, owner: type) -> _Forward | _StoreCall:
        return self if ref is None else _StoreCall(ref, self._method)


class StoreRef:
    """A metrics store as its readers and pushers use it: `ref.snapshot.remote()`,
    `ref.push.remote(replica, counters)` and the rest of STORE_METHODS, as on the handle of a
    model's own actor, which it wraps (`pooled` False), or forwarded to the hub that holds the
    store (`pooled` True). `store` is the store's name, the same for both."""

    push = _Forward()
    push_demand = _Forward()
    push_engine_stats = _Forward()
    push_series = _Forward()
    snapshot = _Forward()
    demand = _Forward()
    engine_stats = _Forward()
    series = _Forward()
    save_demand = _Forward()

    def __init__(self, store: str, actor: Any, *, pooled: bool) -> None:
        self.store = store
        self.actor = actor
        self.pooled = pooled

    def __repr__(self) -> str:
        return f"StoreRef({self.store!r}, pooled={self.pooled})"


def _hub_handle(region: str) -> Any:
    """The region's hub, created if it is not running."""
    import ray

    return (
        ray.remote(MetricsHub)
        .options(
            name=hub_actor_name(region),
            namespace=RAY_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=-1,
            # On the head node, as a model's own metrics actor (serving/export.py): the gates read
            # it and demand history lives in it, so it must not die with its region's nodes.
            **head_node_options(),
        )
        .remote(region)
    )


def _running(name: str) -> Any | None:
    """The named actor's handle, or None when none runs under that name."""
    import ray

    try:
        return ray.get_actor(name, namespace=RAY_NAMESPACE)
    except ValueError:
        return None


def hub_actor(region: str) -> Any:
    """The region's hub actor handle, created if it is not running (a pool router pushes all its
    models' figures to it at once: `MetricsHub.push_many`)."""
    return _hub_handle(region)


def hub_store(region: str, store: str) -> StoreRef:
    """The store of that name in the region's hub, the hub created if need be (the store is
    made by its first call). ValueError for a store name not of that region."""
    _store_model(store, region)
    return StoreRef(store, _hub_handle(region), pooled=True)


def find_stores(model: str, region: str) -> list[StoreRef]:
    """Every store holding figures of (model, region): the model's own actor, if it runs, then
    the region hub's store, if the hub runs and holds it. A model moving between a pool and its
    own actor has both for a while: callers merge them (their counters are keyed by set app, which
    differ). Raises Ray's error when the hub fails, or does not answer in HUB_ANSWER_TIMEOUT_S."""
    import ray

    name = metrics_actor_name(model, region)
    found: list[StoreRef] = []
    own = _running(name)
    if own is not None:
        found.append(StoreRef(name, own, pooled=False))
    hub = _running(hub_actor_name(region))
    if hub is not None and ray.get(hub.holds.remote(name), timeout=HUB_ANSWER_TIMEOUT_S):
        found.append(StoreRef(name, hub, pooled=True))
    return found


def drop_stores(model: str, region: str) -> int:
    """Forget every store of (model, region), its model deleted: kill its own actor (its demand
    as last saved stays on file) and drop the hub's store (saved first). How many there were."""
    import ray

    name = metrics_actor_name(model, region)
    dropped = 0
    own = _running(name)
    if own is not None:
        ray.kill(own)
        dropped += 1
    hub = _running(hub_actor_name(region))
    if hub is not None and ray.get(hub.drop.remote(name), timeout=HUB_ANSWER_TIMEOUT_S):
        dropped += 1
    return dropped
