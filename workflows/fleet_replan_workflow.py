"""FleetReplanWorkflow: replan every model of the fleet at once, on a Schedule.

It reads every live model's demand and current plan from the registry, solves the
whole fleet (the pure planner, in an activity), stores the plan, and signals each
model whose placement changed; the ModelWorkflow applies it as a capacity-only
transition, make before break. The result (and the run's details in the Temporal UI)
carry the plan's figures and its moves; `ipnext plan show` reads the stored plan.
Regions held down (the input's, and those the `fleet` workflow holds) are planned without,
relaxing what their loss forces; the result says which constraints it relaxed.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import FailureError

with workflow.unsafe.imports_passed_through():
    from ipnext.activities import QUICK_TIMEOUT, RETRY
    from ipnext.activities.fleet import FleetActivities, SolveFleetInput, solve_fleet_plan
    from ipnext.contracts import ModelWorkflowNames, model_workflow_id
    from ipnext.registry import ApplyPlanInput
    from ipnext.replan import FleetReplanInput, FleetReplanResult

__all__ = ["FleetReplanResult", "FleetReplanWorkflow"]


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
                    ModelWorkflowNames.APPLY_PLAN, ApplyPlanInput(plan=plan, fleet_revision=solved.revision)
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
    if r.moves:
        lines.append("moves:\n" + "\n".join(f"- {m}" for m in r.moves[:50]))
    return "\n\n".join(lines)
