"""Serving activities: set apps up, router weights, apps down. Each applies a desired state
through the one Serve config writer and waits until Serve reports it, so retries are safe."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator
from temporalio import activity

from ipnext.activities import _context
from ipnext.activities.validate import as_application_error
from ipnext.contracts.counters import MetricsSnapshot
from ipnext.contracts.plan import Plan
from ipnext.contracts.router import ExperimentRoute, RouterConfig, ShadowRoute
from ipnext.contracts.routing import routing_document
from ipnext.errors import ServingError
from ipnext.names import Frozen
from ipnext.serving.layout import (
    ROUTING_APP,
    DeployedRouter,
    PoolEnvelope,
    SetAppPlan,
    render_router_app,
    render_set_app,
    router_app_name,
    router_max_replicas,
    set_app_plan,
)
from ipnext.serving.pool_layout import PoolFold, render_pooled_router, render_pooled_set
from ipnext.spec.model import DEFAULT_ROUTER_MAX_ONGOING, ModelSpec, RouterSpec, SnapshotSet
from ipnext.spec.settings import Settings
from ipnext.store.pinned import pinned_size

__all__ = [
    "DeploySetInput",
    "DeploySetResult",
    "ReadMetricsInput",
    "ReadMetricsResult",
    "RemoveAppsInput",
    "RouteInput",
    "RouteResult",
    "TeardownInput",
    "TeardownResult",
    "deploy_set_apps",
    "merge_snapshots",
    "pool_envelope",
    "pool_fold",
    "read_metrics",
    "remove_apps",
    "route_traffic",
    "teardown_model",
]

APPS_RUNNING_TIMEOUT_S = 240.0


class DeploySetInput(Frozen):
    spec: ModelSpec
    snapshot_set: SnapshotSet
    plan: Plan
    scale: float = Field(default=1.0, gt=0, le=1)  # share of the plan's replicas (a rollout step)
    part_scales: dict[str, float] = Field(default_factory=dict)  # part -> its own share (independent)
    # A set at full size publishes the model's routing for `plan`, unless False: an experiment's
    # arms moving to new apps switch their routers first, then publish (a second call).
    publish_routing: bool = True

    @model_validator(mode="after")
    def _known_parts(self) -> DeploySetInput:
        for part, share in self.part_scales.items():
            if part not in self.spec.parts:
                raise ValueError(f"part_scales: {part!r} is not a part of {self.spec.name}")
            if not 0 < share <= 1:
                raise ValueError(f"part_scales[{part!r}]: {share} is not in (0, 1]")
        return self


class DeploySetResult(Frozen):
    apps: dict[str, str]  # region -> set app


class RouteInput(Frozen):
    model: str
    weights: dict[str, dict[str, float]]  # region -> set app -> percent
    # Parts that roll on their own (sync: independent): region -> part -> set app -> percent,
    # and the part whose app each request is counted against (see RouterConfig).
    parts: dict[str, dict[str, dict[str, float]]] = Field(default_factory=dict)
    gated_part: str | None = None
    router_max_ongoing_requests: int = DEFAULT_ROUTER_MAX_ONGOING  # the spec's router.max_ongoing_requests
    # The spec's whole router section (deadline, queue, request limits); None in histories from
    # before it was passed: the defaults, with router_max_ongoing_requests.
    router: RouterSpec | None = None
    # The highest generation the caller saw applied: a router the writer lost (Ray restarted)
    # is applied above it, never below, so generations only ever go up.
    generation_floor: int = Field(default=0, ge=0)
    # A running experiment's route per region (ExperimentWorkflow); absent: none.
    experiments: dict[str, ExperimentRoute] = Field(default_factory=dict)
    # A running shadow's route per region (an ExperimentWorkflow in shadow mode); absent: none.
    shadows: dict[str, ShadowRoute] = Field(default_factory=dict)
    # The model is served from shared pools (`serving: pooled`): its router is its region's pool
    # router's (a placeholder the writer folds in), not an app of its own.
    pooled: bool = False


class RouteResult(Frozen):
    generations: dict[str, int]  # region -> generation now applied


class RemoveAppsInput(Frozen):
    names: list[str]
    # False for apps of a down region: Serve drops them once their node is dead, or at once.
    wait: bool = True
    # An ended experiment's (model, experiment): its feedback ledger is retired with its apps
    # (serving.feedback_actor; feedback is refused from now on, so nothing needs its ids).
    feedback_ledger: tuple[str, str] | None = None


class ReadMetricsInput(Frozen):
    model: str
    regions: list[str]


class ReadMetricsResult(Frozen):
    snapshots: dict[str, dict[str, Any]]  # region -> the metrics actor's snapshot (cumulative)


class TeardownInput(Frozen):
    model: str


class TeardownResult(Frozen):
    removed: list[str]


def _heartbeat(detail: str) -> None:
    activity.heartbeat(detail)


def pool_fold(settings: Settings) -> dict[str, Any]:
    """How the writer renders shared pools under the settings (`pool_layout.PoolFold`), passed
    with every apply, as the envelope is."""
    serve = settings.serve
    return PoolFold(
        pools=serve.pools,
        replica_num_cpus=settings.ray.replica_num_cpus,
        health_check=serve.part_health_check,
        autoscaling=serve.autoscaling,
        shutdown_wait_s=serve.shutdown_wait_s,
    ).model_dump(mode="json")


def pool_envelope(settings: Settings) -> dict[str, Any]:
    """The fleet's pools and the burst setting, as the writer bounds every deployment's burst
    by them (`layout.burst_bounds`); passed with every apply, so a fleet file changed under a
    running worker takes effect at its next one."""
    pools: dict[str, dict[str, int]] = {}
    for pool in settings.fleet().pools:
        pools.setdefault(pool.region, {})[pool.hardware] = pool.units
    return PoolEnvelope(pools=pools, burst=settings.serve.autoscaling.burst).model_dump(mode="json")


def render_set(plan: SetAppPlan, settings: Settings, pooled: bool = False) -> dict[str, Any]:
    """A set app's Serve config under the settings: replica CPUs, health check, autoscaling and
    shutdown wait; for a pooled model, its placeholder (the writer folds it into the pools).
    Deploys and the serving check render through it, so both render alike."""
    if pooled:
        sizes = {
            part: pinned_size(Path(host.pinned_store), host.sha256, host.checkpoint)
            for part, host in plan.args.parts.items()
        }
        return render_pooled_set(plan, sizes)
    serve = settings.serve
    return render_set_app(
        plan, settings.ray.replica_num_cpus, serve.part_health_check, serve.autoscaling, serve.shutdown_wait_s
    )


@activity.defn
@_context.heartbeat_throughout
def deploy_set_apps(input: DeploySetInput) -> DeploySetResult:
    from ipnext.serving.control import wait_served

    current = _context.settings()
    store = str(current.pinned_store())
    regions = sorted({r for p in input.plan.deployments.values() for r in p.regions()})
    plans = {
        r: set_app_plan(
            input.spec,
            input.snapshot_set,
            input.plan,
            r,
            store,
            input.scale,
            input.part_scales,
            factory_prefixes=current.model_code.factory_prefixes,
        )
        for r in regions
    }
    writer: Any = _context.writer()
    upserts = [render_set(p, current, input.spec.pooled()) for p in plans.values()]
    _ray_get(writer.apply.remote(upserts, [], pool_envelope(current), pool_fold(current)))
    try:
        wait_served(writer, [p.name for p in plans.values()], APPS_RUNNING_TIMEOUT_S, _heartbeat)
        # A set brought to its plan's full size carries the model on that plan (a first rollout,
        # a rollout's last step, a capacity move, the old set after a rollback): its routing is
        # the model's from now on. Partial sizes are steps on the way and publish nothing.
        full = input.scale == 1 and all(share == 1 for share in input.part_scales.values())
        if full and input.publish_routing:
            publish_routing(
                writer,
                input.spec.name,
                input.plan,
                current.serve.routing_ttl_seconds,
                input.spec.generative(),
            )
    except ServingError as err:
        raise as_application_error(err) from None
    return DeploySetResult(apps={r: p.name for r, p in plans.items()})


def publish_routing(
    writer: Any, model: str, plan: Plan, ttl_seconds: float, generative: bool = False
) -> None:
    """The model's routing document from `plan`, published by the writer (a new generation only
    if it changed) and waited for until the routing app serves it."""
    from ipnext.serving.control import wait_apps_running
    from ipnext.serving.routing_app import wait_routing_generation

    existed = ROUTING_APP in _ray_get(writer.app_names.remote())
    draft = routing_document(model, plan, ttl_seconds, generative=generative)
    generation = _ray_get(writer.publish_routing.remote(draft.model_dump(mode="json")))
    if not existed:  # the first document of the stack starts the app; later ones reconfigure it
        wait_apps_running([ROUTING_APP], APPS_RUNNING_TIMEOUT_S, _heartbeat)
    wait_routing_generation(model, generation, 60)


@activity.defn
@_context.heartbeat_throughout
def route_traffic(input: RouteInput) -> RouteResult:
    """Give each region's router the weights; a new generation only where they changed."""
    from ipnext.serving.control import wait_pooled_router_generation, wait_router_generation, wait_served

    writer: Any = _context.writer()
    autoscaling = _context.settings().serve.autoscaling
    generations: dict[str, int] = {}
    started: list[str] = []  # routers that did not exist: Serve starts them
    router = input.router or RouterSpec(max_ongoing_requests=input.router_max_ongoing_requests)
    upserts = []
    names = [router_app_name(input.model, region) for region in input.weights]
    held_pooled = _ray_get(writer.pooled.remote(names))
    for region, weights in sorted(input.weights.items()):
        name = router_app_name(input.model, region)
        current: DeployedRouter | None = _ray_get(writer.deployed_router.remote(name))
        parts = input.parts.get(region, {})
        generation = max(current.config.generation if current is not None else 0, input.generation_floor)
        # A router that did not exist, or that changes kind (a model moving between pooled and
        # dedicated: a router app of its own, or its pool router's), is waited for as an app.
        switching = current is not None and (name in held_pooled) != input.pooled
        if current is None or switching:
            started.append(name)
        wanted = DeployedRouter(
            config=RouterConfig(
                generation=generation,
                weights=weights,
                parts=parts,
                gated_part=input.gated_part if input.gated_part in parts else None,
                experiment=input.experiments.get(region),
                shadow=input.shadows.get(region),
            ),
            max_ongoing_requests=router.max_ongoing_requests,
            max_queued_requests=router.max_queued_requests,
            router=router,
            # A pooled model's router scales with its pool router, not on its own.
            max_replicas=None if input.pooled else router_max_replicas(router, autoscaling),
        )
        if wanted == current and not switching:
            generations[region] = generation
            continue
        config = wanted.config.model_copy(update={"generation": generation + 1})
        generations[region] = config.generation
        upserts.append(
            render_pooled_router(input.model, region, config, router)
            if input.pooled
            else render_router_app(input.model, region, config, router, autoscaling)
        )
    if upserts:
        _ray_get(writer.apply.remote(upserts, [], None, pool_fold(_context.settings())))
    try:
        # A running router takes new weights by `reconfigure`, in place: its generation says
        # when. Only a router Serve starts now is waited for as an app first.
        if started:
            wait_served(writer, started, APPS_RUNNING_TIMEOUT_S, _heartbeat)
        for region, generation in generations.items():
            if input.pooled:
                wait_pooled_router_generation(input.model, region, generation, 60)
            else:
                wait_router_generation(router_app_name(input.model, region), generation, 60)
    except ServingError as err:
        raise as_application_error(err) from None
    return RouteResult(generations=generations)


@activity.defn
def read_metrics(input: ReadMetricsInput) -> ReadMetricsResult:
    """The cumulative request counters of the model's routers, per region (empty where no
    router pushed yet); gates diff two of these."""
    from ipnext.serving.metrics_hub import find_stores

    _context.writer()  # connects this process to Ray
    snapshots: dict[str, dict[str, Any]] = {}
    for region in input.regions:
        # A model moving between pooled and dedicated has figures in both stores, under the
        # names of different set apps: their union is the model's.
        found = [_ray_get(store.snapshot.remote()) for store in find_stores(input.model, region)]
        snapshots[region] = merge_snapshots(found)
    return ReadMetricsResult(snapshots=snapshots)


@activity.defn
def remove_apps(input: RemoveAppsInput) -> None:
    from ipnext.serving.control import wait_apps_gone

    writer: Any = _context.writer()
    _ray_get(writer.apply.remote([], input.names))
    if input.wait:
        wait_apps_gone(input.names, APPS_RUNNING_TIMEOUT_S)
    if input.feedback_ledger is not None:
        from ipnext.serving.feedback_actor import retire_ledger

        retire_ledger(*input.feedback_ledger)


@activity.defn
def teardown_model(input: TeardownInput) -> TeardownResult:
    """Remove every app of the model (routers and sets; a pooled model's placeholders, so its
    pools drop its entries) and its metrics stores."""
    from ipnext.serving.control import wait_apps_gone
    from ipnext.serving.metrics_hub import drop_stores

    writer: Any = _context.writer()
    prefix = f"{input.model}."
    names = [n for n in _ray_get(writer.app_names.remote()) if n.startswith(prefix)]
    _ray_get(writer.withdraw_routing.remote(input.model))  # callers stop being sent here first
    _ray_get(writer.apply.remote([], names))
    wait_apps_gone(names, APPS_RUNNING_TIMEOUT_S)
    for region in _context.settings().fleet().regions:
        drop_stores(input.model, region)  # none there: the model never served in that region
    # Its observed demand goes with it: a model published again under the name starts afresh.
    shutil.rmtree(_context.settings().demand_store() / input.model, ignore_errors=True)
    return TeardownResult(removed=names)


def merge_snapshots(found: list[dict[str, Any]]) -> dict[str, Any]:
    """One snapshot of several stores' (`MetricsSnapshot`): their replicas side by side and each
    set app's counters summed; none: empty, as a model no router pushed for yet."""
    if len(found) <= 1:
        return found[0] if found else {"sets": {}}
    merged = MetricsSnapshot()
    for raw in found:
        snapshot = MetricsSnapshot.model_validate(raw)
        sets = dict(merged.sets)
        for app, counters in snapshot.sets.items():
            sets[app] = sets[app].plus(counters) if app in sets else counters
        merged = MetricsSnapshot(sets=sets, replicas={**merged.replicas, **snapshot.replicas})
    return merged.model_dump()


def _ray_get(ref: Any) -> Any:
    import ray

    return ray.get(ref, timeout=120)
