"""RolloutWorkflow: move a model's traffic and capacity to a new snapshot set (or a new
placement of the same set) step by step, under gates, pausable by on-call.

Per step (the model's `rollout.steps`, default 1, 5, 25, 50, 100 percent), in lock-step:

1. scale the new set up to carry its next share (the plan's replicas scaled by the share and
   rounded up, so the plan's headroom holds) and wait until Serve reports it running;
2. shift the routers' weights: one new generation per region, no replica restarted;
3. bake on a durable timer, reading the metrics actors every `check_interval_seconds` and
   judging the gates on the window since the shift (ipnext.rollout.evaluate_gates). Too few
   requests by the end of the bake extend it up to 3x, then pause with `insufficient_traffic`;
4. scale the old set down to what its remaining share needs.

Every region moves at once; a breach in any region rolls all of them back. Rollback (breach,
`abort`, or a failed activity) is lock-step in reverse: traffic goes back to the old set in one
weight change when the old set's current replicas can carry it at full load (else as much as
they can, then the rest once it is scaled back up), the old set returns to its full size, and
the new set's apps go last.

Signals `pause`, `resume`, `abort`, `override_freeze`; query `status`. While paused, gates are still evaluated and
a breach still rolls back; on resume the bake of the current step restarts. A freeze window
(config `freeze_calendar`) refuses the start, and holds a running rollout at the end of its
current step until the window ends; an explicit override (reason, who), given at publish (part
of the input) or by the `override_freeze` signal, lets it go on and stays in the history.

A first rollout (nothing serves yet) has nothing to compare against: it deploys and routes all
traffic in one step.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from ipnext.activities import DEPLOY_TIMEOUT, HEARTBEAT_TIMEOUT, QUICK_TIMEOUT, RETRY
    from ipnext.activities.freeze import FreezeWindowsResult, freeze_windows
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
    from ipnext.model import SnapshotSet
    from ipnext.plan import Plan
    from ipnext.registry import RolloutCheckpoint, RolloutInput, RolloutResult
    from ipnext.rollout import (
        AbortInput,
        FreezeOverride,
        FreezeWindow,
        GateReading,
        PauseInput,
        PauseRecord,
        ResumeInput,
        RolloutState,
        RolloutStatus,
        active_freeze,
        evaluate_gates,
        mix_weights,
        scaled_replicas,
        window_counters,
    )
    from ipnext.temporal import MODEL_KEY, STATE_KEY, TRAFFIC_KEY

BAKE_EXTENSION = 3  # too few requests: the bake may last up to this many times its length
INSUFFICIENT_TRAFFIC = "insufficient_traffic"
FREEZE_CALENDAR = "freeze calendar"

Weights = dict[str, dict[str, float]]  # region -> set app -> percent
PartWeights = dict[str, dict[str, dict[str, float]]]  # region -> part -> set app -> percent
# A part that does not move yet keeps one replica per (region, hardware) on the other set.
IDLE_SHARE = 1e-6


class _Stop(Exception):
    """The rollout must reverse: a gate breached, or on-call aborted."""

    def __init__(self, state: RolloutState, detail: str) -> None:
        super().__init__(detail)
        self.state = state
        self.detail = detail


class _Continue(Exception):
    """The history is long: continue as new, baking step `index` again."""

    def __init__(self, index: int) -> None:
        super().__init__(f"continue at step {index + 1}")
        self.index = index


@workflow.defn
class RolloutWorkflow:
    @workflow.init
    def __init__(self, input: RolloutInput) -> None:
        self._input = input
        self._state = RolloutState.PENDING
        self._step = "pending"
        old_id = input.old_set.id if input.old_set else None
        self._traffic: dict[str, float] = {input.new_set.id: 0.0}
        if old_id and old_id != input.new_set.id:
            self._traffic[old_id] = 100.0
        self._generations: list[int] = []
        self._detail = ""
        self._gradual = _gradual(input)
        gradual = self._gradual
        self._steps: list[int] = list(input.spec.rollout.steps) if gradual else [100]
        self._steps_done = 0
        self._percent = 0.0
        self._gates: list[GateReading] = []
        self._pauses: list[PauseRecord] = []
        self._abort: AbortInput | None = None
        self._resumes = 0  # counts resumes: a bake restarts when it changes
        self._override: FreezeOverride | None = input.freeze_override
        self._freeze_hold = False  # paused by a freeze window: only its end or an override ends it
        # sync: independent moves each changed part on its own, one after another, each through
        # all the steps; the parts that did not change follow in one handover at the end.
        self._rolling = _rolling_parts(input) if gradual else []
        if self._rolling:
            self._steps = self._steps * len(self._rolling)
        self._part: str | None = None  # the part moving now (independent)
        self._part_traffic: dict[str, float] = dict.fromkeys(self._rolling, 0.0)
        self._start: Weights = (
            {region: {app: 100.0} for region, app in input.old_apps.items()} if gradual else {}
        )
        self._new_apps: dict[str, str] = {}
        self._old_scales: dict[str, float] = dict.fromkeys(input.spec.parts, 1.0)
        if input.checkpoint is not None:
            self._restore(input.checkpoint)

    def _restore(self, checkpoint: RolloutCheckpoint) -> None:
        self._state = RolloutState.PAUSED if checkpoint.paused else RolloutState.RUNNING
        self._step = checkpoint.step
        self._steps_done = checkpoint.steps_done
        self._freeze_hold = checkpoint.freeze_hold
        self._new_apps = dict(checkpoint.new_apps)
        self._old_scales = dict(checkpoint.old_scales)
        self._percent = checkpoint.percent
        self._traffic = dict(checkpoint.traffic)
        self._part_traffic.update(checkpoint.part_traffic)
        self._generations = list(checkpoint.generations)
        self._gates = list(checkpoint.gates)
        self._pauses = list(checkpoint.pauses)
        self._abort = checkpoint.abort
        self._detail = checkpoint.detail

    def _checkpointed(self, index: int) -> RolloutInput:
        checkpoint = RolloutCheckpoint(
            index=index,
            steps_done=self._steps_done,
            step=self._step,
            paused=self._paused(),
            freeze_hold=self._freeze_hold,
            new_apps=self._new_apps,
            old_scales=self._old_scales,
            percent=self._percent,
            traffic=self._traffic,
            part_traffic=self._part_traffic,
            generations=self._generations,
            gates=self._gates,
            pauses=self._pauses,
            abort=self._abort,
            detail=self._detail,
        )
        return self._input.model_copy(update={"checkpoint": checkpoint, "freeze_override": self._override})

    def _history_full(self) -> bool:
        info = workflow.info()
        return (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() >= self._input.history_limit
        )

    # ---- on-call -----------------------------------------------------------------------------

    @workflow.signal
    def pause(self, input: PauseInput) -> None:
        if self._finished() or self._paused():
            return
        self._pauses.append(PauseRecord(reason=input.reason, who=input.who, at=workflow.now()))
        workflow.logger.info("rollout paused by %s: %s", input.who, input.reason)
        self._enter(RolloutState.PAUSED, self._step)

    @workflow.signal
    def resume(self, input: ResumeInput) -> None:
        if not self._paused():
            return
        if self._freeze_hold:
            workflow.logger.warning(
                "resume by %s ignored: a freeze window holds the rollout (override_freeze lets it go on)",
                input.who,
            )
            return
        self._close_pause(input.who)
        workflow.logger.info("rollout resumed by %s", input.who)

    @workflow.signal
    def abort(self, input: AbortInput) -> None:
        if self._finished() or self._abort is not None:
            return
        self._abort = input
        workflow.logger.info("rollout aborted by %s: %s", input.who, input.reason)

    @workflow.signal
    def override_freeze(self, input: FreezeOverride) -> None:
        """Go on through a freeze window (the signal, with who and why, stays in the history)."""
        if self._finished() or self._override is not None:
            return
        self._override = input
        workflow.logger.warning("freeze overridden by %s: %s", input.who, input.reason)
        self._publish_details()

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
            workflow_id=workflow.info().workflow_id,
            steps=list(self._steps),
            steps_done=self._steps_done,
            gates=list(self._gates),
            pauses=list(self._pauses),
            freeze_override=self._override,
            part=self._part,
            part_traffic=dict(self._part_traffic),
        )

    # ---- the rollout -------------------------------------------------------------------------

    @workflow.run
    async def run(self, input: RolloutInput) -> RolloutResult:
        resume = input.checkpoint.index if input.checkpoint is not None else None
        try:
            if input.checkpoint is None:
                window = active_freeze(await self._freeze_windows(), workflow.now())
                if window is not None and input.freeze_override is None:
                    self._detail = f"refused: freeze window until {window.end.isoformat()}: {window.reason}"
                    self._enter(RolloutState.REFUSED, "not started")
                    return self._result(dict(input.old_apps))
                if window is not None and input.freeze_override is not None:
                    override = input.freeze_override
                    workflow.logger.warning(
                        "freeze %r overridden by %s: %s", window.reason, override.who, override.reason
                    )
                self._enter(RolloutState.RUNNING, "starting")
                await self._hold_while_paused()
            else:
                self._publish_all()
            if self._rolling:
                await self._walk_parts(resume)
            else:
                await self._walk_set(resume)
            old = sorted(set(input.old_apps.values()) - set(self._new_apps.values()))
            if old:
                self._enter(RolloutState.RUNNING, "removing the old set")
                await self._remove(old)
            self._enter(RolloutState.COMPLETED, "done")
            return self._result(self._new_apps)
        except _Continue as at:
            workflow.logger.info("rollout continues as new at step %d (history too long)", at.index + 1)
            workflow.continue_as_new(self._checkpointed(at.index))
        except _Stop as stop:
            self._detail = stop.detail
            await self._roll_back()
            self._enter(stop.state, "traffic back on the previous set")
            return self._result(dict(input.old_apps))
        except ActivityError as err:
            cause = err.cause
            self._detail = cause.message if isinstance(cause, ApplicationError) else str(cause or err)
            workflow.logger.warning("rollout of %s failed: %s", input.new_set.id, self._detail)
            await self._roll_back()
            self._enter(RolloutState.FAILED, "failed; traffic stays on the previous set")
            return self._result(dict(input.old_apps))

    async def _walk_set(self, resume: int | None) -> None:
        """The whole set moves at each step (sync: synchronized, and capacity moves). `resume`:
        the step a continued run bakes again (its scaling and weights are already applied)."""
        input, start = self._input, self._start
        for index, percent in enumerate(self._steps):
            if resume is not None and index < resume:
                continue
            label = f"step {index + 1}/{len(self._steps)} ({percent}%)"
            if index != resume:
                if index > 0 and start and self._paused():
                    # Paused between steps: hold this split, gates still judged, until resumed.
                    await self._bake(self._new_apps, index - 1)
                self._enter(self._running_or_paused(), f"{label}: scaling the new set up")
                self._new_apps = await self._deploy(input.new_set, input.plan, percent / 100)
                end = _cutover_weights(input, self._new_apps)
                self._enter(self._running_or_paused(), f"{label}: shifting traffic")
                await self._route(mix_weights(start, end, percent) if start else end)
                self._set_traffic(percent)
            if start:  # a first rollout has no old set to judge against
                self._enter(self._running_or_paused(), f"{label}: baking")
                await self._bake(self._new_apps, index)
            self._steps_done = index + 1
            if start and percent < 100:
                self._enter(self._running_or_paused(), f"{label}: scaling the old set down")
                self._old_scales = dict.fromkeys(input.spec.parts, (100 - percent) / 100)
                await self._deploy(input.old_set, self._old_plan(), 1.0, self._old_scales)

    async def _walk_parts(self, resume: int | None) -> None:
        """sync: independent. Each changed part, in DAG order, walks all the steps on its own:
        its new replicas scale to the step's share, the routers call that part on the new set
        for that share of requests (the rest of the DAG stays where it was), the gates judge
        the requests that reached it, and its old replicas scale down. The new set's other
        parts keep one replica each until the handover: once every changed part is at 100%,
        they scale to the plan and take the traffic in one generation (same snapshots)."""
        input, start = self._input, self._start
        steps = list(input.spec.rollout.steps)
        done: list[str] = []
        index = -1
        for part in self._rolling:
            for number, percent in enumerate(steps, start=1):
                index += 1
                if resume is not None and index < resume:
                    continue
                self._part = part
                label = f"{part} step {number}/{len(steps)} ({percent}%)"
                if index != resume:
                    if index > 0 and self._paused():
                        await self._bake(self._new_apps, index - 1)
                    self._enter(self._running_or_paused(), f"{label}: scaling the new {part} up")
                    new_scales = {p: 1.0 if p in done else IDLE_SHARE for p in input.spec.parts}
                    new_scales[part] = percent / 100
                    self._new_apps = await self._deploy(input.new_set, input.plan, 1.0, new_scales)
                    end = _cutover_weights(input, self._new_apps)
                    self._enter(self._running_or_paused(), f"{label}: shifting {part}'s traffic")
                    await self._route(start, _part_weights(start, end, done, part, percent), part)
                    self._set_part_traffic(part, percent)
                self._enter(self._running_or_paused(), f"{label}: baking")
                await self._bake(self._new_apps, index)
                self._steps_done = index + 1
                self._enter(self._running_or_paused(), f"{label}: scaling the old {part} down")
                # At 100% the old replicas of the part idle until the set is removed: keep one.
                self._old_scales[part] = (100 - percent) / 100 if percent < 100 else IDLE_SHARE
                await self._deploy(input.old_set, self._old_plan(), 1.0, self._old_scales)
            done.append(part)
        self._part = None
        unchanged = [p for p in input.spec.parts if p not in self._rolling]
        self._enter(RolloutState.RUNNING, f"handing over {', '.join(unchanged) or 'the set'}")
        self._new_apps = await self._deploy(input.new_set, input.plan, 1.0)
        await self._route(_cutover_weights(input, self._new_apps))

    async def _bake(self, new_apps: dict[str, str], index: int) -> None:
        """Hold the step for its bake, judging the gates every check interval; raise _Stop on a
        breach or an abort. Returns once the bake ran its length unpaused, with enough requests,
        and no freeze window is in force (or one is overridden)."""
        rollout = self._input.spec.rollout
        # Every router that sends the model traffic counts requests, including a region whose
        # router hands over to another region's apps (the metrics actors are per router region).
        routers = set(self._start) | set(_cutover_weights(self._input, new_apps))
        regions = sorted(routers | set(self._input.old_apps) | set(new_apps))
        new_set = set(new_apps.values())
        old_set = set(self._input.old_apps.values()) - new_set
        interval = timedelta(seconds=rollout.check_interval_seconds)
        bake = timedelta(seconds=rollout.bake_seconds)
        frozen: FreezeWindow | None = None
        if self._freeze_hold:  # a continued run, held by a freeze window: its end still ends it
            frozen = active_freeze(await self._freeze_windows(), workflow.now())
            if frozen is None:
                self._freeze_hold = False
                self._close_pause(FREEZE_CALENDAR)
        baseline = await self._read_metrics(regions)
        started, resumes = workflow.now(), self._resumes
        while True:
            await self._wait(interval, resumes)
            if self._abort is not None:
                raise _Stop(RolloutState.ABORTED, f"aborted by {self._abort.who}: {self._abort.reason}")
            if self._resumes != resumes:  # resumed: the bake of this step starts again
                baseline = await self._read_metrics(regions)
                started, resumes = workflow.now(), self._resumes
                continue
            if self._history_full():  # a long bake or pause: go on in a fresh run
                raise _Continue(index)
            now = await self._read_metrics(regions)
            requests = 0
            readings: list[GateReading] = []
            for region in regions:
                new = window_counters(baseline.snapshots.get(region), now.snapshots.get(region, {}), new_set)
                old = window_counters(baseline.snapshots.get(region), now.snapshots.get(region, {}), old_set)
                readings += evaluate_gates(rollout.gates, region, new, old, rollout.min_requests)
                requests += new.requests
            self._gates = readings
            breached = [r for r in readings if r.breached]
            if breached:
                raise _Stop(RolloutState.ROLLED_BACK, "gate breached: " + "; ".join(map(_describe, breached)))
            if frozen is not None:
                if workflow.now() < frozen.end and self._override is None:
                    continue
                frozen = None
                self._freeze_hold = False
                self._close_pause(FREEZE_CALENDAR if self._override is None else self._override.who)
                continue  # the close counts as a resume: the bake restarts
            if self._paused():
                continue
            elapsed = workflow.now() - started
            if elapsed < bake:
                continue
            if requests < rollout.min_requests:
                if elapsed < bake * BAKE_EXTENSION:
                    continue
                self._pause_by_ipnext(
                    INSUFFICIENT_TRAFFIC,
                    f"{requests} requests on the new set in {elapsed.total_seconds():.0f} s "
                    f"(min_requests {rollout.min_requests})",
                )
                continue
            if index + 1 < len(self._steps) and self._override is None:
                window = active_freeze(await self._freeze_windows(), workflow.now())
                if window is not None:
                    frozen = window
                    self._freeze_hold = True
                    self._pause_by_ipnext(f"freeze: {window.reason}", f"until {window.end.isoformat()}")
                    continue
            return

    async def _roll_back(self) -> None:
        """Traffic back to the old set as fast as its capacity allows, the old set back to its
        full size, the new set's apps removed last."""
        input, start, new_apps = self._input, self._start, self._new_apps
        if not start:  # nothing served before: just remove what was deployed
            if new_apps:
                await self._remove(sorted(new_apps.values()))
            self._set_traffic(0.0)
            return
        self._enter(RolloutState.RUNNING, "rolling back")
        headroom = input.spec.availability.headroom
        old_plan = self._old_plan()
        end = _cutover_weights(input, new_apps) if new_apps else start
        if self._rolling and self._part is not None and self._part_traffic.get(self._part, 0) > 0:
            # The moving part first, as far as its old replicas carry it; parts already at 100%
            # wait for their old replicas to scale back up.
            part = self._part
            carry = _carried_share(old_plan, headroom, self._old_scales, {f"{input.spec.name}/{part}"})
            back = max(0.0, 100.0 - 100.0 * carry)
            if back < self._part_traffic[part]:
                done = self._rolling[: self._rolling.index(part)]
                await self._route(start, _part_weights(start, end, done, part, back), part)
                self._set_part_traffic(part, back)
        elif not self._rolling and self._percent > 0:
            back = max(0.0, 100.0 - 100.0 * _carried_share(old_plan, headroom, self._old_scales))
            if back < self._percent:
                await self._route(mix_weights(start, end, back) if back > 0 else start)
                self._set_traffic(back)
        if min(self._old_scales.values()) < 1.0 and input.old_set is not None:
            await self._deploy(input.old_set, old_plan, 1.0)
            self._old_scales = dict.fromkeys(self._old_scales, 1.0)
        if self._percent > 0:
            await self._route(start)
            for part in self._part_traffic:
                self._part_traffic[part] = 0.0
            self._set_traffic(0.0)
        removable = sorted(set(new_apps.values()) - set(input.old_apps.values()))
        if removable:
            await self._remove(removable)

    def _old_plan(self) -> Plan:
        return self._input.old_plan or self._input.plan

    # ---- pauses --------------------------------------------------------------------------------

    async def _hold_while_paused(self) -> None:
        await workflow.wait_condition(lambda: not self._paused() or self._abort is not None)
        if self._abort is not None:
            raise _Stop(RolloutState.ABORTED, f"aborted by {self._abort.who}: {self._abort.reason}")

    def _pause_by_ipnext(self, reason: str, detail: str) -> None:
        self._pauses.append(PauseRecord(reason=reason, who="ipnext", at=workflow.now()))
        self._detail = f"paused: {reason} ({detail})"
        workflow.logger.warning("rollout paused: %s (%s)", reason, detail)
        self._enter(RolloutState.PAUSED, self._step)

    def _close_pause(self, who: str) -> None:
        last = self._pauses[-1]
        self._pauses[-1] = last.model_copy(update={"resumed_by": who, "resumed_at": workflow.now()})
        self._resumes += 1
        self._detail = ""
        self._enter(RolloutState.RUNNING, self._step)

    def _paused(self) -> bool:
        return self._state == RolloutState.PAUSED

    def _finished(self) -> bool:
        return self._state in (
            RolloutState.COMPLETED,
            RolloutState.ABORTED,
            RolloutState.ROLLED_BACK,
            RolloutState.FAILED,
            RolloutState.REFUSED,
        )

    def _running_or_paused(self) -> RolloutState:
        return RolloutState.PAUSED if self._paused() else RolloutState.RUNNING

    async def _wait(self, interval: timedelta, resumes: int) -> None:
        """One check interval, cut short by an abort or a resume."""
        try:
            await workflow.wait_condition(
                lambda: self._abort is not None or self._resumes != resumes, timeout=interval
            )
        except TimeoutError:
            pass

    # ---- activities ----------------------------------------------------------------------------

    async def _deploy(
        self,
        snapshot_set: SnapshotSet | None,
        plan: Plan,
        scale: float,
        part_scales: dict[str, float] | None = None,
    ) -> dict[str, str]:
        assert snapshot_set is not None
        shares = dict(part_scales or {})
        if shares and len(set(shares.values())) == 1 and set(shares) == set(self._input.spec.parts):
            scale, shares = next(iter(shares.values())), {}  # one share for every part
        sizes = ", ".join(f"{p} {v:.0%}" for p, v in sorted(shares.items())) or f"{scale:.0%}"
        deployed = await workflow.execute_activity(
            deploy_set_apps,
            DeploySetInput(
                spec=self._input.spec, snapshot_set=snapshot_set, plan=plan, scale=scale, part_scales=shares
            ),
            start_to_close_timeout=DEPLOY_TIMEOUT,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
            retry_policy=RETRY,
            summary=f"{snapshot_set.id} at {sizes} of plan revision {plan.revision}",
        )
        return dict(deployed.apps)

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
            ),
            start_to_close_timeout=DEPLOY_TIMEOUT,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
            retry_policy=RETRY,
            summary="apply router weights",
        )
        for generation in sorted(set(result.generations.values())):
            if generation not in self._generations:
                self._generations.append(generation)

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

    async def _remove(self, names: list[str]) -> None:
        await workflow.execute_activity(
            remove_apps,
            RemoveAppsInput(names=names),
            start_to_close_timeout=QUICK_TIMEOUT * 4,
            retry_policy=RETRY,
            summary=f"remove {', '.join(names)}",
        )

    # ---- visibility ----------------------------------------------------------------------------

    def _result(self, apps: dict[str, str]) -> RolloutResult:
        return RolloutResult(
            state=self._state,
            apps=apps,
            generations=self._generations,
            detail=self._detail,
            status=self.status(),
        )

    def _set_part_traffic(self, part: str, percent: float) -> None:
        """sync: independent: a part's share on the new set; the set's traffic percent is the
        mean over the changed parts, so it rises step by step to 100 and never falls back."""
        self._part_traffic[part] = percent
        self._set_traffic(sum(self._part_traffic.values()) / len(self._part_traffic))

    def _set_traffic(self, percent: float) -> None:
        self._percent = percent
        if self._input.old_set is not None and self._input.old_set.id == self._input.new_set.id:
            self._traffic = {self._input.new_set.id: 100.0}  # a capacity move: one set serves
        else:
            self._traffic[self._input.new_set.id] = percent
            if self._input.old_set:
                self._traffic[self._input.old_set.id] = 100.0 - percent
        workflow.upsert_search_attributes([TRAFFIC_KEY.value_set(round(percent))])
        self._publish_details()

    def _enter(self, state: RolloutState, step: str) -> None:
        changed = state != self._state
        self._state = state
        self._step = step
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
                STATE_KEY.value_set(self._state.value),
                TRAFFIC_KEY.value_set(round(self._percent)),
            ]
        )
        self._publish_details()

    def _publish_details(self) -> None:
        split = ", ".join(f"{k}: {v:g}%" for k, v in sorted(self._traffic.items()))
        lines = [
            f"**{self._state.value}**: {self._step}",
            f"steps done: {self._steps_done}/{len(self._steps)} of {self._steps}",
            f"traffic: {split}",
            *([f"parts on the new set: {_split(self._part_traffic)}"] if self._rolling else []),
            f"generations applied: {self._generations or 'none'}",
        ]
        if self._gates:
            lines.append("gates: " + "; ".join(_describe(r) for r in self._gates))
        if self._pauses and self._paused():
            last = self._pauses[-1]
            lines.append(f"paused by {last.who}: {last.reason}")
        if self._override is not None:
            o = self._override
            lines.append(f"freeze override by {o.who}: {o.reason}")
        if self._detail:
            lines.append(self._detail)
        workflow.set_current_details("\n\n".join(lines))


def _gradual(input: RolloutInput) -> bool:
    """Step by step, unless nothing serves yet or a capacity move keeps the same apps (replica
    counts change in place: nothing to move traffic between)."""
    if input.old_set is None or not input.old_apps:
        return False
    old_plan = input.old_plan or input.plan
    return not (input.old_set.id == input.new_set.id and old_plan.revision == input.plan.revision)


def _describe(r: GateReading) -> str:
    value = "n/a" if r.value is None else f"{r.value:.4g}"
    limit = "n/a" if r.limit is None else f"{r.limit:.4g}"
    mark = "BREACH" if r.breached else ("ok" if r.judged else "waiting")
    return f"{r.region} {r.metric} {value} (limit {limit}, {r.requests} req) {mark}"


def _carried_share(
    plan: Plan, headroom: float, scales: dict[str, float], only: set[str] | None = None
) -> float:
    """The share of the model's traffic the old set's replicas, each part at its scale, carry at
    full load (1.0 or more: all of it), over the plan's deployments (`only` those, if given).
    The plan sizes replicas for all traffic at (1 - headroom) load."""
    shares = []
    for name, placement in plan.deployments.items():
        if only is not None and name not in only:
            continue
        scale = scales.get(name.split("/", 1)[-1], 1.0)
        full = sum(n for by_hw in placement.replicas.values() for n in by_hw.values())
        now = sum(scaled_replicas(n, scale) for by_hw in placement.replicas.values() for n in by_hw.values())
        if full:
            shares.append(now / full / max(1e-9, 1 - headroom))
    return min(shares) if shares else 1.0


def _cutover_weights(input: RolloutInput, new_apps: dict[str, str]) -> Weights:
    """Router weights once the new set (or placement) takes all traffic: each serving region's
    router to its new app, and the router of every other region the model's traffic comes from
    (or that served before) to the app of the region that takes its traffic, so callers of its
    URL keep getting answers."""
    weights = {region: {app: 100.0} for region, app in new_apps.items()}
    sources = {s for p in input.plan.deployments.values() for s in p.fractions}
    for region in sorted((sources | set(input.old_apps)) - set(new_apps)):
        targets = sorted(
            t for p in input.plan.deployments.values() if (t := p.serving_region(region)) in new_apps
        )
        if targets:
            weights[region] = {new_apps[targets[0]]: 100.0}
    return weights


def _split(percents: dict[str, float]) -> str:
    return ", ".join(f"{k}: {v:g}%" for k, v in percents.items())


def _rolling_parts(input: RolloutInput) -> list[str]:
    """sync: independent: the parts whose snapshot changed, in DAG order (each rolls on its own)."""
    old = input.old_set
    if input.spec.sync != "independent" or old is None or old.id == input.new_set.id:
        return []
    return [
        part
        for part in input.spec.topological_order()
        if part in input.new_set.parts
        and (part not in old.parts or old.parts[part].snapshot_id != input.new_set.parts[part].snapshot_id)
    ]


def _part_weights(start: Weights, end: Weights, done: list[str], part: str, percent: float) -> PartWeights:
    """Per region: the parts already moved at `end`, and `part` `percent` of the way there."""
    mixed = mix_weights(start, end, percent)
    return {
        region: {**{d: dict(end.get(region, start[region])) for d in done}, part: mixed[region]}
        for region in sorted(set(start) | set(end))
        if region in mixed
    }
