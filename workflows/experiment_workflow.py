"""ExperimentWorkflow: the serving set (control) against a treatment set, split by unit and held on
purpose for a set duration, judged on outcomes, guarded by the rollout gates.

It deploys the treatment set's apps at its share of the plan beside the control's (which keep
serving as they are), and gives every region's router the experiment route
(`rollout.ExperimentRoute`: each unit's arm by a salted hash, so a user keeps one arm in every
region and across restarts). Every `check_seconds` it reads the routers' counters, adds each
arm's window to its totals (requests, errors, latency, the outcomes feedback sent) and applies the
model's rollout gates to the treatment's window against the control's: a breach ends the
experiment. It ends when the duration is over, on a `stop` signal, or on that breach, always the
same way: routers back to the control alone (no experiment route), the treatment's apps removed,
and the report (`experiments.summarize`) in its result. Its state is one object
(`ExperimentState`), its continue-as-new payload, so a multi-day experiment's totals survive the
history limit.

In shadow mode (`ipnext shadow start`) the control answers every request and the routers copy
`treatment_percent` of them to the treatment after answering (`rollout.ShadowRoute`,
serving/shadow_mirror.py); each window's comparisons (`ipnext.policy.shadow`) are kept beside the totals,
and the gates' readings are recorded as evidence without ending it (the treatment answers no one).

ModelWorkflow starts it (`start_experiment`, workflows/_model_experiments.py) and holds its own
rollouts and serving checks while it runs; at its end it tells the model by `experiment_ended`.
A replan that needs new apps comes as `move_arms` (`_move`): both arms come up on the new
placement beside the old apps, every router switches both at once (same salt and split), the
routing follows, the old apps go, and the next window counts the old apps and the new, so no
request answered across the switch is lost from the totals; the model is answered `arms_moved`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, FailureError

with workflow.unsafe.imports_passed_through():
    # The report's tests (ipnext.policy.experiments) import scipy when first called: numpy, under it,
    # writes environment variables at import, which the sandbox forbids. Passed through here,
    # it is imported once with the worker; its special functions are deterministic.
    import scipy.special  # noqa: F401

    from ipnext.activities import DEPLOY_TIMEOUT, HEARTBEAT_TIMEOUT, QUICK_TIMEOUT, RETRY
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
    from ipnext.contracts.counters import SetCounters
    from ipnext.contracts.experiment import (
        ArmsMoved,
        ExperimentInput,
        ExperimentReport,
        ExperimentState,
        ExperimentStatus,
        MoveArmsInput,
        StopExperimentInput,
    )
    from ipnext.contracts.router import ExperimentRoute, ShadowRoute
    from ipnext.names import (
        ARMS_KEY,
        MODEL_KEY,
        STATE_KEY,
        ExperimentWorkflowNames,
        ModelWorkflowNames,
    )
    from ipnext.policy.experiments import comparison_key, summarize
    from ipnext.policy.gates import evaluate_gates, window_counters
    from ipnext.policy.shadow import render_shadow, summarize_shadow
    from ipnext.workflows._signals import NO_PAYLOAD, signal_input

__all__ = ["CONTROL", "SHADOW_WINDOWS_KEPT", "TREATMENT", "ExperimentWorkflow"]

CONTROL, TREATMENT = "control", "treatment"
SHADOW_WINDOWS_KEPT = 20  # a shadow's latest windows in its state and status


@workflow.defn
class ExperimentWorkflow:
    @workflow.init
    def __init__(self, input: ExperimentInput) -> None:
        self._input = input
        self._state = (input.state or ExperimentState()).model_copy(deep=True)

    @workflow.query(name=ExperimentWorkflowNames.STATUS)
    def status(self) -> ExperimentStatus:
        input, s = self._input, self._state
        report = shadow = None
        if s.totals and input.mode == "shadow":
            shadow = summarize_shadow(s.totals.get(TREATMENT, SetCounters()), windows=max(0, s.checks - 1))
        elif s.totals:
            report = self._summary()
        return ExperimentStatus(
            model=input.spec.name,
            name=input.name,
            workflow_id=workflow.info().workflow_id,
            phase=s.phase,
            outcome=s.outcome,
            end=s.end,
            started_at=s.started_at,
            ends_at=s.ends_at,
            arms={CONTROL: input.control_set.id, TREATMENT: input.treatment_set.id},
            treatment_percent=input.treatment_percent,
            guardrails=list(s.guardrails),
            report=report,
            mode=input.mode,
            shadow=shadow,
            shadow_windows=list(s.shadow_windows),
            unit=input.unit,
        )

    @workflow.signal(name=ExperimentWorkflowNames.STOP)
    def stop(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> None:
        """On-call ends it now: all traffic to control (a malformed or bare stop is logged and ignored)."""
        input = signal_input(raw, StopExperimentInput, ExperimentWorkflowNames.STOP)
        if input is not None and not self._state.end:
            self._state.end = f"stopped by {input.who}: {input.reason}"
            self._state.outcome = "stopped"

    @workflow.signal(name=ExperimentWorkflowNames.MOVE_ARMS)
    def move_arms(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> None:
        """The model's replan needs new apps: both arms move to it between two checks (`_move`).
        The newest placement wins; one that comes after the end is answered as refused."""
        input = signal_input(raw, MoveArmsInput, ExperimentWorkflowNames.MOVE_ARMS)
        if input is not None:
            self._state.move = input

    @workflow.run
    async def run(self, input: ExperimentInput) -> ExperimentStatus:
        s = self._state
        self._enter(s.phase)
        if s.phase == "deploying":
            s.treatment_apps = await self._deploy()
            await self._route(experiment=True)
            s.started_at = workflow.now()
            s.ends_at = s.started_at + timedelta(seconds=input.duration_seconds)
            self._enter("running")
        while s.phase == "running" and not s.end:
            left = (s.ends_at - workflow.now()).total_seconds() if s.ends_at is not None else 0.0
            if left <= 0:
                s.end, s.outcome = f"its duration of {input.duration_seconds:g} s ended", "completed"
                break
            try:
                await workflow.wait_condition(
                    lambda: bool(s.end) or s.move is not None, timeout=min(input.check_seconds, left)
                )
            except TimeoutError:
                pass
            if s.end:
                break
            if s.move is not None:
                await self._move(s.move)
                continue
            await self._check()
            if self._history_full() and not s.end:
                workflow.continue_as_new(self._input.model_copy(update={"state": s}))
        self._enter("ending")
        await self._check()  # the last window: what came in since the previous read counts too
        await self._route(experiment=False)
        await workflow.execute_activity(
            remove_apps,
            RemoveAppsInput(
                names=sorted(set(s.treatment_apps.values())),
                feedback_ledger=(input.spec.name, input.name),
            ),
            start_to_close_timeout=DEPLOY_TIMEOUT,
            retry_policy=RETRY,
            summary="remove the treatment's apps and the feedback ledger",
        )
        self._enter("ended")
        if s.move is not None:  # asked too late: the model moves the control alone after the end
            await self._answer_move(ArmsMoved(move=s.move.move, error=f"the experiment ended first: {s.end}"))
        workflow.logger.info("experiment %s of %s ended: %s", input.name, input.spec.name, s.end)
        result = self.status()
        await self._report(result)
        return result

    async def _report(self, result: ExperimentStatus) -> None:
        """Tell the model (its latest run: it may have continued as new since) that this ended."""
        parent = workflow.info().parent
        if parent is None:  # started by hand, not by a model: no one to tell
            return
        try:
            await workflow.get_external_workflow_handle(parent.workflow_id).signal(
                ModelWorkflowNames.EXPERIMENT_ENDED, result
            )
        except FailureError as err:  # the model's workflow is gone: nothing to tell
            workflow.logger.warning(
                "could not report the experiment's end to %s: %s", parent.workflow_id, err
            )

    # ---- steps -----------------------------------------------------------------------------------

    async def _move(self, move: MoveArmsInput) -> None:
        """Both arms onto `move.plan`: the control's apps at full size and the treatment's at its
        share come up beside the old ones; every region's router then switches each arm to its
        new app at once (units keep their arms: the salt and split are unchanged); the model's
        routing follows the new plan; the old apps go (a down region's unwaited). A deploy that
        fails for good removes what it brought up and leaves the arms where they were: the model
        is told, and its replan waits for the end. The model is answered either way."""
        input, s = self._input, self._state
        old_control, old_treatment = dict(input.control_apps), dict(s.treatment_apps)
        moved = input.model_copy(update={"plan": move.plan})
        brought: set[str] = set()
        try:
            control = await self._deploy_set(moved, CONTROL, publish_routing=False)
            brought |= set(control.values())
            treatment = await self._deploy_set(moved, TREATMENT)
            brought |= set(treatment.values())
        except ActivityError as err:
            await self._remove_apps(sorted(brought - set(old_control.values()) - set(old_treatment.values())))
            s.move = None if s.move is move else s.move
            await self._answer_move(ArmsMoved(move=move.move, error=f"a deploy failed: {err.cause or err}"))
            return
        for arm, before in ((CONTROL, old_control), (TREATMENT, old_treatment)):
            for region, app in before.items():
                kept = s.moved_from.setdefault(arm, {}).setdefault(region, [])
                if app not in kept:
                    kept.append(app)
        self._input = moved.model_copy(update={"control_apps": control})
        s.treatment_apps = treatment
        await self._route(experiment=True)
        await self._deploy_set(self._input, CONTROL)  # nothing new to apply: publishes the routing
        stale = (set(old_control.values()) | set(old_treatment.values())) - brought
        down = {
            app
            for before in (old_control, old_treatment)
            for region, app in before.items()
            if region in move.down_regions
        }
        await self._remove_apps(sorted(stale - down))
        await self._remove_apps(sorted(stale & down), wait=False)
        s.moves += 1
        s.move = None if s.move is move else s.move  # a newer placement that came meanwhile is next
        workflow.logger.info(
            "experiment %s of %s: both arms moved to plan revision %d (%s)",
            input.name,
            input.spec.name,
            move.plan.revision,
            move.cause or "a replan",
        )
        self._details()
        await self._answer_move(ArmsMoved(move=move.move, control_apps=control))

    async def _answer_move(self, answer: ArmsMoved) -> None:
        parent = workflow.info().parent
        if parent is None:
            return
        try:
            await workflow.get_external_workflow_handle(parent.workflow_id).signal(
                ModelWorkflowNames.ARMS_MOVED, answer
            )
        except FailureError as err:
            workflow.logger.warning("could not answer the move to %s: %s", parent.workflow_id, err)

    async def _deploy_set(
        self, input: ExperimentInput, arm: str, *, publish_routing: bool = True
    ) -> dict[str, str]:
        """An arm's set on `input.plan`: the control at full size, the treatment at its share."""
        snapshot_set, scale = (
            (input.control_set, 1.0)
            if arm == CONTROL
            else (input.treatment_set, input.treatment_percent / 100)
        )
        deployed = await workflow.execute_activity(
            deploy_set_apps,
            DeploySetInput(
                spec=input.spec,
                snapshot_set=snapshot_set,
                plan=input.plan,
                scale=scale,
                publish_routing=publish_routing,
            ),
            start_to_close_timeout=DEPLOY_TIMEOUT,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
            retry_policy=RETRY,
            summary=f"{arm} {snapshot_set.id} at {scale:.0%} of plan revision {input.plan.revision}",
        )
        return dict(deployed.apps)

    async def _remove_apps(self, names: list[str], *, wait: bool = True) -> None:
        if names:
            await workflow.execute_activity(
                remove_apps,
                RemoveAppsInput(names=names, wait=wait),
                start_to_close_timeout=DEPLOY_TIMEOUT,
                retry_policy=RETRY,
                summary=f"remove {', '.join(names)}",
            )

    async def _deploy(self) -> dict[str, str]:
        return await self._deploy_set(self._input, TREATMENT)

    async def _route(self, experiment: bool) -> None:
        """Every region's router: all of it on the control's app, and with `experiment` the
        experiment route, by which units go to their arms (a shadow's: copies to the treatment)."""
        input, s = self._input, self._state
        routes, shadows = {}, {}
        if experiment and input.mode == "shadow":
            for region in input.control_apps:
                if region in s.treatment_apps:
                    shadows[region] = ShadowRoute(
                        shadow=input.name,
                        app=s.treatment_apps[region],
                        percent=input.treatment_percent,
                        max_in_flight=input.shadow_max_in_flight,
                    )
        elif experiment:
            for region, control in input.control_apps.items():
                if region in s.treatment_apps:
                    routes[region] = ExperimentRoute(
                        experiment=input.name,
                        salt=input.salt,
                        control=CONTROL,
                        arms={CONTROL: control, TREATMENT: s.treatment_apps[region]},
                        split={CONTROL: 100 - input.treatment_percent, TREATMENT: input.treatment_percent},
                    )
        result = await workflow.execute_activity(
            route_traffic,
            RouteInput(
                model=input.spec.name,
                weights={region: {app: 100.0} for region, app in input.control_apps.items()},
                experiments=routes,
                shadows=shadows,
                router_max_ongoing_requests=input.spec.router.max_ongoing_requests,
                router=input.spec.router,
                generation_floor=max(s.generations, default=0),
                pooled=input.spec.pooled(),
            ),
            start_to_close_timeout=DEPLOY_TIMEOUT,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
            retry_policy=RETRY,
            summary="routers: the experiment on" if experiment else "routers: all on control",
        )
        s.generations = sorted(set(s.generations) | set(result.generations.values()))

    async def _check(self) -> None:
        """One window: each arm's counters since the last read added to its totals, and the gates
        on the treatment's window against the control's (a breach ends the experiment)."""
        input, s = self._input, self._state
        moved = {region for apps in s.moved_from.values() for region in apps}
        regions = sorted(set(input.control_apps) | moved)
        read: ReadMetricsResult = await workflow.execute_activity(
            read_metrics,
            ReadMetricsInput(model=input.spec.name, regions=regions),
            start_to_close_timeout=QUICK_TIMEOUT,
            retry_policy=RETRY,
            summary="the arms' counters",
        )
        before, s.last_read = s.last_read, dict(read.snapshots)
        s.checks += 1
        if before is None:  # the first read is where the experiment's windows start
            return
        readings, shadowed = [], SetCounters()
        before_move, s.moved_from = s.moved_from, {}
        for region in regions:
            arms = {
                CONTROL: {input.control_apps.get(region, ""), *before_move.get(CONTROL, {}).get(region, [])},
                TREATMENT: {
                    s.treatment_apps.get(region, ""),
                    *before_move.get(TREATMENT, {}).get(region, []),
                },
            }
            window = {
                arm: window_counters(before.get(region), read.snapshots.get(region, {}), apps)
                for arm, apps in arms.items()
            }
            for arm, counted in window.items():
                s.totals[arm] = s.totals.get(arm, SetCounters()).plus(counted)
            shadowed = shadowed.plus(window[TREATMENT])
            rollout = input.spec.rollout
            readings += evaluate_gates(
                rollout.gates, region, window[TREATMENT], window[CONTROL], rollout.min_requests
            )
        s.guardrails = readings
        self._look()
        if input.mode == "shadow":  # a shadow's candidate answers no one: its gates are evidence
            s.shadow_windows = [*s.shadow_windows, summarize_shadow(shadowed)][-SHADOW_WINDOWS_KEPT:]
            self._details()
            return
        breached = [r for r in readings if r.breached]
        if breached and not s.end:
            first = breached[0]
            s.end = (
                f"guardrail {first.metric} breached by the treatment in {first.region}: "
                f"{first.value or 0:.4g} over {first.limit or 0:.4g}; all traffic back to control"
            )
            s.outcome = "guardrail"
        self._details()

    # ---- helpers ---------------------------------------------------------------------------------

    def _summary(self) -> ExperimentReport:
        """The report on the totals so far, its p-values the least over every look."""
        input, s = self._input, self._state
        return summarize(
            input.name,
            input.spec.name,
            CONTROL,
            {arm: s.totals.get(arm, SetCounters()) for arm in (CONTROL, TREATMENT)},
            {CONTROL: input.control_set.id, TREATMENT: input.treatment_set.id},
            input.alpha,
            unit=input.unit,
            metrics=input.metrics,
            least_p=s.least_p,
        )

    def _look(self) -> None:
        """Each check is a look: keep each comparison's least p-value (always-valid over looks)."""
        if self._input.mode == "shadow" or not self._state.totals:
            return
        for c in self._summary().comparisons:
            self._state.least_p[comparison_key(c.arm, c.outcome)] = c.p_value

    def _history_full(self) -> bool:
        info = workflow.info()
        return (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() >= self._input.history_limit
        )

    def _enter(self, phase: str) -> None:
        """A new phase: the search attributes (model, state, arms: what the Temporal UI lists
        experiments by) and the details say it."""
        input = self._input
        self._state.phase = phase
        workflow.upsert_search_attributes(
            [
                MODEL_KEY.value_set(input.spec.name),
                STATE_KEY.value_set(phase),
                ARMS_KEY.value_set(
                    [
                        f"control={input.control_set.id}",
                        f"{'shadow' if input.mode == 'shadow' else 'treatment'}={input.treatment_set.id}",
                    ]
                ),
            ]
        )
        self._details()

    def _details(self) -> None:
        input, s = self._input, self._state
        against = (
            f"{input.treatment_set.id} shadowing it ({input.treatment_percent:g}% of requests copied)"
            if input.mode == "shadow"
            else f"against {input.treatment_set.id} ({input.treatment_percent:g}% of units)"
        )
        lines = [
            f"**{s.phase}**: {input.control_set.id} (control) {against}",
            f"ends at {s.ends_at:%Y-%m-%d %H:%M:%S} UTC" if s.ends_at else "starting",
        ]
        if s.moves:
            lines.append(
                f"both arms moved with the model's capacity {s.moves}x (plan revision {input.plan.revision})"
            )
        for arm, counted in sorted(s.totals.items()):
            outcomes = ", ".join(
                f"{n} {t.count}: mean {t.mean() or 0:.4g}" for n, t in sorted(counted.outcomes.items())
            )
            lines.append(
                f"{arm}: {counted.requests} requests, {counted.errors} errors; "
                f"{outcomes or 'no outcomes yet'}"
            )
        if input.mode == "shadow" and s.totals:
            whole = summarize_shadow(s.totals.get(TREATMENT, SetCounters()))
            lines.append(f"shadow so far: {render_shadow(whole)}")
            if s.shadow_windows:
                lines.append(f"latest window: {render_shadow(s.shadow_windows[-1])}")
        if s.end:
            lines.append(f"end: {s.end}")
        workflow.set_current_details("\n\n".join(lines))
