"""Reconcile: Serve serves what the model's record says, whatever restarted in between.

`ModelWorkflow` (the system of record) runs `reconcile_serving` whenever it is idle with a
serving set: once right after each rollout, then every `serve.reconcile_seconds`. The activity
derives the model's whole desired serving state from the record (the serving set's apps on the
plan at full size, each router's weights, the routing document), compares it with what the
writer holds and what Serve lists, and pushes only what differs, through the one writer (which
stays Temporal-agnostic). So `ipnext dev down && ipnext dev up` on the same state, a Ray
restart or a lost writer is repaired within one interval, with no command from anyone.
Replica counts are the autoscaler's between replans: what is compared is each deployment's
autoscaling bounds as the plan renders them (its floor; the writer adds the burst ceiling),
never how many replicas run.

A running rollout checks its own serving the same way (`RolloutWorkflow`, at the start of each
bake, every interval of it, and when its counters vanish), with its own desired state in the
input: both sets at the sizes its steps gave them (`sets`) and every router as it last routed
it (`routers`). So Ray lost in
the middle of a rollout comes back with both sets and the split the rollout had, and the
rollout's bake then starts a fresh window.

Fencing: the model workflow never runs this while a rollout of the model runs (it runs one
thing at a time), and a rollout runs it between its own steps, so it never races a rollout's
weights. A router is never given a generation below the one it has or below the highest the
record saw applied; an unchanged router keeps its number (so "each step applied once" still
counts generations); a changed or lost one is applied at the next number above both.

Regions without a live Ray node are left alone: nothing can start there, and a router applied
there anew is a version none of whose replicas ever started, which Serve gives up on after a
few failed starts (`serving.app_health`); that router stayed UNHEALTHY after its region came
back. Their apps are checked again once a node of the region is alive. A router Serve gave up
on in a live region is applied again at the next generation, a new version Serve starts
afresh. A set app Serve gave up on is not redeployed here: only a rollout deploys a new set
version (the only kind Serve gives up on), and the rollout that waits on it sees the failure.

Leftovers: the model's own check (no `sets`: the model is idle, with no rollout and no
experiment) removes every set app of the model that the record does not name as serving, in
the live regions, once no router of the model routes to it as the writer holds them (a router
repaired in the same pass is still routing there, so the app goes at the next pass): a rollout
terminated from the Temporal UI (its cleanup never ran), or cancelled while removing its sets,
left them running. Another model's apps, and the model's routers, are never touched; a
rollout's own check removes nothing (the sets of its steps are its input).

Faults: Ray or the writer unreachable raises (the workflow retries a few times, records the
failed check and tries again next interval); a set app Serve cannot deploy raises with Serve's
message; a leftover whose removal fails is removed at a later check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field
from temporalio import activity

from ipnext.activities import _context
from ipnext.activities.serving import (
    APPS_RUNNING_TIMEOUT_S,
    pool_envelope,
    pool_fold,
    publish_routing,
    render_set,
)
from ipnext.activities.validate import as_application_error
from ipnext.contracts.plan import Plan
from ipnext.contracts.router import RouterConfig
from ipnext.errors import ServingError
from ipnext.names import Frozen
from ipnext.policy.rollout_steps import deploy_scale, serving_weights
from ipnext.serving.app_health import given_up
from ipnext.serving.layout import (
    ROUTING_APP,
    DeployedRouter,
    deployed_router,
    is_set_app_of,
    render_router_app,
    router_app_name,
    router_max_replicas,
    set_app_plan,
)
from ipnext.serving.pool_layout import is_placeholder, render_pooled_router, serving_apps
from ipnext.spec.model import ModelSpec, SnapshotSet
from ipnext.spec.settings import Settings

__all__ = ["ReconcileInput", "ReconcileResult", "SetTarget", "reconcile_serving"]


class SetTarget(Frozen):
    """A set's apps as a rollout sized them: part -> share of `plan`'s replicas (all 1: full)."""

    snapshot_set: SnapshotSet
    plan: Plan
    scales: dict[str, float] = Field(default_factory=dict)
    spec: ModelSpec | None = None  # the spec its apps run under (None: the input's)


class ReconcileInput(Frozen):
    spec: ModelSpec
    serving_set: SnapshotSet
    plan: Plan
    apps: dict[str, str]  # region -> set app serving (the record's serving_apps)
    generation_floor: int = 0  # the highest router generation the record saw applied
    # A running rollout's own check: its sets at their step's sizes and each router's config
    # as it last applied it (region -> config; its generation is that router's floor). Empty:
    # the serving set at full size, routers from `apps` (`serving_set`, `plan` and `apps` still
    # give the routing document).
    sets: list[SetTarget] = Field(default_factory=list)
    routers: dict[str, RouterConfig] = Field(default_factory=dict)


class ReconcileResult(Frozen):
    repaired: list[str]  # one line per app (or document) pushed again: what was wrong
    left_alone: list[str] = Field(default_factory=list)  # regions with no live Ray node: not checked
    generations: dict[str, int]  # region -> the router's generation now
    interval_seconds: float  # the worker's setting: when to check again
    idle_seconds: float | None = None  # an idle model's next own check, when not the above (pooled)


@activity.defn
@_context.heartbeat_throughout
def reconcile_serving(input: ReconcileInput) -> ReconcileResult:
    from ipnext.serving.control import (
        STATUS_TICK_S,
        live_regions,
        raise_if_failed,
        serve_applications,
        wait_apps_running,
        wait_served,
    )

    current = _context.settings()
    writer: Any = _context.writer()
    model = input.spec.name
    live = live_regions()
    # Serve's status from the worker's shared read (one per tick for every model's check: the
    # issue's "one status read per tick"); anything found to push is confirmed on a read begun
    # now, so a read a tick old never makes a repair of its own.
    found = _find_repairs(input, writer, current, serve_applications(max_age_s=STATUS_TICK_S), live)
    if found.upserts or found.leftovers:
        found = _find_repairs(input, writer, current, serve_applications(), live)
    repaired, upserts, held, routers = found.repaired, found.upserts, found.held, found.routers
    wanted_sets, wanted_routers, generations = found.wanted_sets, found.wanted_routers, found.generations
    if found.left_alone:
        activity.logger.info(
            "reconcile %s: left alone (no live Ray node): %s", model, ", ".join(found.left_alone)
        )
    if found.leftovers:
        activity.logger.warning(
            "reconcile %s: removing set apps the record does not know: %s", model, found.leftovers
        )
        _ray_get(writer.apply.remote([], found.leftovers))
        repaired.extend(
            f"{name}: not in the record (a rollout that did not clean up); removed"
            for name in found.leftovers
        )

    names = [app["name"] for app in upserts]
    if upserts:
        missing_only = all(_held_equal(app, held, routers) for app in upserts)
        if missing_only:  # the writer holds them all: Serve lost them
            _ray_get(writer.redeploy.remote(pool_envelope(current)))
        else:
            _ray_get(writer.apply.remote(upserts, [], pool_envelope(current), pool_fold(current)))
    try:
        if names:
            activity.logger.warning("reconcile %s: repairing %s", model, "; ".join(repaired))
            wait_served(writer, names, APPS_RUNNING_TIMEOUT_S, activity.heartbeat)
        checked = set(wanted_sets) | {router_app_name(model, r) for r in wanted_routers}
        pooled_apps: dict[str, list[str]] = _ray_get(writer.pooled.remote(sorted(checked)))
        serving = sorted({a for n in checked for a in pooled_apps.get(n, [n])})
        try:  # on the shared read; a failure it shows is confirmed on a fresh one
            raise_if_failed(serving, serve_applications(max_age_s=0.0 if names else STATUS_TICK_S))
        except ServingError:
            raise_if_failed(serving)
        # The routing document: published again when the writer holds none for the model (a new
        # writer after a Ray restart); the app deployed again when Serve lost it.
        before = _ray_get(writer.routing_generation.remote(model))
        if before is None:
            publish_routing(
                writer, model, input.plan, current.serve.routing_ttl_seconds, input.spec.generative()
            )
            repaired.append(f"routing document of {model}: lost (the writer holds none)")
        elif all(ROUTING_APP not in serve_applications(max_age_s=age) for age in (STATUS_TICK_S, 0.0)):
            _ray_get(writer.redeploy.remote())
            wait_apps_running([ROUTING_APP], APPS_RUNNING_TIMEOUT_S, activity.heartbeat)
            repaired.append(f"{ROUTING_APP}: missing in Serve")
    except ServingError as err:
        raise as_application_error(err) from None
    return ReconcileResult(
        repaired=repaired,
        left_alone=found.left_alone,
        generations=generations,
        interval_seconds=current.serve.reconcile_seconds,
        # A pooled model's own idle check is a safety net: the fleet's pool check watches its
        # pools at every tick and asks it to check at once when they lose anything.
        idle_seconds=current.serve.pools.model_check_seconds if input.spec.pooled() else None,
    )


@dataclass
class _Repairs:
    """What one pass over the writer's and Serve's state found to push again."""

    repaired: list[str]  # why, one line per app
    upserts: list[dict[str, Any]]  # the apps to push
    held: dict[str, dict[str, Any] | None]  # the wanted set apps as the writer holds them
    routers: dict[str, dict[str, Any] | None]  # the wanted routers as the writer holds them
    wanted_sets: dict[str, dict[str, Any]]
    wanted_routers: dict[str, RouterConfig]
    generations: dict[str, int]  # region -> the router's generation after the push
    left_alone: list[str]  # regions with no live node
    leftovers: list[str]  # set apps of the model the record does not know


def _find_repairs(
    input: ReconcileInput, writer: Any, current: Settings, listed: dict[str, Any], live: set[str]
) -> _Repairs:
    """Compare the record's desired serving with what the writer holds and Serve `listed`."""
    model = input.spec.name
    store = str(current.pinned_store())
    known = _ray_get(writer.app_names.remote())
    repaired: list[str] = []
    upserts: list[dict[str, Any]] = []

    # The serving set's apps at the plan's full size (a rollout's: both sets at their sizes),
    # in the regions with a live node.
    wanted_sets = (
        _rollout_sets(input, store, current, live)
        if input.sets
        else _serving_sets(input, store, current, live)
    )
    held = _ray_get(writer.app_configs.remote(sorted(wanted_sets)))
    listed = _listed_as(wanted_sets, listed)
    for name, app in wanted_sets.items():
        why = _drift(name, app, held[name], listed)
        if why:
            repaired.append(why)
            upserts.append(app)

    # Every router: its weights to the serving apps, at a generation never below what it had.
    every_router = input.routers or _serving_routers(input, known)
    left_alone = sorted({r for r in every_router if r not in live} | {r for r in input.apps if r not in live})
    wanted_routers = {r: c for r, c in every_router.items() if r in live}
    routers = _ray_get(writer.app_configs.remote([router_app_name(model, r) for r in wanted_routers]))
    pooled = input.spec.pooled()
    generations: dict[str, int] = {}
    for region, config in sorted(wanted_routers.items()):
        name = router_app_name(model, region)
        held_app = routers[name]
        had: DeployedRouter | None = deployed_router(held_app) if held_app is not None else None
        wanted = DeployedRouter(
            config=config.model_copy(update={"generation": 0}),
            max_ongoing_requests=input.spec.router.max_ongoing_requests,
            max_queued_requests=input.spec.router.max_queued_requests,
            router=input.spec.router,
            max_replicas=None
            if pooled
            else router_max_replicas(input.spec.router, current.serve.autoscaling),
        )
        if pooled:  # a pooled model's router is listed as its region's pool router
            listed = _listed_as(
                {name: render_pooled_router(model, region, config, input.spec.router)}, listed
            )
        floor = max(input.generation_floor, config.generation)
        generation = max(had.config.generation if had else 0, floor)
        same = (
            had is not None
            and had.model_copy(update={"config": had.config.model_copy(update={"generation": 0})}) == wanted
        )
        gave_up = given_up(listed[name]) if name in listed else None
        if same and name in listed and gave_up is None:
            generations[region] = generation
            continue
        if had is None:
            why = f"{name}: router lost (the writer holds none); applied at generation {generation}"
        elif not same:
            generation += 1
            why = (
                f"{name}: router weights {_routes(had.config)} differ from {_routes(config)}"
                if had.config.model_copy(update={"generation": 0}) != wanted.config
                else f"{name}: router options differ from the spec's router section"
            )
        elif gave_up is not None:
            generation += 1  # a new version: Serve starts its replicas afresh
            why = f"{name}: {gave_up}; applied again at generation {generation}"
        else:
            why = f"{name}: router missing in Serve"
        config = wanted.config.model_copy(update={"generation": generation})
        upserts.append(
            render_pooled_router(model, region, config, input.spec.router)
            if pooled
            else render_router_app(model, region, config, input.spec.router, current.serve.autoscaling)
        )
        generations[region] = generation
        repaired.append(why)

    # What the record does not know: set apps of the model beyond its serving ones (idle only),
    # in live regions, and only once no router routes to them as the writer holds it: a router
    # repaired in this pass still sends to them until its new config applies, so they go at a
    # later pass (make before break; removing both at once left requests on a vanished app until
    # their deadline).
    routed = {
        app
        for held_app in routers.values()
        if held_app is not None
        for app in deployed_router(held_app).config.apps()
    }
    leftovers = (
        []
        if input.sets
        else sorted(
            name
            for name in set(known) | set(listed)
            if is_set_app_of(name, model)
            and name not in wanted_sets
            and name not in input.apps.values()
            and name not in routed
            and name.removeprefix(f"{model}.").split(".")[0] in live
        )
    )
    return _Repairs(
        repaired=repaired,
        upserts=upserts,
        held=held,
        routers=routers,
        wanted_sets=wanted_sets,
        wanted_routers=wanted_routers,
        generations=generations,
        left_alone=left_alone,
        leftovers=leftovers,
    )


def _serving_sets(
    input: ReconcileInput,
    store: str,
    settings: Settings,
    live: set[str],
) -> dict[str, dict[str, Any]]:
    """An idle model's serving set in the `live` regions: its apps at the plan's full size,
    named as the record says."""
    apps: dict[str, dict[str, Any]] = {}
    for region, name in sorted(input.apps.items()):
        if region not in live:
            continue
        plan = set_app_plan(
            input.spec,
            input.serving_set,
            input.plan,
            region,
            store,
            factory_prefixes=settings.model_code.factory_prefixes,
        )
        app = render_set(plan, settings, input.spec.pooled())
        if app["name"] != name:
            raise as_application_error(
                ServingError(
                    f"model {input.spec.name}: the record says {name} serves {region}, but its set "
                    f"and plan render {app['name']}; the record and the plan disagree"
                ),
            )
        apps[name] = app
    return apps


def _rollout_sets(
    input: ReconcileInput,
    store: str,
    settings: Settings,
    live: set[str],
) -> dict[str, dict[str, Any]]:
    """A rollout's sets: each set's apps, in every `live` region of its plan, at its step's size."""
    apps: dict[str, dict[str, Any]] = {}
    for target in input.sets:
        spec = target.spec or input.spec
        parts = list(spec.parts)
        scale, shares = deploy_scale(target.scales or dict.fromkeys(parts, 1.0), parts)
        regions = sorted({r for p in target.plan.deployments.values() for r in p.regions()} & live)
        for region in regions:
            plan = set_app_plan(
                spec,
                target.snapshot_set,
                target.plan,
                region,
                store,
                scale,
                shares,
                factory_prefixes=settings.model_code.factory_prefixes,
            )
            app = render_set(plan, settings, spec.pooled())
            apps[app["name"]] = app
    return apps


def _serving_routers(input: ReconcileInput, known: list[str]) -> dict[str, RouterConfig]:
    """An idle model's routers: every region's router that exists (or that its plan needs) to
    the serving apps, all its traffic on the serving set."""
    model = input.spec.name
    regions = {n.split(".", 1)[1] for n in known if n.startswith(f"{model}.") and n.count(".") == 1}
    weights = serving_weights(input.plan, input.apps, regions)
    return {region: RouterConfig(generation=0, weights=w) for region, w in weights.items()}


def _routes(config: RouterConfig) -> str:
    parts = f", parts {config.parts}" if config.parts else ""
    return f"{config.weights}{parts}"


def _listed_as(apps: dict[str, dict[str, Any]], listed: dict[str, Any]) -> dict[str, Any]:
    """Serve's apps, with each pooled placeholder among `apps` listed as its pool router's
    status when Serve lists every app it is folded into (its pool router and pools)."""
    view = dict(listed)
    for name, app in apps.items():
        if is_placeholder(app):
            serving = serving_apps(app)
            if all(a in listed for a in serving):
                view[name] = listed[serving[0]]
    return view


def _drift(name: str, wanted: dict[str, Any], held: dict[str, Any] | None, listed: dict[str, Any]) -> str:
    """Why app `name` must be pushed again ('' when the writer holds it as wanted and Serve
    lists it)."""
    if held is None:
        return f"{name}: lost (the writer holds none)"
    if held != wanted:
        return f"{name}: its config differs from the record's"
    if name not in listed:
        return f"{name}: missing in Serve"
    return ""


def _held_equal(
    app: dict[str, Any], sets: dict[str, dict[str, Any] | None], routers: dict[str, dict[str, Any] | None]
) -> bool:
    return (sets.get(app["name"]) or routers.get(app["name"])) == app


def _ray_get(ref: Any) -> Any:
    import ray

    return ray.get(ref, timeout=120)
