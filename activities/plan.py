"""Plan activity: a first placement of a model's parts into the fleet's pools, solved against
what the pools have left after every other model's plan (their serving sets as the Serve
config writer holds them)."""

from __future__ import annotations

from typing import Any

from temporalio import activity

from ipnext.activities import _context
from ipnext.activities.validate import as_application_error
from ipnext.contracts.plan import Plan, PlanningProblem, demand_from_model
from ipnext.errors import InfeasiblePlanError, IpnextError
from ipnext.names import Frozen
from ipnext.planner import solve
from ipnext.spec.fleet import Fleet
from ipnext.spec.model import ModelSpec

__all__ = ["PlanInput", "plan_placement", "residual_fleet"]


class PlanInput(Frozen):
    spec: ModelSpec
    current: Plan | None = None


def residual_fleet(fleet: Fleet, used: dict[tuple[str, str], int]) -> Fleet:
    """The fleet with each pool's units less what other models' plans take (`used`: (region,
    hardware) -> units); a pool they fill is left out. None left: InfeasiblePlanError."""
    pools = [
        pool.model_copy(update={"units": pool.units - used.get((pool.region, pool.hardware), 0)})
        for pool in fleet.pools
        if pool.units > used.get((pool.region, pool.hardware), 0)
    ]
    if not pools:
        raise InfeasiblePlanError(
            "every pool of the fleet is taken by other models' plans: no units left to place a new model",
            field="pools",
            fix="add units to the fleet file, or delete a model that no longer serves",
        )
    return fleet.model_copy(update={"pools": pools})


@activity.defn
def plan_placement(input: PlanInput) -> Plan:
    settings = _context.settings()
    try:
        fleet = residual_fleet(settings.fleet(), _used_by_others(input.spec.name, not input.spec.pooled()))
        return solve(
            PlanningProblem(fleet=fleet, deployments=demand_from_model(input.spec), current=input.current)
        )
    except IpnextError as err:
        raise as_application_error(err) from None


def _used_by_others(model: str, count_pools: bool = True) -> dict[tuple[str, str], int]:
    """Units per pool that the other models' serving sets take at their plans' replicas. The
    writer holds every set app of every model as their records render them, so it knows each
    model's plan as it serves now (a rolling model: both sets at their step's shares). With
    `count_pools` (a dedicated model), the shared pools' replicas count too; a pooled model is
    planned against what dedicated models leave, since its parts share the pools' replicas."""
    import ray

    from ipnext.serving.layout import pool_usage
    from ipnext.serving.pool_layout import pooled_units

    writer: Any = _context.writer()
    names = ray.get(writer.app_names.remote(), timeout=60)
    apps = {n: a for n, a in ray.get(writer.app_configs.remote(names), timeout=60).items() if a is not None}
    used = pool_usage(apps, skip_model=model)
    if count_pools:
        for key, units in pooled_units(apps).items():
            used[key] = used.get(key, 0) + units
    return used
