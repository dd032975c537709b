"""Names and desired state of shared pools: per (region, hardware class) one Serve app whose
replicas hold many models' parts, each part an entry of the pool's catalogue; per region one
pool router app that routes every pooled model of the region.

Pure code (no Ray imports), like `layout.py`. A pooled model's apps are rendered as for a
dedicated one, under the same names (`<model>.<region>` and `<model>.<region>.s<n>.r<k>`), but as
*placeholders* (`render_pooled_set`, `render_pooled_router`) that the config writer holds and
never hands to Serve: when it renders the whole config it folds them into the pool apps and
the pool routers (`fold_pools`), and a restarted writer gets them back from the pool routers'
configs (`unfold_pools`). So the lifecycle (deploys, weights, rollbacks, removals) addresses a
pooled model's sets and router exactly as a dedicated model's, and one config change per pool
carries any number of models.

A pool app is one `pool` deployment (`serving/pool_app.py`); which parts it may serve rides in
its `user_config` (`PoolCatalogue`), so adding or removing a set reconfigures the pool's replicas
in place instead of restarting them. A request names its entry with Serve's multiplexed model
id (`handle.options(multiplexed_model_id=pool_entry_id(set_app, part))`), so Serve routes it to
a replica that holds the part when one does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from ipnext.contracts.router import RouterConfig
from ipnext.names import Frozen
from ipnext.policy.pool_cache import PartKey
from ipnext.serving.layout import (
    POOL_IMPORT_PATH,
    POOL_ROUTER_IMPORT_PATH,
    ROUTER_DEPLOYMENT,
    ROUTER_IMPORT_PATH,
    PartHostArgs,
    RouterAppArgs,
    SetAppArgs,
    SetAppPlan,
    SetDescription,
    part_deployment_name,
    router_app_name,
)
from ipnext.spec.model import RouterSpec
from ipnext.spec.settings import AutoscalingSettings, PartHealthCheckSettings, PoolSettings

__all__ = [
    "POOLED_ROUTER",
    "POOLED_SET",
    "POOL_DEPLOYMENT",
    "POOL_IMPORT_PATH",
    "POOL_ROUTER_IMPORT_PATH",
    "PoolAppArgs",
    "PoolCatalogue",
    "PoolEntry",
    "PoolFold",
    "PoolRouterArgs",
    "PoolRouterConfig",
    "PoolSize",
    "PooledRouter",
    "PooledSet",
    "fold_pools",
    "is_placeholder",
    "is_pool_app",
    "pool_app_name",
    "pool_app_region",
    "pool_entries",
    "pool_entry_id",
    "pool_router_app_name",
    "pool_size",
    "pooled_model",
    "pooled_units",
    "render_pool_app",
    "render_pooled_router",
    "render_pooled_set",
    "serving_apps",
    "unfold_pools",
]

POOL_DEPLOYMENT = "pool"
# The import paths of placeholders: held by the writer, folded into pools, never given to Serve.
POOLED_SET = "ipnext:pooled-set"
POOLED_ROUTER = "ipnext:pooled-router"
_POOL_PREFIX = "ipnext-pool"
_POOL_ROUTER_PREFIX = "ipnext-pooled"
# As layout._REGION_SHARE: a replica lands on its region's node without the region count limiting.
_REGION_SHARE = 0.001
# A pool router takes at most this many requests at once whatever its models' caps add up to.
_POOL_ROUTER_MAX_ONGOING = 10_000


def pool_app_name(region: str, hardware: str) -> str:
    """The pool of `hardware` in `region`. Three dotted fields: never a router app's name
    (`<model>.<region>`, two) nor a set app's (`<model>.<region>.s<n>.r<k>`, four)."""
    return f"{_POOL_PREFIX}.{region}.{hardware}"


def is_pool_app(name: str) -> bool:
    return name.startswith(f"{_POOL_PREFIX}.") and name.count(".") == 2


def pool_router_app_name(region: str) -> str:
    """The router of every pooled model of `region` (three fields, another prefix than pools)."""
    return f"{_POOL_ROUTER_PREFIX}.{region}.router"


def is_pool_router_app(name: str) -> bool:
    return name.startswith(f"{_POOL_ROUTER_PREFIX}.") and name.endswith(".router") and name.count(".") == 2


def pool_app_region(name: str) -> str:
    """The region of a pool app or a pool router app (its second dotted field)."""
    return name.split(".")[1]


def pool_entry_id(set_app: str, part: str) -> str:
    """One part of one set app in a pool: the multiplexed model id its requests carry."""
    return f"{set_app}/{part}"


def pooled_model(path: str, region: str) -> str | None:
    """The model a request to a pool router is for: the segment after `/<region>/models/`
    (Serve hands the whole path), or the first one (were the route prefix stripped)."""
    mount = f"/{region}/models/"
    rest = path[len(mount) :] if path.startswith(mount) else path.lstrip("/")
    model = rest.split("/", 1)[0]
    return model or None


class PoolEntry(Frozen):
    """A part a pool may serve: how to build it, as a dedicated replica would. It reserves
    `estimate_bytes` while it loads; 0: its pinned file's size, which the replica reads."""

    host: PartHostArgs
    estimate_bytes: int = Field(default=0, ge=0)

    @property
    def key(self) -> PartKey:
        """What the pool loads, evicts and quarantines: entries of one snapshot's part (a set
        replanned into a new revision, or a part no rollout changed) share one loaded copy."""
        return PartKey(self.host.model, self.host.part, self.host.snapshot_id)


class PoolCatalogue(Frozen):
    """The pool deployment's `user_config`: every entry its replicas may serve, by entry id
    (`pool_entry_id`)."""

    entries: dict[str, PoolEntry] = Field(default_factory=dict)


class PoolAppArgs(Frozen):
    """Fixed for the life of a pool app: where it runs and how its replicas hold parts."""

    region: str
    hardware: str
    pools: PoolSettings = Field(default_factory=PoolSettings)


class PooledSet(Frozen):
    """A pooled model's set app as its placeholder holds it: its args as a dedicated set app
    would get them; the plan's replicas, units and QPS per replica per part and hardware class;
    the QPS the plan sends each part here (`demand`, headroom included) and each part's pinned
    file size (`bytes`): what sizes its pools (`pool_size`)."""

    args: SetAppArgs
    replicas: dict[str, dict[str, int]]
    units: dict[str, dict[str, int]]
    qps: dict[str, dict[str, float]]
    demand: dict[str, dict[str, float]] = Field(default_factory=dict)
    bytes: dict[str, int] = Field(default_factory=dict)

    def describe(self) -> SetDescription:
        """The set as a router sees it; each part's capacity is the plan's (its replicas times
        their QPS): a pool's replicas are shared, so what runs now says nothing of one set."""
        return self.args.describe(
            {
                part_deployment_name(part, hw): n * self.qps[part][hw]
                for part, by_hw in self.replicas.items()
                for hw, n in by_hw.items()
            }
        )


class PooledRouter(Frozen):
    """A pooled model's router in one region: its spec's router section and its routing."""

    router: RouterSpec = Field(default_factory=RouterSpec)
    config: RouterConfig


class PoolRouterArgs(Frozen):
    region: str
    keys_file: str | None = None  # as RouterAppArgs: set by the writer (`layout.with_keys_file`)


class PoolRouterConfig(Frozen):
    """The pool router's `user_config`: every pooled model's router and set in its region, by
    the names the placeholders have (so `unfold_pools` gives them back exactly)."""

    routers: dict[str, PooledRouter] = Field(default_factory=dict)  # model -> its router
    sets: dict[str, PooledSet] = Field(default_factory=dict)  # set app name -> the set


class PoolFold(Frozen):
    """What the writer renders pools with: the settings' pool, replica and router sections."""

    pools: PoolSettings = Field(default_factory=PoolSettings)
    replica_num_cpus: float = 0
    health_check: PartHealthCheckSettings = Field(default_factory=PartHealthCheckSettings)
    autoscaling: AutoscalingSettings = Field(default_factory=AutoscalingSettings)
    shutdown_wait_s: float | None = None


def render_pooled_set(app: SetAppPlan, part_bytes: Mapping[str, int] | None = None) -> dict[str, Any]:
    """A pooled model's set app as the writer holds it: a placeholder under the set app's name.
    `part_bytes`: each part's pinned file size (what it takes of a pool replica's budget)."""
    pooled = PooledSet(
        args=app.args,
        replicas=app.replicas,
        units=app.units,
        qps=app.qps,
        demand=app.demand,
        bytes=dict(part_bytes or {}),
    )
    return {"name": app.name, "import_path": POOLED_SET, "args": pooled.model_dump(mode="json")}


def render_pooled_router(model: str, region: str, config: RouterConfig, router: RouterSpec) -> dict[str, Any]:
    """A pooled model's router as the writer holds it: a placeholder under the router app's
    name, shaped as a router app so `layout.deployed_router` reads it (without autoscaling:
    the pool router scales for all its models)."""
    return {
        "name": router_app_name(model, region),
        "import_path": POOLED_ROUTER,
        "args": RouterAppArgs(model=model, region=region, router=router).model_dump(
            mode="json", exclude_defaults=True
        ),
        "deployments": [
            {
                "name": ROUTER_DEPLOYMENT,
                "max_ongoing_requests": router.max_ongoing_requests,
                "max_queued_requests": router.max_queued_requests,
                "user_config": config.model_dump(mode="json", exclude_defaults=True),
            }
        ],
    }


def is_placeholder(app: Mapping[str, Any]) -> bool:
    return app.get("import_path") in (POOLED_SET, POOLED_ROUTER)


def serving_apps(placeholder: Mapping[str, Any]) -> list[str]:
    """The Serve apps a placeholder is folded into: its region's pool router first, then (for
    a set) the pool of each hardware class its parts use."""
    if placeholder.get("import_path") == POOLED_ROUTER:
        return [pool_router_app_name(RouterAppArgs.model_validate(placeholder["args"]).region)]
    pooled = PooledSet.model_validate(placeholder["args"])
    region = pooled.args.region
    hardware = sorted({hw for by_hw in pooled.replicas.values() for hw in by_hw})
    return [pool_router_app_name(region), *(pool_app_name(region, hw) for hw in hardware)]


def pool_entries(set_app: str, args: SetAppArgs, hardware: str) -> dict[str, PoolEntry]:
    """The entries set app `set_app` puts into the pool of `hardware` in its region: each of its
    parts served on that hardware class."""
    return {
        pool_entry_id(set_app, part): PoolEntry(host=args.parts[part])
        for part, classes in sorted(args.hardware.items())
        if hardware in classes
    }


def fold_pools(apps: Mapping[str, dict[str, Any]], fold: PoolFold) -> dict[str, dict[str, Any]]:
    """The apps Serve gets: every placeholder folded into its region's pool router and into the
    pool app of each hardware class its parts use; every other app as it is. Deterministic
    (sorted), so the same placeholders render the same config and reconfigure nothing."""
    real = {name: app for name, app in apps.items() if not is_placeholder(app)}
    routers: dict[str, PoolRouterConfig] = {}
    for name, app in sorted(apps.items()):
        if app.get("import_path") == POOLED_SET:
            pooled = PooledSet.model_validate(app["args"])
            config = routers.setdefault(pooled.args.region, PoolRouterConfig())
            routers[pooled.args.region] = config.model_copy(update={"sets": {**config.sets, name: pooled}})
        elif app.get("import_path") == POOLED_ROUTER:
            args = RouterAppArgs.model_validate(app["args"])
            [deployment] = app["deployments"]
            router = PooledRouter(
                router=args.router, config=RouterConfig.model_validate(deployment["user_config"])
            )
            config = routers.setdefault(args.region, PoolRouterConfig())
            routers[args.region] = config.model_copy(
                update={"routers": {**config.routers, args.model: router}}
            )
    for region, config in sorted(routers.items()):
        config = _keep_routing_moved(config, region, real)
        real[pool_router_app_name(region)] = _render_pool_router(region, config, fold)
        for hardware, (catalogue, size) in sorted(_catalogues(config, fold.pools.budget_bytes).items()):
            pool = PoolAppArgs(region=region, hardware=hardware, pools=fold.pools)
            real[pool_app_name(region, hardware)] = render_pool_app(
                pool,
                catalogue,
                size.replicas,
                size.units,
                fold.replica_num_cpus,
                fold.health_check,
                fold.shutdown_wait_s,
                fold.autoscaling,
            )
    return real


def _keep_routing_moved(config: PoolRouterConfig, region: str, real: Mapping[str, Any]) -> PoolRouterConfig:
    """Make before break for a model moving from pooled to dedicated: its router became an app
    of its own, which Serve starts only now, while its old pooled set is still held. The pool
    router keeps routing it, by the new router's weights (a pool router reaches dedicated sets
    too), until the old set goes; the new router's longer route prefix takes its requests once
    it runs. Without this the pool router would drop it at once, and answer 404 until then."""
    moving = {pooled.args.model for pooled in config.sets.values()} - set(config.routers)
    routers = dict(config.routers)
    for model in sorted(moving):
        app = real.get(router_app_name(model, region))
        if app is None or app.get("import_path") != ROUTER_IMPORT_PATH:
            continue
        args = RouterAppArgs.model_validate(app.get("args") or {})
        router = next(d for d in app["deployments"] if d["name"] == ROUTER_DEPLOYMENT)
        routers[model] = PooledRouter(
            router=args.router, config=RouterConfig.model_validate(router.get("user_config") or {})
        )
    return config if routers == config.routers else config.model_copy(update={"routers": routers})


def pooled_units(apps: Mapping[str, dict[str, Any]]) -> dict[tuple[str, str], int]:
    """Units per (region, hardware) that the pools folded from these apps' placeholders take
    (their replicas times units per replica): what dedicated models' plans must leave them."""
    folded = fold_pools({n: a for n, a in apps.items() if is_placeholder(a)}, PoolFold())
    used: dict[tuple[str, str], int] = {}
    for app in folded.values():
        if app.get("import_path") != POOL_IMPORT_PATH:
            continue
        args = PoolAppArgs.model_validate(app["args"])
        [deployment] = app["deployments"]
        units = int(deployment["ray_actor_options"]["resources"][f"hw:{args.hardware}"])
        key = (args.region, args.hardware)
        used[key] = used.get(key, 0) + int(deployment["autoscaling_config"]["min_replicas"]) * units
    return used


class PoolSize(Frozen):
    """How many replicas a pool of one region and hardware class runs, and why: the most of
    what its parts' plans give them one by one (a part planned on 2 replicas for availability
    keeps 2), what their summed demand takes at their QPS per replica, and what their pinned
    bytes take of the replicas' budget (so every part can stay resident)."""

    replicas: int
    units: int  # per replica: the most any of its parts asks
    by_plan: int
    by_demand: int
    by_memory: int


def pool_size(sets: Mapping[str, PooledSet], hardware: str, budget_bytes: int) -> PoolSize:
    """The size of the pool of `hardware` holding the parts of `sets` (set app name -> set)."""
    by_plan, units, load, held = 1, 0, 0.0, 0
    for pooled in sets.values():
        for part, by_hw in pooled.replicas.items():
            if hardware not in by_hw:
                continue
            by_plan = max(by_plan, by_hw[hardware])
            units = max(units, pooled.units[part][hardware])
            qps = pooled.qps[part][hardware]
            load += pooled.demand.get(part, {}).get(hardware, 0.0) / qps if qps > 0 else 0.0
            held += pooled.bytes.get(part, 0)
    by_demand = math.ceil(load - 1e-9)
    by_memory = math.ceil(held / budget_bytes) if budget_bytes > 0 else 0
    return PoolSize(
        replicas=max(by_plan, by_demand, by_memory),
        units=units,
        by_plan=by_plan,
        by_demand=by_demand,
        by_memory=by_memory,
    )


def _catalogues(config: PoolRouterConfig, budget_bytes: int) -> dict[str, tuple[PoolCatalogue, PoolSize]]:
    """Per hardware class of one region: its pool's catalogue and size (`pool_size`)."""
    entries: dict[str, dict[str, PoolEntry]] = {}
    for name, pooled in sorted(config.sets.items()):
        for by_hw in pooled.replicas.values():
            for hw in by_hw:
                entries.setdefault(hw, {}).update(pool_entries(name, pooled.args, hw))
    return {
        hw: (PoolCatalogue(entries=found), pool_size(config.sets, hw, budget_bytes))
        for hw, found in entries.items()
    }


def _render_pool_router(region: str, config: PoolRouterConfig, fold: PoolFold) -> dict[str, Any]:
    """The region's pool router: its route prefix takes `/<region>/models/<model>` for every
    pooled model (a dedicated model's router has the longer prefix, which Serve matches first)."""
    scaling = fold.autoscaling
    caps = sum(r.router.max_ongoing_requests for r in config.routers.values()) or 1
    ongoing = min(_POOL_ROUTER_MAX_ONGOING, caps)
    return {
        "name": pool_router_app_name(region),
        "route_prefix": f"/{region}/models",
        "import_path": POOL_ROUTER_IMPORT_PATH,
        "args": PoolRouterArgs(region=region).model_dump(mode="json", exclude_defaults=True),
        "deployments": [
            {
                "name": ROUTER_DEPLOYMENT,
                "autoscaling_config": {
                    "min_replicas": 1,
                    "max_replicas": scaling.router_max_replicas,
                    "target_ongoing_requests": max(1.0, ongoing / 2),
                    "upscale_delay_s": scaling.upscale_delay_s,
                    "downscale_delay_s": scaling.downscale_delay_s,
                    "look_back_period_s": scaling.look_back_period_s,
                    "metrics_interval_s": scaling.metrics_interval_s,
                },
                "max_ongoing_requests": ongoing,
                "ray_actor_options": {"num_cpus": 0, "resources": {f"region:{region}": _REGION_SHARE}},
                "user_config": config.model_dump(mode="json"),
            }
        ],
    }


def unfold_pools(apps: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The placeholders and other apps the writer holds, from the apps Serve runs (a restarted
    writer adopts them): each pool router's config gives its placeholders back; pool apps,
    derived from them, are left out."""
    held: dict[str, dict[str, Any]] = {}
    for name, app in apps.items():
        if app.get("import_path") == POOL_IMPORT_PATH:
            continue
        if app.get("import_path") != POOL_ROUTER_IMPORT_PATH:
            held[name] = app
            continue
        region = PoolRouterArgs.model_validate(app.get("args") or {}).region
        [deployment] = app["deployments"]
        config = PoolRouterConfig.model_validate(deployment.get("user_config") or {})
        for model, pooled in config.routers.items():
            name = router_app_name(model, region)
            if name in apps:  # a router of its own, kept in the pool router for a move
                continue
            held[name] = render_pooled_router(model, region, pooled.config, pooled.router)
        for set_name, pooled_set in config.sets.items():
            held[set_name] = {
                "name": set_name,
                "import_path": POOLED_SET,
                "args": pooled_set.model_dump(mode="json"),
            }
    return held


def render_pool_app(
    args: PoolAppArgs,
    catalogue: PoolCatalogue,
    replicas: int,
    units: int,
    replica_num_cpus: float,
    health_check: PartHealthCheckSettings | None = None,
    shutdown_wait_s: float | None = None,
    autoscaling: AutoscalingSettings | None = None,
) -> dict[str, Any]:
    """The pool app's Serve config: the pool deployment from `replicas` replicas up, each
    taking `units` of its hardware class, its catalogue as `user_config`. It scales on its
    requests (`serve.autoscaling`, aiming at half a replica's `max_ongoing_requests`) inside the
    plan's envelope: rendered with `max_replicas` at its floor, raised by the writer to its
    share of the pool's unallocated units (`layout.burst_bounds`), as a part deployment is.
    Serve calls `PoolHost.check_health`, which checks each loaded part and quarantines a failing
    one instead of failing the replica, so one model's part never restarts its pool-mates."""
    if replicas < 1 or units < 0:
        where = f"pool {args.region}/{args.hardware}"
        raise ValueError(f"{where}: replicas {replicas}, units {units}; give replicas >= 1, units >= 0")
    health_check = health_check or PartHealthCheckSettings()
    scaling = autoscaling or AutoscalingSettings()
    deployment: dict[str, Any] = {
        "name": POOL_DEPLOYMENT,
        # Serve refuses num_replicas beside autoscaling_config: the pool's size is the floor.
        "autoscaling_config": {
            "min_replicas": replicas,
            "max_replicas": replicas,
            "target_ongoing_requests": max(1.0, args.pools.max_ongoing_requests / 2),
            "upscale_delay_s": scaling.upscale_delay_s,
            "downscale_delay_s": scaling.downscale_delay_s,
            "look_back_period_s": scaling.look_back_period_s,
            "metrics_interval_s": scaling.metrics_interval_s,
        },
        "max_ongoing_requests": args.pools.max_ongoing_requests,
        "ray_actor_options": {
            "num_cpus": replica_num_cpus,
            "resources": {f"region:{args.region}": _REGION_SHARE, f"hw:{args.hardware}": units},
        },
        "health_check_period_s": health_check.period_s,
        "health_check_timeout_s": health_check.timeout_s,
        "user_config": catalogue.model_dump(mode="json"),
    }
    if shutdown_wait_s is not None:
        deployment["graceful_shutdown_wait_loop_s"] = shutdown_wait_s
    return {
        "name": pool_app_name(args.region, args.hardware),
        "route_prefix": None,
        "import_path": POOL_IMPORT_PATH,
        "args": args.model_dump(mode="json", exclude_defaults=True),
        "deployments": [deployment],
    }
