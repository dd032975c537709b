"""Region activities of FleetWorkflow: read the fleet's regions and Ray's node table, send a down
region's callers elsewhere through the routing documents, and stop a scheduled replan that a
region change made stale. Decisions are in `ipnext.policy.regions` and `ipnext.contracts.routing`."""

from __future__ import annotations

from typing import Any

from pydantic import Field
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from ipnext.activities import _context
from ipnext.activities.fleet import FleetActivities
from ipnext.contracts.fleet import NodeSighting, RegionsCheckInput, RegionsCheckResult
from ipnext.contracts.plan import demand_from_model
from ipnext.contracts.routing import RoutingDocument, failover_routes, routes_from_plan
from ipnext.names import REPLAN_WORKFLOW_ID, Frozen

__all__ = [
    "CancelReplanResult",
    "RegionActivities",
    "RouteAroundInput",
    "RouteAroundResult",
    "check_regions",
]

REGION_PREFIX = "region:"


@activity.defn
def check_regions(input: RegionsCheckInput) -> RegionsCheckResult:
    """The fleet file's regions and, when asked, Ray's node table: each node, alive or dead, and
    the regions its resources name. Ray not answering is reported, not raised: the workflow
    judges nothing from a table it could not read, and asks again next interval."""
    settings = _context.settings()
    regions = list(settings.fleet().regions)
    if not input.look_at_nodes:
        return RegionsCheckResult(regions=regions)
    try:
        import ray

        from ipnext.serving.control import connect

        connect(settings.ray_address())
        table = ray.nodes()
    except Exception as err:  # Ray down or unreachable: no judgement this time
        return RegionsCheckResult(regions=regions, error=f"Ray's node table could not be read: {err}")
    nodes = [
        NodeSighting(
            node_id=str(row.get("NodeID", "")),
            alive=bool(row.get("Alive", False)),
            regions=sorted(
                key[len(REGION_PREFIX) :]
                for key in (row.get("Resources") or {})
                if key.startswith(REGION_PREFIX)
            ),
        )
        for row in table
    ]
    return RegionsCheckResult(regions=regions, nodes=nodes)


class RouteAroundInput(Frozen):
    down: list[str]  # empty: every model back on its plan's routing


class RouteAroundResult(Frozen):
    published: dict[str, int] = Field(default_factory=dict)  # model -> routing generation now served
    skipped: dict[str, str] = Field(default_factory=dict)  # model -> why it was left alone


class CancelReplanResult(Frozen):
    cancelled: str = ""  # the run id asked to cancel, "" when none ran


class RegionActivities:
    """Activities that read the registry through the worker's Temporal client."""

    def __init__(self, client: Client) -> None:
        self._client = client

    @activity.defn
    async def route_around_regions(self, input: RouteAroundInput) -> RouteAroundResult:
        """Each serving model's routing document from its plan, with the down regions' callers
        sent to surviving regions (`routing.failover_routes`); published where it changed. A
        model with no document published (nothing serves) is left alone. Idempotent: the
        workflow calls it on every change and at every check while a region is down, so a
        document republished from the plan meanwhile (a rollout's last step) is put right."""
        import asyncio

        from ipnext.serving.routing_app import wait_routing_generation

        settings = _context.settings()
        fleet = settings.fleet()
        collected = await FleetActivities(self._client).collect_models()
        writer: Any = await asyncio.to_thread(_context.writer)
        published: dict[str, int] = {}
        skipped: dict[str, str] = {}
        for entry in collected.models:
            model = entry.spec.name
            if entry.plan is None:
                skipped[model] = "no plan"
                continue
            generation = await asyncio.to_thread(_ray_get, writer.routing_generation.remote(model))
            if generation is None:
                skipped[model] = "no routing document published"
                continue
            routes = failover_routes(
                routes_from_plan(model, entry.plan),
                entry.plan,
                demand_from_model(entry.spec),
                fleet,
                input.down,
            )
            draft = RoutingDocument(
                model=model,
                generation=1,
                ttl_seconds=settings.serve.routing_ttl_seconds,
                routes=routes,
                plan_revision=entry.plan.revision,
                generative=entry.spec.generative(),
            )
            published[model] = await asyncio.to_thread(
                _ray_get, writer.publish_routing.remote(draft.model_dump(mode="json"))
            )
            if published[model] != generation:
                await asyncio.to_thread(wait_routing_generation, model, published[model], 60)
        return RouteAroundResult(published=published, skipped=skipped)

    @activity.defn
    async def cancel_scheduled_replan(self) -> CancelReplanResult:
        """Ask the Schedule's replan run in flight, if any, to cancel: it planned with regions that
        have since changed, and the emergency replan plans for them now."""
        handle = self._client.get_workflow_handle(REPLAN_WORKFLOW_ID)
        try:
            described = await handle.describe()
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                return CancelReplanResult()
            raise
        if described.status != WorkflowExecutionStatus.RUNNING:
            return CancelReplanResult()
        await self._client.get_workflow_handle(REPLAN_WORKFLOW_ID, run_id=described.run_id).cancel()
        return CancelReplanResult(cancelled=described.run_id)


def _ray_get(ref: Any) -> Any:
    import ray

    return ray.get(ref, timeout=60)
