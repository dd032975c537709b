"""Plan activity: a first placement of a model's parts into the fleet's pools."""

from __future__ import annotations

from temporalio import activity

from ipnext.activities import _context
from ipnext.activities.validate import as_application_error
from ipnext.contracts import Frozen
from ipnext.errors import IpnextError
from ipnext.model import ModelSpec
from ipnext.plan import Plan, PlanningProblem, demand_from_model
from ipnext.planner import solve

__all__ = ["PlanInput", "plan_placement"]


class PlanInput(Frozen):
    spec: ModelSpec
    current: Plan | None = None


@activity.defn
def plan_placement(input: PlanInput) -> Plan:
    problem = PlanningProblem(
        fleet=_context.settings().fleet(),
        deployments=demand_from_model(input.spec),
        current=input.current,
    )
    try:
        return solve(problem)
    except IpnextError as err:
        raise as_application_error(err) from None
