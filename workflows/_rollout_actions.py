"""What a rollout does outside its step logic: each activity it runs (with its timeout, retry
policy and the summary the Temporal UI shows), its pauses and aborts, and what it publishes of
itself (search attributes, the UI's details, the `status` query). RolloutWorkflow
(rollout_workflow.py) inherits these and keeps the order of things: the steps, the bakes, the
rollback. Nothing here runs outside a workflow: every method reads the workflow's clock, log or
state."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from ipnext.activities import (
        DEPLOY_TIMEOUT,
        HEARTBEAT_TIMEOUT,
        QUICK_TIMEOUT,
        RECONCILE_RETRY,
        RETRY,
    )
    from ipnext.activities.freeze import FreezeWindowsResult, freeze_windows
    from ipnext.activities.reconcile import ReconcileInput, ReconcileResult, SetTarget, reconcile_serving
    from ipnext.activities.serving import (
        DeploySetInput,
        ReadMetricsInput,
        ReadMetricsResult,
        RemoveAppsInput,
        RouteInput,
        deploy_set_apps,
        read_metrics,
        remove_apps,
        route_traffic,
    )
    from ipnext.contracts.freeze import FreezeWindow
    from ipnext.contracts.identity import attributed
    from ipnext.contracts.plan import Plan
    from ipnext.contracts.rollout import (
        INSUFFICIENT_TRAFFIC,
        IPNEXT,
        PauseRecord,
        RolloutInput,
        RolloutProgress,
        RolloutResult,
        RolloutStatus,
    )
    from ipnext.contracts.router import RouterConfig
    from ipnext.names import MODEL_KEY, STATE_KEY, TRAFFIC_KEY, RolloutOutcome, RolloutState
    from ipnext.policy import rollout_steps as steps
    from ipnext.policy.rollout_steps import PartWeights, RolloutStep, Weights
    from ipnext.spec.model import ModelSpec, SnapshotSet

SERVING_CHECK_PATCH = "rollout-serving-check"  # runs started before bakes checked their serving


class RolloutStop(Exception):
    """The rollout must reverse: a gate breached, or on-call aborted."""

    def __init__(self, state: RolloutState, detail: str) -> None:
        super().__init__(detail)
        self.state = state
        self.detail = detail


class RolloutActions:
    """The rollout's state and its calls out; RolloutWorkflow sets the state in its constructor."""

    _input: RolloutInput  # the rollout's input, without its down regions
    _progress: RolloutProgress  # the one state object, carried whole when the run continues as new
    _steps: list[RolloutStep]
    _rolling: list[str]  # sync: independent: the parts that change, in order
    _start: Weights  # the routers' weights before the rollout
    _cancel_aborts: bool  # a patched run treats Temporal's cancellation as an abort

    def _old_plan(self) -> Plan:
        return self._input.old_plan or self._input.plan

    def _old_set(self) -> SnapshotSet:
        if self._input.old_set is None:  # a gradual rollout always has one
            raise ApplicationError(
                f"rollout of {self._input.new_set.id}: the old set is to be scaled down, but the "
                "RolloutInput names no old_set",
                type="RolloutInputError",
                non_retryable=True,
            )
        return self._input.old_set

    # ---- pauses --------------------------------------------------------------------------------

    async def _hold_while_paused(self) -> None:
        p = self._progress
        await workflow.wait_condition(lambda: not self._paused() or p.abort is not None)
        if p.abort is not None:
            raise self._aborted()

    def _aborted(self) -> RolloutStop:
        """The stop an `abort` (or Temporal's cancellation, which is one) calls for."""
        p = self._progress
        if p.abort is None:  # only called once one is recorded
            raise ApplicationError("no abort recorded", type="RolloutStateError", non_retryable=True)
        if p.cancelled:
            return RolloutStop(RolloutState.CANCELLED, f"cancelled ({p.abort.reason})")
        return RolloutStop(
            RolloutState.ABORTED, f"aborted by {attributed(p.abort.who, p.abort_identity)}: {p.abort.reason}"
        )

    def _stop_if_aborted(self) -> None:
        """Between a step's activities: an abort (or a cancellation) recorded while one ran stops
        the rollout before it moves more traffic. Runs from before this check went on to bake."""
        if self._progress.abort is not None and self._cancel_aborts:
            raise self._aborted()

    def _pause_by_ipnext(self, reason: str, detail: str) -> None:
        self._progress.pauses.append(PauseRecord(reason=reason, who=IPNEXT, at=workflow.now()))
        self._progress.detail = f"paused: {reason} ({detail})"
        workflow.logger.warning("rollout paused: %s (%s)", reason, detail)
        self._enter(RolloutState.PAUSED, self._progress.step)

    def _close_pause(self, who: str, identity: str | None = None) -> None:
        p = self._progress
        p.pauses[-1] = p.pauses[-1].model_copy(
            update={"resumed_by": who, "resumed_at": workflow.now(), "resumed_identity": identity}
        )
        p.resumes += 1
        p.detail = ""
        self._enter(RolloutState.RUNNING, p.step)

    def _paused(self) -> bool:
        return self._progress.state == RolloutState.PAUSED

    def _waiting_for_traffic(self) -> bool:
        """Paused by ipnext itself for too few requests (a pause ipnext may end)."""
        p = self._progress
        if not self._paused() or not p.pauses:
            return False
        last = p.pauses[-1]
        return last.who == IPNEXT and last.reason == INSUFFICIENT_TRAFFIC and last.resumed_at is None

    def _running_or_paused(self) -> RolloutState:
        return RolloutState.PAUSED if self._paused() else RolloutState.RUNNING

    async def _wait(self, interval: timedelta, resumes: int) -> None:
        """One check interval, cut short by an abort or a resume."""
        p = self._progress
        try:
            await workflow.wait_condition(
                lambda: p.abort is not None or p.resumes != resumes, timeout=interval
            )
        except TimeoutError:
            pass

    def _status(self) -> RolloutStatus:
        """What the `status` query answers."""
        p = self._progress
        return RolloutStatus(
            model=self._input.spec.name,
            set_id=self._input.new_set.id,
            from_set_id=self._input.old_set.id if self._input.old_set else None,
            state=p.state,
            step=p.step,
            traffic_percent=dict(p.traffic_percent),
            generations=list(p.generations),
            detail=p.detail,
            workflow_id=workflow.info().workflow_id,
            steps=[step.percent for step in self._steps],
            steps_done=p.steps_done,
            gates=list(p.gates),
            pauses=list(p.pauses),
            freeze_override=p.freeze_override,
            freeze_override_identity=p.freeze_override_identity,
            part=p.part,
            part_traffic=dict(p.part_traffic),
            repairs=p.repairs,
            last_repair=p.last_repair,
            serving_unchecked=p.serving_unchecked,
            outcome=RolloutOutcome.of(p.state),
            updated_at=p.updated_at,
            min_requests=self._input.spec.rollout.min_requests,
        )

    # ---- activities ----------------------------------------------------------------------------

    async def _deploy(
        self, snapshot_set: SnapshotSet, plan: Plan, scales: dict[str, float]
    ) -> dict[str, str]:
        """The set's apps at `scales` (part -> share of the plan's replicas), under the spec that
        set runs with (the old one's, when a model update changed parts)."""
        spec = self._spec_for(snapshot_set)
        scale, shares = steps.deploy_scale(scales, list(spec.parts))
        sizes = ", ".join(f"{p} {v:.0%}" for p, v in sorted(shares.items())) or f"{scale:.0%}"
        deployed = await workflow.execute_activity(
            deploy_set_apps,
            DeploySetInput(spec=spec, snapshot_set=snapshot_set, plan=plan, scale=scale, part_scales=shares),
            start_to_close_timeout=DEPLOY_TIMEOUT,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
            retry_policy=RETRY,
            summary=f"{snapshot_set.id} at {sizes} of plan revision {plan.revision}",
        )
        return dict(deployed.apps)

    def _spec_for(self, snapshot_set: SnapshotSet) -> ModelSpec:
        old = self._input.old_set
        if old is not None and snapshot_set.id == old.id and old.id != self._input.new_set.id:
            return self._input.spec_of_old()
        return self._input.spec

    def _pool_routes(self, weights: Weights) -> bool:
        """Whether the model's routers are its regions' pool routers for these weights: when its
        new set is pooled, and while a pooled old set still takes traffic (a model moving to
        dedicated keeps the pool router, which reaches both kinds of set, until its last step;
        a router of its own reaches no pooled set)."""
        if self._input.spec.pooled():
            return True
        old = self._input.old_set
        if old is None or not self._input.spec_of_old().pooled():
            return False
        old_apps = f"s{old.number}"  # set apps are named <model>.<region>.s<set>.r<revision>
        return any(
            weight > 0 and app.rsplit(".", 2)[-2:-1] == [old_apps]
            for row in weights.values()
            for app, weight in row.items()
        )

    async def _route(
        self, weights: Weights, parts: PartWeights | None = None, gated: str | None = None
    ) -> None:
        result = await workflow.execute_activity(
            route_traffic,
            RouteInput(
                model=self._input.spec.name,
                weights=weights,
                parts=parts or {},
                gated_part=gated,
                router_max_ongoing_requests=self._input.spec.router.max_ongoing_requests,
                router=self._input.spec.router,
                generation_floor=max(self._progress.generations, default=0),
                pooled=self._pool_routes(weights),
            ),
            start_to_close_timeout=DEPLOY_TIMEOUT,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
            retry_policy=RETRY,
            summary="apply router weights",
        )
        p = self._progress
        for generation in sorted(set(result.generations.values())):
            if generation not in p.generations:
                p.generations.append(generation)
        for region, generation in result.generations.items():
            by_part = (parts or {}).get(region, {})
            p.routers[region] = RouterConfig(
                generation=generation,
                weights=weights[region],
                parts=by_part,
                gated_part=gated if gated in by_part else None,
            )

    async def _shift(
        self, percent: float, end: Weights, part: str | None = None, done: list[str] | None = None
    ) -> None:
        """`percent` of the traffic (with sync: independent, of `part`'s calls) to the new set."""
        await self._route(*steps.step_routes(self._start, end, percent, part, done))
        self._set_traffic(percent, part)

    async def _check_serving(self) -> timedelta:
        """Serve against what this rollout applied (both sets at their step's sizes, every router
        as last routed), pushed again where it differs: Ray restarted mid-rollout comes back with
        the split it had, at the generations it had. A repair is counted and logged; a check that
        cannot run (its tries ran out or timed out: Ray still down, Serve not started yet) is
        logged, recorded as `serving_unchecked` (the bake holds its judgement of traffic until
        one runs) and tried again next interval; one that ran and failed (Serve refused an app)
        is logged, and the gates judge. Returns when to check again."""
        input, p = self._input, self._progress
        if input.old_set is None or not p.routers or not workflow.patched(SERVING_CHECK_PATCH):
            return timedelta(days=1)
        check = ReconcileInput(
            spec=input.spec,
            serving_set=input.old_set,
            plan=self._old_plan(),
            apps=dict(input.old_apps),
            generation_floor=max(p.generations, default=0),
            sets=[
                SetTarget(
                    snapshot_set=input.old_set,
                    plan=self._old_plan(),
                    scales=p.old_scales,
                    spec=input.old_spec,  # None: `spec`
                ),
                SetTarget(snapshot_set=input.new_set, plan=input.plan, scales=p.new_scales),
            ],
            routers=dict(p.routers),
        )
        try:
            result: ReconcileResult = await workflow.execute_activity(
                reconcile_serving,
                check,
                start_to_close_timeout=DEPLOY_TIMEOUT,
                heartbeat_timeout=HEARTBEAT_TIMEOUT,
                retry_policy=RECONCILE_RETRY,
                summary="check serving against the rollout",
            )
        except ActivityError as err:
            workflow.logger.warning("rollout serving check failed (tried again next interval): %s", err.cause)
            cause = err.cause
            # Its tries ran out or timed out (Ray unreachable, Serve starting again): it could not
            # run. A non-retryable failure is one that ran and found what it cannot fix (Serve
            # refused an app): the gates judge what that does to the traffic.
            ran = isinstance(cause, ApplicationError) and cause.non_retryable
            why = cause.message if isinstance(cause, ApplicationError) else str(cause or err)
            if p.serving_unchecked != ("" if ran else why):
                p.serving_unchecked = "" if ran else why
                self._publish_details()
            return timedelta(seconds=input.spec.rollout.check_interval_seconds)
        if p.serving_unchecked:
            p.serving_unchecked = ""
            self._publish_details()
        if result.repaired:
            p.repairs += 1
            p.last_repair = "; ".join(result.repaired)
            workflow.logger.warning("rollout serving repaired (the bake starts again): %s", p.last_repair)
            self._publish_details()
        return timedelta(seconds=result.interval_seconds)

    async def _read_metrics(self, regions: list[str]) -> ReadMetricsResult:
        return await workflow.execute_activity(
            read_metrics,
            ReadMetricsInput(model=self._input.spec.name, regions=regions),
            start_to_close_timeout=QUICK_TIMEOUT,
            retry_policy=RETRY,
            summary="read request metrics",
        )

    async def _freeze_windows(self) -> list[FreezeWindow]:
        result: FreezeWindowsResult = await workflow.execute_activity(
            freeze_windows,
            start_to_close_timeout=QUICK_TIMEOUT,
            retry_policy=RETRY,
            summary="freeze calendar",
        )
        return list(result.windows)

    async def _remove(self, names: list[str], *, wait: bool = True) -> None:
        await workflow.execute_activity(
            remove_apps,
            RemoveAppsInput(names=names) if wait else RemoveAppsInput(names=names, wait=False),
            start_to_close_timeout=QUICK_TIMEOUT * 4,
            retry_policy=RETRY,
            summary=f"remove {', '.join(names)}",
        )

    # ---- visibility ----------------------------------------------------------------------------

    def _result(self, apps: dict[str, str]) -> RolloutResult:
        p = self._progress
        outcome = RolloutOutcome.of(p.state)
        if outcome is None:  # every path that returns a result has entered its end state
            raise ApplicationError(
                f"rollout of {self._input.new_set.id} ends in state {p.state.value}, not an end state",
                type="RolloutStateError",
                non_retryable=True,
            )
        return RolloutResult(
            state=p.state,
            outcome=outcome,
            apps=apps,
            generations=p.generations,
            detail=p.detail,
            status=self._status(),
        )

    def _set_traffic(self, percent: float, part: str | None = None) -> None:
        """The new set's share of the traffic. sync: independent: `part`'s share, and the set's
        the mean over the changed parts, so it rises step by step to 100 and never falls back."""
        p = self._progress
        if part is not None:
            p.part_traffic[part] = percent
            percent = sum(p.part_traffic.values()) / len(p.part_traffic)
        p.percent = percent
        p.traffic_percent = steps.traffic_split(self._input, percent)
        workflow.upsert_search_attributes([TRAFFIC_KEY.value_set(round(percent))])
        self._publish_details()

    def _enter(self, state: RolloutState, step: str) -> None:
        changed = state != self._progress.state
        self._progress.state = state
        self._progress.step = step
        if changed:
            workflow.upsert_search_attributes(
                [MODEL_KEY.value_set(self._input.spec.name), STATE_KEY.value_set(state.value)]
            )
        self._publish_details()

    def _publish_all(self) -> None:
        """A continued run states its search attributes and details afresh."""
        workflow.upsert_search_attributes(
            [
                MODEL_KEY.value_set(self._input.spec.name),
                STATE_KEY.value_set(self._progress.state.value),
                TRAFFIC_KEY.value_set(round(self._progress.percent)),
            ]
        )
        self._publish_details()

    def _publish_details(self) -> None:
        """The UI's current details, and the time `status` is as of (no command: replay-safe)."""
        p = self._progress
        p.updated_at = workflow.now()
        percents = [step.percent for step in self._steps]
        parts = ", ".join(f"{k}: {v:g}%" for k, v in p.part_traffic.items())
        outcome = RolloutOutcome.of(p.state)
        headline = f"**{p.state.value}**: {p.step}"
        if outcome is not None:  # the badge says COMPLETED or FAILED: the details say how
            on = "new" if outcome == "completed" else "previous"
            headline = f"**outcome: {outcome.value}** (traffic on the {on} set): {p.step}"
        lines = [
            headline,
            f"steps done: {p.steps_done}/{len(percents)} of {percents}",
            "traffic: " + ", ".join(f"{k}: {v:g}%" for k, v in sorted(p.traffic_percent.items())),
            *([f"parts on the new set: {parts}"] if self._rolling else []),
            f"generations applied: {p.generations or 'none'}",
        ]
        if p.gates:
            lines.append("gates: " + "; ".join(r.describe() for r in p.gates))
        waiting = [r.requests for r in p.gates if not r.judged]
        needed = self._input.spec.rollout.min_requests - min(waiting) if waiting else 0
        if needed > 0 and outcome is None:
            lines.append(f"needs {needed} more request(s) on the new set before the gates judge")
        if p.pauses and self._paused():
            last = p.pauses[-1]
            lines.append(f"paused by {attributed(last.who, last.identity)}: {last.reason}")
        if p.serving_unchecked:
            lines.append(
                f"serving check could not run (the bake waits for one that runs): {p.serving_unchecked}"
            )
        if p.repairs:
            lines.append(f"serving repaired {p.repairs} time(s), last: {p.last_repair}")
        if p.freeze_override is not None:
            by = attributed(p.freeze_override.who, p.freeze_override_identity)
            lines.append(f"freeze override by {by}: {p.freeze_override.reason}")
        if p.cancelled and outcome is None:
            lines.append("cancellation requested: rolling back as on abort")
        if p.detail:
            lines.append(p.detail)
        workflow.set_current_details("\n\n".join(lines))
