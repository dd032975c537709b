"""FleetReplanWorkflow: replan every model of the fleet at once, on a Schedule.

It reads every live model's demand and current plan from the registry, weighs each model's
declared demand against what its callers sent (observed demand, from the metrics actors),
solves the whole fleet (the pure planner, in an activity), stores the plan, and signals each
model whose placement changed; the ModelWorkflow applies it as a capacity-only
transition, make before break. The result (and the run's details in the Temporal UI)
carry the plan's figures, its moves and the demand it planned; `ipnext plan show` reads the
stored plan. Regions held down (the input's, and those the `fleet` workflow holds) are planned
without, relaxing what their loss forces; the result says which constraints it relaxed.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, FailureError

with workflow.unsafe.imports_passed_through():
    from ipnext.activities import QUICK_TIMEOUT, RECONCILE_RETRY, RETRY
    from ipnext.activities.fleet import (
        FleetActivities,
        ReadDemandInput,
        SolveFleetInput,
        read_observed_demand,
        solve_fleet_plan,
    )
    from ipnext.contracts.fleet import DemandSizing, FleetReplanInput, FleetReplanResult
    from ipnext.contracts.model import ApplyPlanInput
    from ipnext.names import ModelWorkflowNames, model_workflow_id

__all__ = ["FleetReplanResult", "FleetReplanWorkflow"]

# Runs started before observed demand was planned replay without reading it.
OBSERVED_DEMAND_PATCH = "observed-demand"


@workflow.defn
class FleetReplanWorkflow:
    @workflow.run
    async def run(self, input: FleetReplanInput) -> FleetReplanResult:
        workflow.set_current_details("collecting every model's demand")
        collected = await workflow.execute_activity_method(
            FleetActivities.collect_models,
            start_to_close_timeout=QUICK_TIMEOUT * 4,
            retry_policy=RETRY,
            summary="read models from the registry",
        )
        names = [m.spec.name for m in collected.models]
        down = sorted(set(input.down_regions) | set(collected.down_regions))
        if not collected.models:
            workflow.set_current_details("no models to plan")
            return FleetReplanResult(revision=0, models=[], down_regions=down, reason=input.reason)
        demand: dict[str, DemandSizing] = {}
        demand_note = "observed demand not read"
        if workflow.patched(OBSERVED_DEMAND_PATCH):
            workflow.set_current_details("reading observed demand")
            try:
                observed = await workflow.execute_activity(
                    read_observed_demand,
                    ReadDemandInput(
                        declared={m.spec.name: dict(m.spec.traffic.peak_qps) for m in collected.models},
                        interval_s=input.interval_s,
                    ),
                    start_to_close_timeout=QUICK_TIMEOUT * 4,
                    retry_policy=RECONCILE_RETRY,
                    summary="read observed demand from the metrics actors",
                )
                demand = observed.demand
            except ActivityError as err:  # Ray down: plan declared demand rather than not at all
                demand_note = f"observed demand unreadable ({err.cause or err}): declared demand planned"
        without = f" without {', '.join(down)}" if down else ""
        workflow.set_current_details(f"solving {len(names)} models{without}: {', '.join(names[:20])}")
        solved = await workflow.execute_activity(
            solve_fleet_plan,
            SolveFleetInput(
                models=collected.models,
                time_limit_s=input.time_limit_s,
                churn_cost=input.churn_cost,
                made_by=f"{workflow.info().workflow_id}/{workflow.info().run_id}",
                down_regions=down,
                demand=demand,
                demand_note=demand_note,
            ),
            start_to_close_timeout=timedelta(seconds=input.time_limit_s + 120),
            retry_policy=RETRY,
            summary=f"solve the fleet ({len(names)} models){without}",
        )
        applied, refused = [], {}
        for model, plan in sorted(solved.changed.items()):
            handle = workflow.get_external_workflow_handle(model_workflow_id(model))
            try:
                await handle.signal(
                    ModelWorkflowNames.APPLY_PLAN,
                    ApplyPlanInput(plan=plan, fleet_revision=solved.revision, down_regions=down),
                )
                applied.append(model)
            except FailureError as err:  # deleted since it was read
                refused[model] = str(err)
        result = FleetReplanResult(
            revision=solved.revision,
            models=names,
            cost=solved.cost,
            objective=solved.objective,
            lower_bound=solved.lower_bound,
            gap=solved.gap,
            status=solved.status,
            moved_units=solved.moved_units,
            moves=solved.moves,
            moves_total=solved.moves_total,
            applied_to=applied,
            not_applied=refused,
            plan_file=solved.plan_file,
            down_regions=down,
            relaxed=solved.relaxed,
            reason=input.reason,
            demand=solved.demand,
        )
        workflow.set_current_details(_details(result))
        return result


def _details(r: FleetReplanResult) -> str:
    gap = f"{100 * r.gap:.3f}%" if r.gap is not None else "n/a"
    lines = [
        f"**plan revision {r.revision}** ({r.status}): cost {r.cost:.2f}, gap {gap}, "
        f"{r.moved_units} units newly placed",
        f"models: {', '.join(r.models)}",
        f"applied to: {', '.join(r.applied_to) or 'none (no placement changed)'}",
    ]
    if r.reason:
        lines.insert(1, f"why: {r.reason}")
    if r.down_regions:
        lines.append(f"planned without the down regions: {', '.join(r.down_regions)}")
    if r.relaxed:
        lines.append("relaxed:\n" + "\n".join(f"- {x}" for x in r.relaxed))
    observed = {m: d for m, d in r.demand.items() if any(s.used == "observed" for s in d.sources.values())}
    if observed:
        lines.append(
            "planned for observed demand:\n"
            + "\n".join(
                f"- {m}: {source} {s.planned_qps:g} qps "
                f"(observed peak {s.observed_peak_qps or 0:g}, declared {s.declared_qps:g}"
                f"{', OVER BUDGET' if s.over_budget else ''})"
                for m, d in sorted(observed.items())
                for source, s in sorted(d.sources.items())
                if s.used == "observed"
            )
        )
    if r.moves:
        lines.append("moves:\n" + "\n".join(f"- {m}" for m in r.moves[:50]))
    return "\n\n".join(lines)
