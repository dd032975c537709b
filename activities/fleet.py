"""Fleet replanning activities: read every model's demand and plan from the registry and its
observed demand from the metrics actors, solve the whole fleet at once, store the plan, and
split it back into per-model plans."""

from __future__ import annotations

import time

from pydantic import Field
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from ipnext.activities import _context
from ipnext.activities.validate import as_application_error
from ipnext.contracts.fleet import DemandSizing, FleetStatus
from ipnext.contracts.model import ModelState
from ipnext.contracts.plan import (
    Plan,
    PlanningProblem,
    SolveOptions,
    demand_from_model,
    merge_plans,
    placement_revision,
    plan_moves,
)
from ipnext.errors import InfeasiblePlanError, IpnextError
from ipnext.names import (
    FLEET_WORKFLOW_ID,
    FleetWorkflowNames,
    Frozen,
    ModelStatus,
    ModelWorkflowNames,
    Workflows,
)
from ipnext.planner import solve
from ipnext.policy.demand import DemandReport, declared_only, model_demand, plan_demand
from ipnext.policy.regions import Relaxation, lost_region_problems
from ipnext.spec.demand_file import DeploymentDemand
from ipnext.spec.model import ModelSpec
from ipnext.store.plans import PlanStore, StoredPlan, now

__all__ = [
    "CollectResult",
    "FleetActivities",
    "ModelEntry",
    "ReadDemandInput",
    "ReadDemandResult",
    "SolveFleetInput",
    "SolveFleetResult",
    "read_observed_demand",
    "solve_fleet_plan",
    "solve_without",
]

# How long one metrics actor may take to answer its demand report.
DEMAND_READ_TIMEOUT_S = 20.0

# Moves listed in the workflow's result; the stored plan has all of them.
MOVES_SHOWN = 200


class ModelEntry(Frozen):
    spec: ModelSpec
    plan: Plan | None


class CollectResult(Frozen):
    models: list[ModelEntry]
    down_regions: list[str] = Field(default_factory=list)  # held down by the `fleet` workflow


class ReadDemandInput(Frozen):
    declared: dict[str, dict[str, float]]  # model -> its traffic.peak_qps
    interval_s: float | None = None  # the peak is over the windows since then; None: all kept


class ReadDemandResult(Frozen):
    demand: dict[str, DemandSizing]  # model -> what the replan plans each source for


class SolveFleetInput(Frozen):
    models: list[ModelEntry]
    time_limit_s: float
    churn_cost: float
    made_by: str
    down_regions: list[str] = Field(default_factory=list)  # planned without their pools
    # From `read_observed_demand`; a model missing here is planned for its declared demand,
    # with `demand_note` saying why (observed demand could not be read).
    demand: dict[str, DemandSizing] = Field(default_factory=dict)
    demand_note: str = "observed demand not read"


class SolveFleetResult(Frozen):
    revision: int
    cost: float
    objective: float
    lower_bound: float | None
    gap: float | None
    status: str
    solve_seconds: float | None
    moved_units: int
    moves: list[str]  # the first MOVES_SHOWN, readable
    moves_total: int
    changed: dict[str, Plan] = Field(default_factory=dict)  # model -> its new plan, where it changed
    plan_file: str
    relaxed: list[str] = Field(default_factory=list)  # constraints relaxed for the down regions
    demand: dict[str, DemandSizing] = Field(default_factory=dict)  # model -> what it was planned for


class FleetActivities:
    """Activities that read the registry through the worker's Temporal client."""

    def __init__(self, client: Client) -> None:
        self._client = client

    @activity.defn
    async def collect_models(self) -> CollectResult:
        """Every live model's spec and current plan (models being deleted are left out)."""
        entries = []
        query = f"WorkflowType = '{Workflows.MODEL}' AND ExecutionStatus = 'Running'"
        async for execution in self._client.list_workflows(query):
            handle = self._client.get_workflow_handle(execution.id)
            state: ModelState = await handle.query(ModelWorkflowNames.GET, result_type=ModelState)
            if state.state != ModelStatus.DELETING:
                entries.append(ModelEntry(spec=state.spec, plan=state.plan))
        entries.sort(key=lambda e: e.spec.name)
        return CollectResult(models=entries, down_regions=await self._down_regions())

    async def _down_regions(self) -> list[str]:
        """The regions the `fleet` workflow holds down (none when it does not run: a closed run's
        query would wait for a worker to replay it)."""
        handle = self._client.get_workflow_handle(FLEET_WORKFLOW_ID)
        try:
            described = await handle.describe()
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                return []
            raise
        if described.status != WorkflowExecutionStatus.RUNNING:
            return []
        status: FleetStatus = await handle.query(FleetWorkflowNames.REGIONS, result_type=FleetStatus)
        return status.down


@activity.defn
def read_observed_demand(input: ReadDemandInput) -> ReadDemandResult:
    """Each model's observed demand, summed over the fleet's regions from their metrics actors,
    weighed against its declared demand (`ipnext.policy.demand.plan_demand`, with the `demand`
    settings). A region without an actor never served the model: nothing observed there. An
    actor that does not answer leaves that model on its declared demand, said in its note (one
    dead actor must not hold the whole fleet's replan)."""
    import ray

    from ipnext.serving.metrics_hub import find_stores

    settings = _context.settings()
    regions = list(settings.fleet().regions)
    window = settings.demand.window_seconds
    _context.writer()  # connects this process to Ray
    stamp = time.time()
    since = stamp - input.interval_s if input.interval_s is not None else None
    answer: dict[str, DemandSizing] = {}
    for model, declared in sorted(input.declared.items()):
        reports: dict[str, DemandReport] = {}
        failed = []
        for region in regions:
            try:
                stores = find_stores(model, region)
                if not stores:
                    continue  # no metrics store: the model never served in that region
                # Its own store first: a model moving into a pool has its demand history there.
                raw = ray.get(stores[0].demand.remote(window), timeout=DEMAND_READ_TIMEOUT_S)
            except (ray.exceptions.RayError, TimeoutError) as err:
                failed.append(f"{region}: {type(err).__name__}")
                continue
            reports[region] = DemandReport.model_validate(raw)
        if failed:
            note = f"observed demand unreadable ({', '.join(failed)}): declared demand planned"
            answer[model] = declared_only(declared, note)
            activity.logger.warning("%s: %s", model, note)
            continue
        observed = (
            model_demand(model, declared, reports, time.time(), window, since=since) if reports else None
        )
        answer[model] = plan_demand(
            declared, observed, settings.demand.margin, settings.demand.min_history_seconds, regions
        )
    return ReadDemandResult(demand=answer)


@activity.defn
def solve_fleet_plan(input: SolveFleetInput) -> SolveFleetResult:
    """Solve every model's parts together against the current plans, store the plan, and
    return the per-model plans that changed. Each model is planned for what
    `read_observed_demand` decided per source, else for its declared demand."""
    started = now()
    settings = _context.settings()
    fleet = settings.fleet()
    sizing = {
        m.spec.name: input.demand.get(m.spec.name)
        or declared_only(dict(m.spec.traffic.peak_qps), input.demand_note)
        for m in input.models
    }
    deployments: list[DeploymentDemand] = [
        d for m in input.models for d in demand_from_model(m.spec, sizing[m.spec.name].demand_qps())
    ]
    current = merge_plans([m.plan for m in input.models if m.plan is not None])
    problem = PlanningProblem(fleet=fleet, deployments=deployments, current=current)
    activity.logger.info(
        "replanning %d models (%d deployments) in %.0f s",
        len(input.models),
        len(deployments),
        input.time_limit_s,
    )
    try:
        plan, problem, relaxed = solve_without(
            problem,
            input.down_regions,
            SolveOptions(time_limit_s=input.time_limit_s, churn_cost=input.churn_cost),
        )
    except IpnextError as err:
        raise as_application_error(err) from None
    store = PlanStore(settings.state_dir)
    revision = store.claim_revision()
    plan = plan.model_copy(update={"revision": revision})
    moves = plan_moves(current, plan)
    path = store.save(
        StoredPlan(
            revision=revision,
            created_at=now(),
            made_by=input.made_by,
            models=[m.spec.name for m in input.models],
            moves=moves,
            plan=plan.to_report(),
            pools=list(fleet.pools),
            units={d.name: {h: o.units for h, o in d.hardware.items()} for d in deployments},
            down_regions=sorted(input.down_regions),
            relaxed=relaxed,
            solve_started_at=started,
            demand=sizing,
        )
    )
    return SolveFleetResult(
        revision=revision,
        cost=plan.cost,
        objective=plan.objective if plan.objective is not None else plan.cost,
        lower_bound=plan.lower_bound,
        gap=plan.gap,
        status=plan.status,
        solve_seconds=plan.solve_seconds,
        moved_units=plan.moved_units,
        moves=[str(m) for m in moves[:MOVES_SHOWN]],
        moves_total=len(moves),
        changed=_changed_models(input.models, plan, problem),
        plan_file=path.name,
        relaxed=[str(r) for r in relaxed],
        demand=sizing,
    )


def solve_without(
    problem: PlanningProblem, down: list[str], options: SolveOptions
) -> tuple[Plan, PlanningProblem, list[Relaxation]]:
    """Solve `problem`, or with `down` regions lost: the fleet without their pools, relaxing
    constraints step by step until the surviving regions can meet them (`lost_region_problems`).
    Returns the plan, the problem it solved and what it relaxed."""
    if not down:
        return solve(problem, options), problem, []
    attempts = lost_region_problems(problem, down)
    for i, attempt in enumerate(attempts):
        try:
            return solve(attempt.problem, options), attempt.problem, attempt.relaxed
        except InfeasiblePlanError as err:
            if i == len(attempts) - 1:
                raise
            activity.logger.info("without %s: %s; relaxing further", down, err)
    raise InfeasiblePlanError(
        f"no problem to solve without {down}"
    )  # lost_region_problems returns one at least


def _changed_models(models: list[ModelEntry], plan: Plan, problem: PlanningProblem) -> dict[str, Plan]:
    """Each model's share of the fleet plan, for the models whose placement or routing changed."""
    unit_cost = {(p.region, p.hardware): p.unit_cost for p in problem.fleet.pools}
    units = {d.name: {h: o.units for h, o in d.hardware.items()} for d in problem.deployments}
    changed = {}
    for entry in models:
        prefix = f"{entry.spec.name}/"
        mine = {n: p for n, p in plan.deployments.items() if n.startswith(prefix)}
        old = entry.plan.deployments if entry.plan else {}
        if mine == old:
            continue
        cost = sum(
            n * units[name][hw] * unit_cost[region, hw]
            for name, placement in mine.items()
            for region, by_hw in placement.replicas.items()
            for hw, n in by_hw.items()
        )
        changed[entry.spec.name] = Plan(
            deployments=mine,
            cost=round(cost, 6),
            moved_units=sum(
                max(0, m.after - m.before) * units[m.deployment][m.hardware]
                for m in plan_moves(entry.plan, Plan(deployments=mine, cost=cost, solver=plan.solver))
            ),
            solver=plan.solver,
            revision=placement_revision(entry.plan, mine),
            lower_bound_method=f"share of fleet plan revision {plan.revision}",
            status=plan.status,
        )
    return changed
