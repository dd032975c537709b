"""RolloutWorkflow: move a model's traffic and capacity to a new snapshot set (or a new
placement of the same set) step by step, under gates, pausable by on-call.

Per step (the model's `rollout.steps`, default 1, 5, 25, 50, 100 percent), in lock-step:

1. scale the new set up to carry its next share (the plan's replicas scaled by the share and
   rounded up, so the plan's headroom holds) and wait until Serve reports it running;
2. shift the routers' weights: one new generation per region, no replica restarted;
3. bake on a durable timer, reading the metrics actors every `check_interval_seconds` and
   judging the gates on the window since the shift (ipnext.policy.gates.evaluate_gates). Too few
   requests by the end of the bake extend it up to 3x, then pause with `insufficient_traffic`;
   that pause is ipnext's own, so ipnext ends it once the window holds `min_requests` (a quiet
   night does not need on-call; an on-call `pause` during it takes it over and waits for `resume`);
4. scale the old set down to what its remaining share needs.

During each bake the rollout checks that Serve serves what it applied (`_check_serving`: at the
bake's start, every `serve.reconcile_seconds`, and at once when a region's counters vanish) and
pushes back what Serve lost; a repair restarts the bake on a fresh window. A check that cannot
run (Ray down, Serve starting again) holds the bake: it neither ends nor pauses for traffic
until a check runs, and that check starts a fresh window (`serving_unchecked` in the status says
why it waits). So Ray lost mid-rollout makes the rollout wait (its activities retry), then go on
where it was, never paused for a lack of traffic it could not have had.

Every region moves at once; a breach in any region rolls all of them back. Rollback (breach,
`abort`, or a failed activity) is lock-step in reverse: traffic goes back to the old set in one
weight change when the old set's current replicas can carry it at full load (else as much as
they can, then the rest once it is scaled back up), the old set returns to its full size, and
the new set's apps go last.

Signals `pause`, `resume`, `abort`, `override_freeze`; query `status`. While paused, gates are
still evaluated and a breach still rolls back; on resume the bake of the current step restarts.
Temporal's cancellation (the UI's "Request Cancellation", `temporal workflow cancel`) is an
abort: the rollout rolls back the same way, then ends `cancelled`. Only a completed rollout
completes its workflow; any other outcome fails it (the UI's red FAILED), the outcome and reason
its message, the `RolloutResult` its details (`RolloutResult.of_failure`), after the model was
told: an outcome, not a crash. A freeze window (config `freeze_calendar`) refuses the start,
and holds a running rollout at the end of its current step until the window ends; an explicit
override (reason, who), given at publish (part of the input) or by the `override_freeze`
signal, lets it go on and stays in the history.

A first rollout (nothing serves yet) has nothing to compare against: it deploys and routes all
traffic in one step.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, FailureError

with workflow.unsafe.imports_passed_through():
    from ipnext.activities import (
        RETRY,
        VALIDATE_TIMEOUT,
    )
    from ipnext.activities.serving import (
        ReadMetricsResult,
    )
    from ipnext.activities.validate import VerifyPinnedInput, verify_pinned_set
    from ipnext.contracts.freeze import FreezeOverride, FreezeWindow, active_freeze
    from ipnext.contracts.identity import attributed, caller_identity
    from ipnext.contracts.rollout import (
        FREEZE_PAUSE,
        INSUFFICIENT_TRAFFIC,
        IPNEXT,
        NEEDS_ATTENTION,
        AbortInput,
        PauseInput,
        PauseRecord,
        ResumeInput,
        RolloutEnded,
        RolloutInput,
        RolloutProgress,
        RolloutResult,
        RolloutStatus,
    )
    from ipnext.names import ModelWorkflowNames, RolloutOutcome, RolloutState, RolloutWorkflowNames
    from ipnext.policy import rollout_steps as steps
    from ipnext.policy.gates import judge_window
    from ipnext.policy.rollout_steps import Weights
    from ipnext.workflows._rollout_actions import RolloutActions, RolloutStop
    from ipnext.workflows._signals import NO_PAYLOAD, signal_input

# Runs started before a cancellation was an abort: cancelled, they end CANCELED as they did.
CANCEL_ABORTS_PATCH = "rollout-cancel-aborts"
# Runs started before a bake read its baseline ahead of its first serving check replay the old order.
BASELINE_FIRST_PATCH = "bake-baseline-first"
# Runs started before a capacity move removed a down region's apps (without waiting) replay without.
LOST_APPS_PATCH = "remove-down-regions-apps"
FAILS_VISIBLY_PATCH = "rollout-not-completed-fails"  # runs started before it complete whatever the outcome
# Runs started before a bake held its judgement of traffic while its serving check could not run
# (and started a fresh window once one ran) replay without.
UNCHECKED_WINDOW_PATCH = "bake-holds-while-serving-unchecked"
CANCELLATION = "Temporal cancellation request"  # who, on the record, for a cancel from the UI or CLI
BAKE_EXTENSION = 3  # too few requests: the bake may last up to this many times its length
FREEZE_CALENDAR = "freeze calendar"
UNKNOWN = "unknown (a signal with no readable payload)"  # who, on the record, for a bare pause or resume


class _Continue(Exception):
    """The history is long: continue as new, baking step `index` again."""

    def __init__(self, index: int) -> None:
        super().__init__(f"continue at step {index + 1}")
        self.index = index


def _counters_lost(before: ReadMetricsResult, after: ReadMetricsResult) -> bool:
    """A region whose metrics actor had counters and now has none (it is gone or new)."""
    return any(
        snapshot.get("sets") and not after.snapshots.get(region, {}).get("sets")
        for region, snapshot in before.snapshots.items()
    )


@workflow.defn
class RolloutWorkflow(RolloutActions):
    @workflow.init
    def __init__(self, input: RolloutInput) -> None:
        # With regions down (a capacity move planned without them) the rollout runs as if they
        # had never served: nothing of theirs deployed, routed, waited on or gated. Their old
        # apps are removed at the end without waiting (no node to wait on).
        self._lost = steps.lost_apps(input)
        self._input = input = steps.without_down_regions(input)
        # Derived from the input alone, so never carried over: the steps (with sync: independent,
        # every step of each changed part in turn), those parts, and the routers' weights before.
        self._steps = steps.rollout_steps(input)
        self._rolling = steps.rolling_parts(input)
        self._start: Weights = steps.start_weights(input)
        # Everything else is the one state object, carried whole when the run continues as new.
        self._progress = (
            input.progress.model_copy(deep=True)
            if input.progress is not None
            else RolloutProgress(
                traffic_percent=steps.initial_traffic(input),
                part_traffic=dict.fromkeys(self._rolling, 0.0),
                old_scales=dict.fromkeys(input.spec_of_old().parts, 1.0),
                freeze_override=input.freeze_override,
            )
        )
        self._cancel_aborts = False  # set in `run`: a patched run treats a cancellation as abort

    def _history_full(self) -> bool:
        info = workflow.info()
        return (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() >= self._input.history_limit
        )

    # ---- on-call -----------------------------------------------------------------------------

    # Signals read their payload by hand (workflows/_signals.py): none, a malformed one or a
    # second one never fails the workflow task. Pause and resume go on without a readable
    # payload, recorded as by "unknown"; abort and override_freeze need who and why on the
    # record, so without them they are refused (a warning in the worker's log).
    # Beside `who` (the payload's word) each records the signal's `ipnext-identity` header
    # (caller_identity: in the history, so replay reads the same; no command depends on it, so
    # runs from before replay unchanged); a signal without it is recorded "unattributed".

    @workflow.signal(name=RolloutWorkflowNames.PAUSE)
    def pause(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> None:
        input = signal_input(raw, PauseInput, RolloutWorkflowNames.PAUSE)
        if input is None:
            input = PauseInput(reason="a pause signal with no readable payload", who=UNKNOWN)
        identity = caller_identity()
        if self._progress.state.is_terminal:
            return
        if self._paused():
            if not self._waiting_for_traffic():
                return
            # On-call takes over ipnext's own pause: it no longer ends when traffic comes.
            p = self._progress
            p.pauses[-1] = p.pauses[-1].model_copy(
                update={"resumed_by": input.who, "resumed_at": workflow.now(), "resumed_identity": identity}
            )
        self._progress.pauses.append(
            PauseRecord(reason=input.reason, who=input.who, at=workflow.now(), identity=identity)
        )
        workflow.logger.info("rollout paused by %s: %s", attributed(input.who, identity), input.reason)
        self._enter(RolloutState.PAUSED, self._progress.step)

    @workflow.signal(name=RolloutWorkflowNames.RESUME)
    def resume(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> None:
        input = signal_input(raw, ResumeInput, RolloutWorkflowNames.RESUME) or ResumeInput(who=UNKNOWN)
        if not self._paused():
            return
        if self._progress.freeze_hold:
            workflow.logger.warning(
                "resume by %s ignored: a freeze window holds the rollout (override_freeze lets it go on)",
                input.who,
            )
            return
        identity = caller_identity()
        self._close_pause(input.who, identity)
        workflow.logger.info("rollout resumed by %s", attributed(input.who, identity))

    @workflow.signal(name=RolloutWorkflowNames.ABORT)
    def abort(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> None:
        input = signal_input(raw, AbortInput, RolloutWorkflowNames.ABORT)
        if input is None:
            workflow.logger.warning('abort refused: it needs {"reason": ..., "who": ...} as its payload')
            return
        if self._progress.state.is_terminal or self._progress.abort is not None:
            return
        self._progress.abort = input
        self._progress.abort_identity = caller_identity()
        workflow.logger.info(
            "rollout aborted by %s: %s", attributed(input.who, self._progress.abort_identity), input.reason
        )

    @workflow.signal(name=RolloutWorkflowNames.OVERRIDE_FREEZE)
    def override_freeze(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> None:
        """Go on through a freeze window (the signal, with who and why, stays in the history)."""
        input = signal_input(raw, FreezeOverride, RolloutWorkflowNames.OVERRIDE_FREEZE)
        if input is None:
            workflow.logger.warning(
                'override_freeze refused: it needs {"reason": ..., "who": ...} as its payload'
            )
            return
        if self._progress.state.is_terminal or self._progress.freeze_override is not None:
            return
        self._progress.freeze_override = input
        self._progress.freeze_override_identity = caller_identity()
        workflow.logger.warning(
            "freeze overridden by %s: %s",
            attributed(input.who, self._progress.freeze_override_identity),
            input.reason,
        )
        self._publish_details()

    @workflow.query(name=RolloutWorkflowNames.STATUS)
    def status(self) -> RolloutStatus:
        return self._status()

    # ---- the rollout -------------------------------------------------------------------------

    @workflow.run
    async def run(self, input: RolloutInput) -> RolloutResult:
        self._cancel_aborts = workflow.patched(CANCEL_ABORTS_PATCH)
        if not self._cancel_aborts:
            return await self._run_and_report(input)
        # The rollout runs in a task of its own, which Temporal's cancellation never reaches: it
        # lands here (an asyncio.CancelledError in the workflow's main task) and becomes an abort,
        # so the activity in flight finishes as it would have (a deploy or a weight change never
        # half-cancelled), and the rollout stops and rolls back where an `abort` signal would.
        rollout = asyncio.create_task(self._run_and_report(input))
        while True:
            try:
                await workflow.wait([rollout])  # unlike shield, never logs the task's own failure
                return rollout.result()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()  # caught for good: later awaits must not see it again
                self._cancel_requested()

    async def _run_and_report(self, input: RolloutInput) -> RolloutResult:
        result = await self._run(input)
        await self._report(result)
        if result.outcome != RolloutOutcome.COMPLETED and workflow.patched(FAILS_VISIBLY_PATCH):
            raise ApplicationError(
                result.failure_message(), result, type=result.failure_type(), non_retryable=True
            )
        return result

    def _cancel_requested(self) -> None:
        """Temporal's cancellation: an abort by CANCELLATION (an abort signalled before it stands)."""
        p = self._progress
        reason = workflow.cancellation_reason() or "no reason given"
        if p.state.is_terminal or p.abort is not None:
            workflow.logger.warning(
                "cancellation requested (%s): the rollout is %s%s",
                reason,
                p.state.value,
                ", already aborted" if p.abort is not None else "",
            )
            return
        p.abort = AbortInput(reason=f"cancellation requested: {reason}", who=CANCELLATION)
        p.cancelled = True
        workflow.logger.warning("rollout cancelled (%s): it rolls back as on abort", reason)
        self._publish_details()

    async def _report(self, result: RolloutResult) -> None:
        """Tell the model how this rollout ended, by a signal to its workflow id: that reaches
        the model's latest run, which may have continued as new since it started this one."""
        parent = workflow.info().parent
        if parent is None:  # started by hand, not by a model: no one to tell
            return
        model = parent.workflow_id  # no run id: the model's latest run
        ended = RolloutEnded(workflow_id=workflow.info().workflow_id, result=result)
        try:
            await workflow.get_external_workflow_handle(model).signal(ModelWorkflowNames.ROLLOUT_ENDED, ended)
        except FailureError as err:  # the model's workflow is gone (terminated): nothing to tell
            workflow.logger.warning("could not report the rollout's end to %s: %s", model, err)

    async def _run(self, input: RolloutInput) -> RolloutResult:
        p = self._progress
        try:
            if p.continued_at is None:
                window = active_freeze(await self._freeze_windows(), workflow.now())
                if window is not None and input.freeze_override is None:
                    p.detail = f"refused: freeze window until {window.end.isoformat()}: {window.reason}"
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
            await self._walk(p.continued_at)
            old = sorted(set(self._input.old_apps.values()) - set(p.new_apps.values()))
            if old:
                self._enter(RolloutState.RUNNING, "removing the old set")
                await self._remove(old)
            if self._lost and workflow.patched(LOST_APPS_PATCH):
                self._enter(RolloutState.RUNNING, f"removing the down regions' apps {', '.join(self._lost)}")
                await self._remove(self._lost, wait=False)
            if p.abort is not None and self._cancel_aborts:
                what = "a cancellation" if p.cancelled else f"an abort by {p.abort.who}"
                p.detail = f"{what} came after the last bake: too late to roll back, the rollout completed"
            self._enter(RolloutState.COMPLETED, "done")
            return self._result(p.new_apps)
        except _Continue as at:
            workflow.logger.info("rollout continues as new at step %d (history too long)", at.index + 1)
            p.continued_at = at.index
            workflow.continue_as_new(input.model_copy(update={"progress": p}))
        except RolloutStop as stop:
            p.detail = stop.detail
            await self._roll_back_or_hold()
            self._enter(stop.state, "traffic back on the previous set")
            return self._result(dict(input.old_apps))
        except ActivityError as err:
            cause = err.cause
            p.detail = cause.message if isinstance(cause, ApplicationError) else str(cause or err)
            workflow.logger.warning("rollout of %s failed: %s", input.new_set.id, p.detail)
            await self._roll_back_or_hold()
            self._enter(RolloutState.FAILED, "failed; traffic stays on the previous set")
            return self._result(dict(input.old_apps))

    async def _walk(self, resume: int | None) -> None:
        """Every step in turn: scale the new set (or, sync: independent, the moving part) up to
        the step's share, shift that share of the traffic (of the part's calls, the rest of the
        DAG staying where it was), bake under the gates, scale the old set (or part) down. With
        sync: independent the new set's unchanged parts keep one replica each until every
        changed part is at 100%; then they scale to the plan and take the traffic in one
        generation (same snapshots). `resume`: the step a continued run bakes again (its
        scaling and weights are already applied)."""
        input, p, start = self._input, self._progress, self._start
        parts = list(input.spec.parts)
        for step in self._steps:
            if resume is not None and step.index < resume:
                continue
            p.part = step.part
            what = step.part or "set"
            if step.index != resume:
                if step.index > 0 and start and self._paused():
                    # Paused between steps: hold this split, gates still judged, until resumed.
                    await self._bake(step.index - 1)
                self._stop_if_aborted()
                self._enter(self._running_or_paused(), f"{step.label}: scaling the new {what} up")
                p.new_scales = steps.new_set_scales(step, parts)
                p.new_apps = await self._deploy(input.new_set, input.plan, p.new_scales)
                self._stop_if_aborted()
                shifting = f"shifting {step.part}'s traffic" if step.part else "shifting traffic"
                self._enter(self._running_or_paused(), f"{step.label}: {shifting}")
                await self._shift(
                    step.percent, steps.cutover_weights(input, p.new_apps), step.part, step.done
                )
            if start:  # a first rollout has no old set to judge against
                self._enter(self._running_or_paused(), f"{step.label}: baking")
                await self._bake(step.index)
            p.steps_done = step.index + 1
            scales = steps.old_set_scales(step, p.old_scales)
            if start and scales is not None:
                self._enter(self._running_or_paused(), f"{step.label}: scaling the old {what} down")
                p.old_scales = scales
                await self._deploy(self._old_set(), self._old_plan(), scales)
        if self._rolling:
            p.part = None
            unchanged = [part for part in parts if part not in self._rolling]
            self._enter(RolloutState.RUNNING, f"handing over {', '.join(unchanged) or 'the set'}")
            p.new_scales = dict.fromkeys(parts, 1.0)
            p.new_apps = await self._deploy(input.new_set, input.plan, p.new_scales)
            await self._route(steps.cutover_weights(input, p.new_apps))

    async def _bake(self, index: int) -> None:
        """Hold the step for its bake, judging the gates every check interval; raise RolloutStop on a
        breach or an abort. Returns once the bake ran its length unpaused, with enough requests,
        and no freeze window is in force (or one is overridden)."""
        input, p = self._input, self._progress
        rollout = input.spec.rollout
        # Every router that sends the model traffic counts requests, including a region whose
        # router hands over to another region's apps (the metrics actors are per router region).
        routers = set(self._start) | set(steps.cutover_weights(input, p.new_apps))
        regions = sorted(routers | set(input.old_apps) | set(p.new_apps))
        new_apps = set(p.new_apps.values())
        old_apps = set(input.old_apps.values()) - new_apps
        interval = timedelta(seconds=rollout.check_interval_seconds)
        bake = timedelta(seconds=rollout.bake_seconds)
        frozen: FreezeWindow | None = None
        if p.freeze_hold:  # a continued run, held by a freeze window: its end still ends it
            frozen = active_freeze(await self._freeze_windows(), workflow.now())
            if frozen is None:
                p.freeze_hold = False
                self._close_pause(FREEZE_CALENDAR)
        # A window Serve could not be checked in says nothing of the new set (Ray down, Serve
        # starting again): runs from before this rule paused it for traffic it never had.
        holds = workflow.patched(UNCHECKED_WINDOW_PATCH)
        if workflow.patched(BASELINE_FIRST_PATCH):
            # The window's first read, then the serving check: counters lost after the read are
            # seen by the next read (`_counters_lost`), lost before it by this check, which
            # repairs and takes the read again. Checked first, a loss in between went unseen
            # until the next interval.
            baseline = await self._read_metrics(regions)
            wait, fresh = await self._check_window(holds)
            next_check = workflow.now() + wait
            if fresh:
                baseline = await self._read_metrics(regions)
        else:
            next_check = workflow.now() + await self._check_serving()
            baseline = await self._read_metrics(regions)
        last = baseline
        started, resumes = workflow.now(), p.resumes
        while True:
            await self._wait(interval, resumes)
            if workflow.now() >= next_check and p.abort is None:
                wait, fresh = await self._check_window(holds)
                next_check = workflow.now() + wait
                if fresh:
                    baseline = last = await self._read_metrics(regions)
                    started = workflow.now()
                    continue
            if p.abort is not None:
                raise self._aborted()
            if p.resumes != resumes:  # resumed: the bake of this step starts again
                baseline = await self._read_metrics(regions)
                started, resumes = workflow.now(), p.resumes
                continue
            if self._history_full():  # a long bake or pause: go on in a fresh run
                raise _Continue(index)
            now = await self._read_metrics(regions)
            if _counters_lost(last, now):
                # A region's counters vanished (Ray came back empty, or its metrics actor was
                # lost): check Serve now, not at the next interval; a repair restarts the window.
                wait, fresh = await self._check_window(holds)
                next_check = workflow.now() + wait
                if fresh:
                    baseline = last = await self._read_metrics(regions)
                    started = workflow.now()
                    continue
            last = now
            p.gates, requests = judge_window(
                rollout.gates,
                rollout.min_requests,
                regions,
                baseline.snapshots,
                now.snapshots,
                new_apps,
                old_apps,
            )
            self._publish_details()  # the readings are news: the status is as of now
            breached = [r.describe() for r in p.gates if r.breached]
            if breached:
                raise RolloutStop(RolloutState.ROLLED_BACK, "gate breached: " + "; ".join(breached))
            if frozen is not None:
                if workflow.now() < frozen.end and p.freeze_override is None:
                    continue
                frozen = None
                p.freeze_hold = False
                self._close_pause(FREEZE_CALENDAR if p.freeze_override is None else p.freeze_override.who)
                continue  # the close counts as a resume: the bake restarts
            if self._paused():
                if not (self._waiting_for_traffic() and requests >= rollout.min_requests):
                    continue
                self._close_pause(IPNEXT)  # the traffic came: the window since the shift is judged
                resumes = p.resumes
                workflow.logger.info("rollout resumed by ipnext: %d requests on the new set", requests)
            if holds and p.serving_unchecked:
                continue  # neither done nor short of traffic: Serve is not known to serve the window
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
            if index + 1 < len(self._steps) and p.freeze_override is None:
                window = active_freeze(await self._freeze_windows(), workflow.now())
                if window is not None:
                    frozen = window
                    p.freeze_hold = True
                    self._pause_by_ipnext(f"{FREEZE_PAUSE}{window.reason}", f"until {window.end.isoformat()}")
                    continue
            return

    async def _check_window(self, holds: bool) -> tuple[timedelta, bool]:
        """The serving check of a bake: when to check again, and whether the bake's window starts
        afresh. It does when the check repaired (Serve had lost some of what was applied; the
        counters went with it) and, with `holds`, when it ran after one that could not: the
        window since counted traffic Serve was not known to serve."""
        p = self._progress
        before, unchecked = p.repairs, p.serving_unchecked
        wait = await self._check_serving()
        repaired = p.repairs != before
        recovered = holds and bool(unchecked) and not p.serving_unchecked
        if recovered and not repaired:
            workflow.logger.info("rollout serving check runs again (the bake starts again): %s", unchecked)
        return wait, repaired or recovered

    async def _roll_back_or_hold(self) -> None:
        """Roll back; when that cannot complete, hold where the traffic is, paused by ipnext with
        `needs_attention` and why, until on-call resumes, which tries the rollback again. It
        cannot complete when its target (the old set) fails its checksum in the pinned store
        (scaled back up, it would serve other bytes than were validated, or nothing), or when an
        activity of it fails for good (Serve refuses the old set). Never a failed rollout: the
        model keeps waiting on it, and on-call sees why in its status."""
        p = self._progress
        while True:
            problem = await self._rollback_blocker()
            if problem is None:
                try:
                    await self._roll_back()
                    return
                except ActivityError as err:
                    cause = err.cause
                    problem = "the rollback failed: " + (
                        cause.message if isinstance(cause, ApplicationError) else str(cause or err)
                    )
            why = p.detail  # the breach, abort or failure that called for the rollback
            self._pause_by_ipnext(
                NEEDS_ATTENTION,
                f"{problem}; traffic held where it is: fix it, then `resume` retries the rollback",
            )
            await self._until_resumed(p.resumes)
            p.detail = why

    async def _until_resumed(self, resumes: int) -> None:
        await workflow.wait_condition(lambda: self._progress.resumes != resumes)

    async def _rollback_blocker(self) -> str | None:
        """Why the old set may not take the traffic back (None: it may)."""
        old = self._input.old_set
        if old is None or not self._start:  # a first rollout: nothing to return to
            return None
        checked = await workflow.execute_activity(
            verify_pinned_set,
            VerifyPinnedInput(snapshot_set=old),
            start_to_close_timeout=VALIDATE_TIMEOUT,
            heartbeat_timeout=VALIDATE_TIMEOUT,
            retry_policy=RETRY,
            summary=f"may {old.id} take the traffic back?",
        )
        if not checked.problems:
            return None
        return f"the rollback target {old.id} fails its checksum ({'; '.join(checked.problems)})"

    async def _roll_back(self) -> None:
        """Traffic back to the old set as fast as its capacity allows, the old set back to its
        full size, the new set's apps removed last."""
        input, p, start = self._input, self._progress, self._start
        if not start:  # nothing served before: just remove what was deployed
            if p.new_apps:
                await self._remove(sorted(p.new_apps.values()))
            self._set_traffic(0.0)
            return
        self._enter(RolloutState.RUNNING, "rolling back")
        old_plan = self._old_plan()
        end = steps.cutover_weights(input, p.new_apps) if p.new_apps else start
        # The moving part (or the whole set) first, as far as its old replicas carry it; parts
        # already at 100% (sync: independent) wait for their old replicas to scale back up.
        part = p.part
        moving = p.part_traffic.get(part, 0.0) if part is not None else 0.0 if self._rolling else p.percent
        if moving > 0:
            only = {f"{input.spec.name}/{part}"} if part is not None else None
            back = steps.rollback_percent(old_plan, input.spec.availability.headroom, p.old_scales, only)
            if back < moving:
                done = self._rolling[: self._rolling.index(part)] if part is not None else []
                await self._shift(back, end, part, done)
        if min(p.old_scales.values()) < 1.0 and input.old_set is not None:
            await self._deploy(input.old_set, old_plan, dict.fromkeys(p.old_scales, 1.0))
            p.old_scales = dict.fromkeys(p.old_scales, 1.0)
        if p.percent > 0:
            await self._route(start)
            p.part_traffic = dict.fromkeys(p.part_traffic, 0.0)
            self._set_traffic(0.0)
        removable = sorted(set(p.new_apps.values()) - set(input.old_apps.values()))
        if removable:
            await self._remove(removable)
