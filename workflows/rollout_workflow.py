"""RolloutWorkflow: move a model's serving to a new snapshot set, as a single cutover.

Make before break: the new set's apps come up and are healthy before the routers
move all traffic to them, and the old set's apps go only after. If any step fails,
traffic stays on (or returns to) the old set and the new set's apps are removed.
Gradual steps with gates, pause and abort build on this workflow.
"""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from ipnext.activities import DEPLOY_TIMEOUT, HEARTBEAT_TIMEOUT, QUICK_TIMEOUT, RETRY
    from ipnext.activities.serving import (
        DeploySetInput,
        RemoveAppsInput,
        RouteInput,
        deploy_set_apps,
        remove_apps,
        route_traffic,
    )
    from ipnext.registry import RolloutInput, RolloutResult
    from ipnext.rollout import RolloutState, RolloutStatus
    from ipnext.temporal import MODEL_KEY, STATE_KEY, TRAFFIC_KEY


@workflow.defn
class RolloutWorkflow:
    @workflow.init
    def __init__(self, input: RolloutInput) -> None:
        self._input = input
        self._state = RolloutState.PENDING
        self._step = "pending"
        old_id = input.old_set.id if input.old_set else None
        self._traffic: dict[str, float] = {input.new_set.id: 0.0}
        if old_id:
            self._traffic[old_id] = 100.0
        self._generations: list[int] = []
        self._detail = ""

    @workflow.query
    def status(self) -> RolloutStatus:
        return RolloutStatus(
            model=self._input.spec.name,
            set_id=self._input.new_set.id,
            from_set_id=self._input.old_set.id if self._input.old_set else None,
            state=self._state,
            step=self._step,
            traffic_percent=dict(self._traffic),
            generations=list(self._generations),
            detail=self._detail,
        )

    @workflow.run
    async def run(self, input: RolloutInput) -> RolloutResult:
        new_apps: dict[str, str] = {}
        routed = False
        what = "the new set" if input.kind == "snapshots" else f"placement revision {input.plan.revision}"
        self._enter(RolloutState.RUNNING, f"deploying {what}")
        try:
            deployed = await workflow.execute_activity(
                deploy_set_apps,
                DeploySetInput(spec=input.spec, snapshot_set=input.new_set, plan=input.plan),
                start_to_close_timeout=DEPLOY_TIMEOUT,
                heartbeat_timeout=HEARTBEAT_TIMEOUT,
                retry_policy=RETRY,
                summary=f"deploy {input.new_set.id}",
            )
            new_apps = deployed.apps
            self._enter(RolloutState.RUNNING, "shifting traffic")
            routed = True
            await self._route(_cutover_weights(input, new_apps))
            self._set_traffic(100.0)
            old = sorted(set(input.old_apps.values()) - set(new_apps.values()))
            if old:
                self._enter(RolloutState.RUNNING, "removing the old set")
                await self._remove(old)
            self._enter(RolloutState.COMPLETED, "done")
            return RolloutResult(state=self._state, apps=new_apps, generations=self._generations)
        except ActivityError as err:
            cause = err.cause
            self._detail = cause.message if isinstance(cause, ApplicationError) else str(cause or err)
            workflow.logger.warning("rollout of %s failed: %s", input.new_set.id, self._detail)
            if routed and input.old_apps:
                await self._route({region: {app: 100.0} for region, app in input.old_apps.items()})
            self._set_traffic(0.0)
            if new_apps:
                await self._remove(sorted(set(new_apps.values()) - set(input.old_apps.values())))
            self._enter(RolloutState.FAILED, "failed; traffic stays on the previous set")
            return RolloutResult(
                state=self._state,
                apps=dict(input.old_apps),
                generations=self._generations,
                detail=self._detail,
            )

    async def _route(self, weights: dict[str, dict[str, float]]) -> None:
        result = await workflow.execute_activity(
            route_traffic,
            RouteInput(model=self._input.spec.name, weights=weights),
            start_to_close_timeout=DEPLOY_TIMEOUT,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
            retry_policy=RETRY,
            summary="apply router weights",
        )
        for generation in sorted(set(result.generations.values())):
            if generation not in self._generations:
                self._generations.append(generation)

    async def _remove(self, names: list[str]) -> None:
        await workflow.execute_activity(
            remove_apps,
            RemoveAppsInput(names=names),
            start_to_close_timeout=QUICK_TIMEOUT * 4,
            retry_policy=RETRY,
            summary=f"remove {', '.join(names)}",
        )

    def _set_traffic(self, percent: float) -> None:
        if self._input.kind == "capacity":  # the same set serves throughout; only its apps change
            return
        self._traffic[self._input.new_set.id] = percent
        if self._input.old_set:
            self._traffic[self._input.old_set.id] = 100.0 - percent
        workflow.upsert_search_attributes([TRAFFIC_KEY.value_set(int(percent))])
        self._publish_details()

    def _enter(self, state: RolloutState, step: str) -> None:
        self._state = state
        self._step = step
        workflow.upsert_search_attributes(
            [MODEL_KEY.value_set(self._input.spec.name), STATE_KEY.value_set(state.value)]
        )
        self._publish_details()

    def _publish_details(self) -> None:
        split = ", ".join(f"{k}: {v:g}%" for k, v in sorted(self._traffic.items()))
        workflow.set_current_details(
            f"**{self._state.value}**: {self._step}\n\ntraffic: {split}\n\n"
            f"generations applied: {self._generations or 'none'}"
            + (f"\n\n{self._detail}" if self._detail else "")
        )


def _cutover_weights(input: RolloutInput, new_apps: dict[str, str]) -> dict[str, dict[str, float]]:
    """Router weights after the cutover: each serving region's router to its new app, and the
    router of every other region the model's traffic comes from (or that served before) to
    the app of the region that takes its traffic, so callers of its URL keep getting answers."""
    weights = {region: {app: 100.0} for region, app in new_apps.items()}
    sources = {s for p in input.plan.deployments.values() for s in p.fractions}
    for region in sorted((sources | set(input.old_apps)) - set(new_apps)):
        targets = sorted(
            t for p in input.plan.deployments.values() if (t := p.serving_region(region)) in new_apps
        )
        if targets:
            weights[region] = {new_apps[targets[0]]: 100.0}
    return weights
