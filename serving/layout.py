"""Names and desired state of Serve apps, and the declarative config rendered from them.

Pure code (no Ray imports): the Serve config writer, the activities and the tests share it.
One file over 600 lines on purpose: every name and every Serve config ipnext writes comes from
here, so the writer, the deploys and the serving check can never render an app two ways.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field

from ipnext.contracts.plan import Plan
from ipnext.contracts.router import RouterConfig
from ipnext.contracts.routing import RoutingTable
from ipnext.names import Frozen
from ipnext.policy.gates import scaled_replicas
from ipnext.spec.model import (
    DEFAULT_PART_MAX_QUEUED,
    MAX_DEADLINE_SECONDS,
    BatchingSpec,
    ChoiceSpec,
    ModelSpec,
    RouterSpec,
    SnapshotSet,
)
from ipnext.spec.settings import DEFAULT_FACTORY_PREFIXES, AutoscalingSettings, PartHealthCheckSettings

__all__ = [
    "HEAD_NODE_RESOURCE",
    "POOL_IMPORT_PATH",
    "POOL_ROUTER_IMPORT_PATH",
    "PROXY_TIMEOUT_S",
    "ROUTER_DEPLOYMENT",
    "ROUTER_IMPORT_PATH",
    "ROUTING_APP",
    "ROUTING_DEPLOYMENT",
    "ROUTING_IMPORT_PATH",
    "SET_DEPLOYMENT",
    "SET_IMPORT_PATH",
    "DeployedRouter",
    "PartHostArgs",
    "PoolEnvelope",
    "RouterAppArgs",
    "SetAppArgs",
    "SetAppPlan",
    "SetDescription",
    "SetIngressConfig",
    "burst_bounds",
    "deployed_router",
    "deployed_routing",
    "head_node_options",
    "is_set_app_of",
    "metrics_actor_name",
    "part_deployment_name",
    "plan_bounds",
    "pool_usage",
    "render_router_app",
    "render_routing_app",
    "render_serve_config",
    "render_set_app",
    "router_app_name",
    "running_replicas",
    "set_app_name",
    "set_app_plan",
    "with_keys_file",
    "without_keys_file",
]

ROUTER_DEPLOYMENT = "router"
SET_DEPLOYMENT = "set"
RAY_NAMESPACE = "ipnext"
WRITER_ACTOR = "ipnext-serve-writer"
# The builders Serve imports by path (changing one restarts every app rendered with it).
SET_IMPORT_PATH = "ipnext.serving.set_app:set_app"
ROUTER_IMPORT_PATH = "ipnext.serving.router:router_app"
# The one global app of routing documents (GET /models/<name>/routing); not named after a model.
ROUTING_APP = "ipnext-routing"
ROUTING_DEPLOYMENT = "routing"
ROUTING_IMPORT_PATH = "ipnext.serving.routing_app:routing_app"
# A region's pool router, the door of every pooled model there, and a shared pool of one
# hardware class (pool_layout.py renders both).
POOL_ROUTER_IMPORT_PATH = "ipnext.serving.pool_router:pool_router_app"
POOL_IMPORT_PATH = "ipnext.serving.pool_app:pool_app"
# Serve's proxy gives up on a request after this long (its 408 comes after the router was
# cancelled, so nothing counts it): only a backstop, above every deadline a router enforces.
PROXY_TIMEOUT_S = MAX_DEADLINE_SECONDS + 30
# Ray gives this resource (1 unit) to the head node alone, on every cluster. What must outlive
# a lost region (the Serve config writer, the metrics actors, the routing app) asks for a sliver
# of it, so it runs on the head and never on a region's node; on a one-node stack, the same node.
HEAD_NODE_RESOURCE = "node:__internal_head__"
_HEAD_SHARE = 0.001
# A replica asks for a sliver of its region so it lands on a node of that region
# without the region count limiting how many replicas fit.
_REGION_SHARE = 0.001


def router_app_name(model: str, region: str) -> str:
    return f"{model}.{region}"


def set_app_name(model: str, region: str, set_number: int, revision: int) -> str:
    return f"{model}.{region}.s{set_number}.r{revision}"


def is_set_app_of(name: str, model: str) -> bool:
    """Whether app `name` is one of `model`'s set apps (`set_app_name`'s shape), not its router
    (`<model>.<region>`) nor another model's app."""
    rest = name.removeprefix(f"{model}.")
    fields = rest.split(".")
    return (
        rest != name
        and len(fields) == 3
        and fields[1][:1] == "s"
        and fields[1][1:].isdigit()
        and fields[2][:1] == "r"
        and fields[2][1:].isdigit()
    )


def metrics_actor_name(model: str, region: str) -> str:
    return f"ipnext-metrics/{model}/{region}"


def part_deployment_name(part: str, hardware: str) -> str:
    """The Serve deployment of one part on one hardware class, inside its set app."""
    return f"{part}-{hardware}"


class PartHostArgs(Frozen):
    model: str
    part: str
    factory: str
    config: dict[str, Any] = Field(default_factory=dict)
    uri: str
    sha256: str
    snapshot_id: str
    pinned_store: (
        str  # the replica loads `<pinned_store>/<sha256 path>` (ipnext/store/pinned.py), never `uri`
    )
    checkpoint: bool = False  # a checkpoint folder: sha256 names its pinned file list (CheckpointFiles)
    # Where a part that measures itself (its TTFT and ITL) pushes its histograms:
    # this region's metrics actor, this app.
    region: str = ""
    app: str = ""
    batching: BatchingSpec | None = None
    # The worker's `model_code.factory_prefixes`: the replica checks its factory against them
    # again before importing it (a Serve config can be written by more than the worker).
    factory_prefixes: list[str] = Field(default_factory=lambda: list(DEFAULT_FACTORY_PREFIXES), min_length=1)


class SetAppArgs(Frozen):
    """Fixed for the life of a set app: which (part, hardware) deployments it holds."""

    model: str
    region: str
    set_id: str
    dag: list[tuple[str, str]]
    order: list[str]
    parts: dict[str, PartHostArgs]
    hardware: dict[str, list[str]]  # part -> hardware classes with a deployment here
    # The DAG's choice nodes: they travel with the set, so routing follows the set a request runs on.
    choices: dict[str, ChoiceSpec] = Field(default_factory=dict)
    shard_groups: dict[str, list[str]] = Field(default_factory=dict)  # part -> its shard parts

    def describe(self, capacity: Mapping[str, float]) -> SetDescription:
        """What the set's ingress tells routers, given the capacity (QPS) per part deployment
        (a deployment missing from `capacity` counts as 1)."""
        return SetDescription(
            set_id=self.set_id,
            dag=self.dag,
            order=self.order,
            deployments={
                part: {
                    name: capacity.get(name, 1.0)
                    for name in (part_deployment_name(part, hw) for hw in hardware)
                }
                for part, hardware in self.hardware.items()
            },
            choices=self.choices,
            shard_groups=self.shard_groups,
        )


class SetIngressConfig(Frozen):
    """The set ingress's `user_config`: capacity per part deployment at the plan's replicas,
    which changes with them, so it reconfigures in place instead of restarting the app; and the
    QPS of one replica of each, by which the ingress follows the replicas Serve runs."""

    capacity: dict[str, float] = Field(default_factory=dict)  # part deployment -> QPS
    qps_per_replica: dict[str, float] = Field(default_factory=dict)  # part deployment -> QPS

    def running_capacity(self, running: Mapping[str, int]) -> dict[str, float]:
        """Capacity per part deployment from the replicas Serve runs (an autoscaled deployment
        runs more than the plan's); the plan's capacity where none is known to run."""
        return {
            name: running[name] * self.qps_per_replica[name]
            if running.get(name, 0) > 0 and name in self.qps_per_replica
            else planned
            for name, planned in self.capacity.items()
        }


class SetDescription(Frozen):
    """A set app as routers see it: its DAG, choice nodes and shard groups, and each part's
    deployments with their capacity, by which a router spreads that part's calls."""

    set_id: str
    dag: list[tuple[str, str]]
    order: list[str]
    deployments: dict[str, dict[str, float]]  # part -> part deployment -> capacity (QPS)
    choices: dict[str, ChoiceSpec] = Field(default_factory=dict)
    shard_groups: dict[str, list[str]] = Field(default_factory=dict)


class RouterAppArgs(Frozen):
    model: str
    region: str
    # The spec's router section: deadline and request limits. Rendered without its defaults, so
    # a model that changes none renders as before (no restart of its router).
    router: RouterSpec = Field(default_factory=RouterSpec)
    # The API keys file the router checks every request against (ipnext.store.keys.KeyCheck); set by
    # the writer from the settings when it renders the whole config (`with_keys_file`), None: open.
    keys_file: str | None = None


class DeployedRouter(Frozen):
    """A router app as the Serve config holds it: its routing, its concurrency cap and queue
    bound, and its request limits."""

    config: RouterConfig
    max_ongoing_requests: int | None = None
    max_queued_requests: int | None = None  # None: rendered before queues were bounded
    router: RouterSpec = Field(default_factory=RouterSpec)
    max_replicas: int | None = None  # autoscaled from 1 to this; None: one fixed replica (older)


class SetAppPlan(Frozen):
    """One set app as the writer should deploy it."""

    name: str
    args: SetAppArgs
    replicas: dict[str, dict[str, int]]  # part -> hardware -> replicas
    units: dict[str, dict[str, int]]  # part -> hardware -> units per replica
    qps: dict[str, dict[str, float]]  # part -> hardware -> QPS per replica
    max_queued: dict[str, int] = Field(default_factory=dict)  # part -> its calls waiting at a caller, at most
    # part -> hardware -> the QPS the plan sends it here at peak, headroom included: the peak
    # traffic of each source times the share the plan routes to this region, split over the
    # part's hardware classes by their capacity, times the step's scale (what sizes a pool).
    demand: dict[str, dict[str, float]] = Field(default_factory=dict)


def set_app_plan(
    spec: ModelSpec,
    snapshot_set: SnapshotSet,
    plan: Plan,
    region: str,
    pinned_store: str,
    scale: float = 1.0,
    part_scales: dict[str, float] | None = None,
    factory_prefixes: Sequence[str] = DEFAULT_FACTORY_PREFIXES,
) -> SetAppPlan:
    """The set app of `snapshot_set` in `region`, with the plan's replicas scaled to `scale`
    (a rollout step's share of the traffic; rounded up, so the plan's headroom holds), or to
    `part_scales[part]` for a part that rolls on its own."""
    replicas: dict[str, dict[str, int]] = {}
    for part in spec.parts:
        placement = plan.deployments[f"{spec.name}/{part}"]
        share = (part_scales or {}).get(part, scale)
        replicas[part] = {
            hw: scaled_replicas(n, share) for hw, n in placement.replicas.get(region, {}).items() if n > 0
        }
    name = set_app_name(spec.name, region, snapshot_set.number, plan.revision)
    args = SetAppArgs(
        model=spec.name,
        region=region,
        set_id=snapshot_set.id,
        dag=list(spec.dag),
        order=spec.topological_order(),
        parts={
            part: PartHostArgs(
                model=spec.name,
                part=part,
                factory=part_spec.factory,
                config=dict(part_spec.config),
                uri=snapshot_set.parts[part].uri,
                sha256=snapshot_set.parts[part].sha256,
                snapshot_id=snapshot_set.parts[part].snapshot_id,
                pinned_store=pinned_store,
                checkpoint=snapshot_set.parts[part].files is not None,
                region=region,
                app=name,
                batching=part_spec.batching,
                factory_prefixes=list(factory_prefixes),
            )
            for part, part_spec in spec.parts.items()
        },
        hardware={part: sorted(by_hw) for part, by_hw in replicas.items()},
        choices=dict(spec.choices),
        shard_groups=spec.shard_groups(),
    )
    return SetAppPlan(
        name=name,
        args=args,
        replicas=replicas,
        units={p: {hw: spec.parts[p].hardware[hw].units for hw in r} for p, r in replicas.items()},
        qps={p: {hw: spec.parts[p].hardware[hw].qps for hw in r} for p, r in replicas.items()},
        max_queued={p: spec.parts[p].max_queued_requests for p in replicas},
        demand={
            part: _part_demand(spec, plan, part, region, by_hw, (part_scales or {}).get(part, scale))
            for part, by_hw in replicas.items()
        },
    )


def _part_demand(
    spec: ModelSpec, plan: Plan, part: str, region: str, replicas: dict[str, int], scale: float
) -> dict[str, float]:
    """The QPS the plan sends `part` in `region` at peak, headroom included, per hardware class
    (split by the capacity the plan gives each)."""
    fractions = plan.deployments[f"{spec.name}/{part}"].fractions
    load = sum(
        qps * fractions.get(source, {}).get(region, 0.0) for source, qps in spec.traffic.peak_qps.items()
    )
    load *= (1.0 + spec.availability.headroom) * min(1.0, max(0.0, scale))
    capacity = {hw: n * spec.parts[part].hardware[hw].qps for hw, n in replicas.items()}
    total = sum(capacity.values())
    return {hw: load * c / total if total > 0 else 0.0 for hw, c in capacity.items()}


def head_node_options() -> dict[str, Any]:
    """Ray actor options that pin an actor to the head node (see HEAD_NODE_RESOURCE)."""
    return {"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: _HEAD_SHARE}}


def _actor_options(
    region: str, num_cpus: float, hardware: str | None = None, units: int = 0
) -> dict[str, Any]:
    resources = {f"region:{region}": _REGION_SHARE}
    if hardware:
        resources[f"hw:{hardware}"] = units
    return {"num_cpus": num_cpus, "resources": resources}


def render_set_app(
    app: SetAppPlan,
    replica_num_cpus: float,
    health_check: PartHealthCheckSettings | None = None,
    autoscaling: AutoscalingSettings | None = None,
    shutdown_wait_s: float | None = None,
) -> dict[str, Any]:
    """The set app's Serve config. Its part deployments carry the health check of the settings
    (`serve.part_health_check`; its defaults when None): Serve calls `PartHost.check_health`
    every period and replaces a replica after 3 failures in a row. Each scales on its own load
    (`serve.autoscaling`) from the app's replicas up: rendered here with `max_replicas` equal
    to them, the plan's bounds; the writer raises each to its share of the pool's unallocated
    units when it renders the whole config (`burst_bounds`). A replica told to stop waits
    `shutdown_wait_s` (`serve.shutdown_wait_s`; None: Serve's own) for requests on their way."""
    health_check = health_check or PartHealthCheckSettings()
    autoscaling = autoscaling or AutoscalingSettings()
    deployments: list[dict[str, Any]] = [
        {
            "name": SET_DEPLOYMENT,
            "num_replicas": 1,
            "ray_actor_options": _actor_options(app.args.region, 0),
            "user_config": SetIngressConfig(
                capacity={
                    part_deployment_name(part, hw): n * app.qps[part][hw]
                    for part, by_hw in app.replicas.items()
                    for hw, n in by_hw.items()
                },
                qps_per_replica={
                    part_deployment_name(part, hw): app.qps[part][hw]
                    for part, by_hw in app.replicas.items()
                    for hw in by_hw
                },
            ).model_dump(mode="json"),
        }
    ]
    for part, by_hw in sorted(app.replicas.items()):
        batching = app.args.parts[part].batching
        for hw, n in sorted(by_hw.items()):
            deployment: dict[str, Any] = {
                "name": part_deployment_name(part, hw),
                # Serve refuses num_replicas beside autoscaling_config: the plan's replicas are
                # the floor, a rollout step's share of them moves it.
                "autoscaling_config": _autoscaling_config(
                    n, n, autoscaling.target_ongoing_requests, autoscaling
                ),
                "ray_actor_options": _actor_options(
                    app.args.region, replica_num_cpus, hw, app.units[part][hw]
                ),
                "health_check_period_s": health_check.period_s,
                "health_check_timeout_s": health_check.timeout_s,
                # Bounded at each caller (Serve's handle raises BackPressureError beyond it; the
                # router answers 503): a part's queue never grows without bound behind a router.
                "max_queued_requests": app.max_queued.get(part, DEFAULT_PART_MAX_QUEUED),
            }
            if batching is not None:
                # A replica takes at most max_ongoing_requests at once (Serve's default is 5), so
                # a batch could never fill past it: room for one batch running and one filling.
                deployment["max_ongoing_requests"] = max(5, 2 * batching.max_batch_size)
            deployments.append(deployment)
    if shutdown_wait_s is not None:
        for deployment in deployments:
            deployment["graceful_shutdown_wait_loop_s"] = shutdown_wait_s
    return {
        "name": app.name,
        "route_prefix": None,
        "import_path": SET_IMPORT_PATH,
        # A model without choice nodes renders as it did before they existed.
        "args": app.args.model_dump(mode="json", exclude=_empty(app.args, "choices", "shard_groups")),
        "deployments": deployments,
    }


def _autoscaling_config(
    min_replicas: int, max_replicas: int, target: float, settings: AutoscalingSettings
) -> dict[str, Any]:
    return {
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "target_ongoing_requests": target,
        "upscale_delay_s": settings.upscale_delay_s,
        "downscale_delay_s": settings.downscale_delay_s,
        "look_back_period_s": settings.look_back_period_s,
        "metrics_interval_s": settings.metrics_interval_s,
    }


class PoolEnvelope(Frozen):
    """What the writer needs to bound every deployment's burst: each (region, hardware) pool's
    units (the fleet's) and the share of the units no plan takes that deployments may use."""

    pools: dict[str, dict[str, int]] = Field(default_factory=dict)  # region -> hardware -> units
    burst: float = Field(default=1.0, ge=0, le=1)


def _part_deployments(app: dict[str, Any]) -> list[tuple[str, str, dict[str, Any], int]]:
    """The part deployments of a rendered set app, or the deployment of a shared pool: (region,
    hardware, deployment, units per replica); none for apps of other kinds."""
    if app.get("import_path") not in (SET_IMPORT_PATH, POOL_IMPORT_PATH):
        return []
    region = str((app.get("args") or {}).get("region", ""))
    found = []
    for deployment in app.get("deployments") or []:
        resources = (deployment.get("ray_actor_options") or {}).get("resources") or {}
        for key, units in resources.items():
            if key.startswith("hw:"):
                found.append((region, key[3:], deployment, int(units)))
    return found


def _floor_replicas(deployment: dict[str, Any]) -> int:
    """The replicas a deployment's plan gives it: its autoscaling floor, or its fixed count."""
    scaling = deployment.get("autoscaling_config")
    if scaling is not None:
        return int(scaling.get("min_replicas", 1))
    return int(deployment.get("num_replicas", 1))


def pool_usage(
    apps: Mapping[str, dict[str, Any]],
    skip_model: str | None = None,
    running: Mapping[str, Mapping[str, int]] | None = None,
) -> dict[tuple[str, str], int]:
    """Units per (region, hardware) pool that the plans of the rendered set apps take (their
    replica floors x units per replica), leaving out the apps of `skip_model`; with `running`
    (app -> deployment -> replicas Serve runs), what the running replicas take instead."""
    used: dict[tuple[str, str], int] = {}
    for name, app in apps.items():
        if skip_model is not None and (app.get("args") or {}).get("model") == skip_model:
            continue
        for region, hardware, deployment, units in _part_deployments(app):
            replicas = (
                _floor_replicas(deployment)
                if running is None
                else running.get(name, {}).get(deployment["name"], 0)
            )
            used[(region, hardware)] = used.get((region, hardware), 0) + replicas * units
    return used


def burst_bounds(
    apps: Mapping[str, dict[str, Any]], envelope: PoolEnvelope | None
) -> dict[str, dict[str, Any]]:
    """The apps with each autoscaled part deployment's `max_replicas` raised from its floor by
    its share of `envelope.burst` x its pool's unallocated units (pool units minus every
    floor in it), the share being its floor's part of the pool's floors. Rounded down, so the
    maxima of a pool never sum past its units; a pool the plans already fill (or one the
    envelope does not name) leaves every maximum at its floor."""
    pools = envelope.pools if envelope is not None else {}
    used = pool_usage(apps)
    spare = {
        key: max(0, pools.get(key[0], {}).get(key[1], 0) - taken) * (envelope.burst if envelope else 0)
        for key, taken in used.items()
    }
    bounded = copy.deepcopy(dict(apps))
    for app in bounded.values():
        for region, hardware, deployment, units in _part_deployments(app):
            scaling = deployment.get("autoscaling_config")
            if scaling is None or units <= 0:
                continue
            floor = int(scaling["min_replicas"])
            taken = used[(region, hardware)]
            share = floor * units / taken if taken else 0.0
            scaling["max_replicas"] = max(
                1, floor + math.floor(share * spare[(region, hardware)] / units + 1e-9)
            )
    return bounded


def plan_bounds(app: dict[str, Any]) -> dict[str, Any]:
    """A set app as `render_set_app` renders it from the bounded one Serve holds (its part
    deployments' maxima back at their floors), so a writer that adopts Serve's apps compares
    them with what the record renders."""
    plain = copy.deepcopy(app)
    for _, _, deployment, _ in _part_deployments(plain):
        scaling = deployment.get("autoscaling_config")
        if scaling is not None:
            scaling["max_replicas"] = max(1, int(scaling["min_replicas"]))
    return plain


def running_replicas(replica_states: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """Replicas RUNNING per deployment, from Serve's status (deployment -> state -> count)."""
    return {name: int(states.get("RUNNING", 0)) for name, states in replica_states.items()}


def _empty(args: SetAppArgs, *fields: str) -> set[str] | None:
    """Fields left out of the rendered args when empty, so models that do not use them render
    the same config as before they existed (no restart of their set apps)."""
    return {f for f in fields if not getattr(args, f)} or None


def render_router_app(
    model: str,
    region: str,
    config: RouterConfig,
    router: RouterSpec,
    autoscaling: AutoscalingSettings | None = None,
) -> dict[str, Any]:
    """The router app: its replicas scale with its requests from 1 to `router_max_replicas`,
    each aiming at half its `max_ongoing_requests`."""
    autoscaling = autoscaling or AutoscalingSettings()
    args = RouterAppArgs(model=model, region=region, router=router)
    return {
        "name": router_app_name(model, region),
        "route_prefix": f"/{region}/models/{model}",
        "import_path": ROUTER_IMPORT_PATH,
        "args": args.model_dump(mode="json", exclude_defaults=True),
        "deployments": [
            {
                "name": ROUTER_DEPLOYMENT,
                # A router only awaits: it scales on requests held, well before its cap.
                "autoscaling_config": _autoscaling_config(
                    1,
                    router_max_replicas(router, autoscaling),
                    max(1.0, router.max_ongoing_requests / 2),
                    autoscaling,
                ),
                "max_ongoing_requests": router.max_ongoing_requests,  # see RouterSpec
                # Beyond the queue Serve's proxy refuses at once: 503 and Retry-After, never an
                # unbounded wait (and never counted against a set: the router never saw it).
                "max_queued_requests": router.max_queued_requests,
                "backpressure_config": {"status_code": 503, "retry_after_s": router.retry_after_seconds},
                "ray_actor_options": _actor_options(region, 0),
                # parts and gated_part only when a part rolls on its own (sync: independent)
                "user_config": config.model_dump(mode="json", exclude_defaults=True),
            }
        ],
    }


def router_max_replicas(router: RouterSpec, autoscaling: AutoscalingSettings) -> int:
    """A model's router replicas per region at most: its spec's, else the platform's setting."""
    return router.max_replicas or autoscaling.router_max_replicas


def deployed_router(app: dict[str, Any]) -> DeployedRouter:
    """The router fields of an app rendered by `render_router_app` (or adopted from Serve)."""
    [router] = app["deployments"]  # a router app holds the one router deployment
    scaling = router.get("autoscaling_config")
    return DeployedRouter(
        config=RouterConfig.model_validate(router["user_config"]),
        max_ongoing_requests=router.get("max_ongoing_requests"),
        max_queued_requests=router.get("max_queued_requests"),
        router=RouterAppArgs.model_validate(app["args"]).router,
        max_replicas=int(scaling["max_replicas"]) if scaling is not None else None,
    )


def render_routing_app(table: RoutingTable) -> dict[str, Any]:
    """The routing app: every model's routing document rides in its `user_config`, so a change
    reconfigures it in place. Global: its replica asks for no region, and runs on the head node,
    so clients find their fallback regions while any region is lost."""
    return {
        "name": ROUTING_APP,
        "route_prefix": "/",  # what no router's longer prefix claims: routing documents, OpenAI's /v1
        "import_path": ROUTING_IMPORT_PATH,
        "args": {},
        "deployments": [
            {
                "name": ROUTING_DEPLOYMENT,
                "num_replicas": 1,
                "ray_actor_options": head_node_options(),
                "user_config": table.model_dump(mode="json"),
            }
        ],
    }


def _is_door(app: dict[str, Any]) -> bool:
    """An app that answers HTTP with ipnext's own code: a model's router, a region's pool router
    (every pooled model's), the routing app."""
    return app.get("import_path") in (ROUTER_IMPORT_PATH, POOL_ROUTER_IMPORT_PATH, ROUTING_IMPORT_PATH)


def with_keys_file(apps: dict[str, dict[str, Any]], keys_file: str | None) -> dict[str, dict[str, Any]]:
    """The apps with every HTTP door (routers, the routing app) told the API keys file it checks
    requests against; unchanged when `keys_file` is None (auth off). The writer adds it to what
    it deploys, so no record or activity carries a path of the serving machines."""
    if keys_file is None:
        return apps
    return {
        name: {**app, "args": {**app.get("args", {}), "keys_file": keys_file}} if _is_door(app) else app
        for name, app in apps.items()
    }


def without_keys_file(app: dict[str, Any]) -> dict[str, Any]:
    """An app as Serve holds it, back to how a record renders it (`with_keys_file` undone)."""
    if not _is_door(app) or "keys_file" not in app.get("args", {}):
        return app
    return {**app, "args": {k: v for k, v in app["args"].items() if k != "keys_file"}}


def deployed_routing(app: dict[str, Any] | None) -> RoutingTable:
    """The documents of an app rendered by `render_routing_app` (or adopted from Serve); none
    when there is no routing app yet."""
    if app is None:
        return RoutingTable()
    [deployment] = app["deployments"]
    return RoutingTable.model_validate(deployment.get("user_config") or {})


def render_serve_config(
    apps: dict[str, dict[str, Any]], host: str, port: int, proxy_location: str = "HeadOnly"
) -> dict[str, Any]:
    """The whole multi-app config, in the schema `serve deploy` and KubeRay's RayService take.
    `proxy_location`: `HeadOnly`, or `EveryNode` on a cluster of one node per region (each
    node's proxy binds the same host and port; see Settings.proxy_location)."""
    return {
        "proxy_location": proxy_location,
        "http_options": {"host": host, "port": port, "request_timeout_s": PROXY_TIMEOUT_S},
        "logging_config": {"enable_access_log": False},
        "applications": [apps[name] for name in sorted(apps)],
    }
