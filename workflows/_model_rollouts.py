"""A model's rollouts, for ModelWorkflow: the newest queued set rolled out (older ones
superseded), a replanned placement moved to as a capacity move (tried again after a failure),
the child RolloutWorkflow started and awaited across continue-as-new, and how it ended recorded:
sets' statuses, the serving set and apps, a spec update's end, the routers put back after a
rollout ended from outside. The rollout itself (steps, bakes, gates, rollback) is the child's
(workflows/rollout_workflow.py). Nothing here runs outside a workflow.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError, CancelledError, ChildWorkflowError, TerminatedError
from temporalio.exceptions import TimeoutError as WorkflowTimeoutError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from ipnext.activities import QUICK_TIMEOUT, RETRY
    from ipnext.activities.rollouts import RolloutActivities, RolloutOutcomeInput
    from ipnext.contracts.model import ActiveRollout, ApplyPlanInput
    from ipnext.contracts.plan import Plan
    from ipnext.contracts.rollout import RolloutInput, RolloutResult
    from ipnext.names import RolloutState, SetStatus, rollout_workflow_id
    from ipnext.policy.rollout_steps import CAPACITY_MOVE_ATTEMPTS, capacity_retry, rollout_history_limit
    from ipnext.workflows._model_run import ModelRun
    from ipnext.workflows._model_update import SpecUpdates
    from ipnext.workflows.rollout_workflow import RolloutWorkflow

__all__ = ["CAPACITY_RETRY_PATCH", "DOWN_REGIONS_PATCH", "RESTORE_PATCH", "Rollouts"]

# A rollout that ended without rolling back (terminated) leaves the split where it was: since
# this patch the model puts its routers back on the serving set at once and records it.
RESTORE_PATCH = "restore-after-outside-end"
# Runs started before a capacity move left the down regions alone replay without telling the rollout.
DOWN_REGIONS_PATCH = "capacity-move-without-down-regions"
# Runs started before failed capacity moves were tried again (rollout_steps.capacity_retry)
# replay without the retries.
CAPACITY_RETRY_PATCH = "capacity-move-retried"


class Rollouts:
    """The rollouts of one model run. `check_serving` is the model's serving check, run after a
    rollout ended from outside to put the routers back on the record."""

    def __init__(
        self, model: ModelRun, updates: SpecUpdates, check_serving: Callable[[], Awaitable[None]]
    ) -> None:
        self.model = model
        self.updates = updates
        self.check_serving = check_serving

    async def roll_out_newest(self, old_plan: Plan | None, replanned: ApplyPlanInput | None) -> None:
        record = self.model.record
        newest_id = record.queued[-1]
        for older in record.queued[:-1]:
            self.model.set_status(
                older, SetStatus.SUPERSEDED, f"superseded by {newest_id} before its rollout"
            )
        record.queued.clear()
        new = self.model.find(newest_id)
        old = self.model.find(record.serving_set)
        if new is None or record.plan is None:
            known = [s.id for s in record.sets]
            raise ApplicationError(
                f"model {self.model.spec.name}: queued set {newest_id} is not one of its sets {known}"
                if new is None
                else f"model {self.model.spec.name}: no placement plan to roll {newest_id} out on",
                type="ModelRecordError",
                non_retryable=True,
            )
        self.model.set_status(new.id, SetStatus.ROLLING_OUT)
        child_id = rollout_workflow_id(self.model.spec.name, new.id)
        spec, old_spec = self.updates.rollout_specs(new.id)
        await self._start(
            RolloutInput(
                spec=spec,
                old_spec=old_spec,
                plan=record.plan,
                new_set=new,
                old_set=old,
                old_apps=record.serving_apps,
                old_plan=old_plan,
                freeze_override=record.freeze_overrides.pop(new.id, None),
                history_limit=rollout_history_limit(self.model.spec.rollout, self.model.input.history_limit),
            ),
            ActiveRollout(
                workflow_id=child_id,
                new_set=new.id,
                old_set=old.id if old else None,
                old_plan=old_plan,
                replanned=replanned,
            ),
            f"{self.model.spec.name}: {old.id if old else 'nothing'} -> {new.id} ({new.version})",
        )

    async def move_capacity(self, pending: ApplyPlanInput) -> None:
        """Move the serving set to the replanned placement: its apps for the new plan revision
        come up, traffic moves to them, the old apps go (the RolloutWorkflow's cutover)."""
        record = self.model.record
        serving = self.model.find(record.serving_set)
        if serving is None:  # nothing serves yet: the next rollout uses the new placement
            record.plan = pending.plan
            self.model.upsert_state()
            return
        if pending.attempt > 1 and not await self._before_retry(pending):
            return
        why = pending.cause or f"fleet plan {pending.fleet_revision}"
        tried = f", try {pending.attempt} of {CAPACITY_MOVE_ATTEMPTS}" if pending.attempt > 1 else ""
        where = f"placement revision {pending.plan.revision} ({why}{tried})"
        child_id = f"{rollout_workflow_id(self.model.spec.name, serving.id)}/plan-r{pending.plan.revision}"
        if pending.attempt > 1:
            child_id += f"-try{pending.attempt}"
        await self._start(
            RolloutInput(
                spec=self.model.spec,
                plan=pending.plan,
                new_set=serving,
                old_set=serving,
                old_apps=record.serving_apps,
                kind="capacity",
                old_plan=record.plan,
                history_limit=rollout_history_limit(self.model.spec.rollout, self.model.input.history_limit),
                down_regions=list(pending.down_regions) if workflow.patched(DOWN_REGIONS_PATCH) else [],
            ),
            ActiveRollout(
                workflow_id=child_id,
                kind="capacity",
                new_set=serving.id,
                old_set=serving.id,
                new_plan=pending.plan,
                move=pending,
                detail=where,
            ),
            f"{self.model.spec.name}: {serving.id} to {where}",
        )

    async def _before_retry(self, pending: ApplyPlanInput) -> bool:
        """Wait one serving check's interval before trying a failed capacity move again (the
        check that runs first puts Serve back on the record). False when other work came
        meanwhile: a newer placement replaces this one; a queued set, an experiment or a delete
        goes first, and the move waits as the pending plan (a queued set comes up on it)."""
        try:
            await workflow.wait_condition(
                self.model.has_work, timeout=timedelta(seconds=self.model.record.reconcile.interval_seconds)
            )
        except TimeoutError:
            return True
        if self.model.record.pending_plan is None:
            self.model.record.pending_plan = pending
        self.model.upsert_state()
        return False

    # ---- a rollout child: started, awaited (across continue-as-new), recorded -----------------

    async def _start(self, input: RolloutInput, active: ActiveRollout, summary: str) -> None:
        """Start the child RolloutWorkflow and wait for its end. The child is abandoned, not
        terminated, when this run closes: the model may continue as new while it runs."""
        old, new = input.old_set, input.new_set
        self.model.record.rollout = self.model.rollout_status(
            active.workflow_id, RolloutState.RUNNING, [], "", old, new
        )
        self.model.record.active_rollout = active
        self.model.ended = None
        self.model.upsert_state()
        self.model.child = await workflow.start_child_workflow(
            RolloutWorkflow.run,
            input,
            id=active.workflow_id,
            static_summary=summary,
            parent_close_policy=ParentClosePolicy.ABANDON,
        )
        await self.await_active()

    async def await_active(self) -> None:
        """Wait for the active rollout to end, then record how. The end comes from the child's
        handle (this run started it), its `rollout_ended` signal, or, after a continue-as-new,
        from asking Temporal every `rollout_check_seconds` (a rollout terminated or cancelled
        from the Temporal UI sends no signal). A history grown past its limit continues as new
        on the way, the rollout still running."""
        active = self.model.record.active_rollout
        if active is None:
            return
        every = (
            None
            if self.model.child is not None
            else timedelta(seconds=self.model.input.rollout_check_seconds)
        )
        while self.model.ended is None:
            try:
                await workflow.wait_condition(
                    lambda: self.model.ended is not None or self.child_done() or self.model.may_continue(),
                    timeout=every,
                )
            except TimeoutError:  # no signal yet: ask Temporal how the rollout is
                outcome = await workflow.execute_activity_method(
                    RolloutActivities.rollout_outcome,
                    RolloutOutcomeInput(workflow_id=active.workflow_id),
                    start_to_close_timeout=QUICK_TIMEOUT,
                    retry_policy=RETRY,
                    summary=f"is {active.workflow_id} still running?",
                )
                if not outcome.running and self.model.ended is None:
                    self.model.ended = outcome.result or self._ended_without_result(outcome.how)
                continue
            if self.model.ended is None and self.model.child is not None and self.child_done():
                try:
                    self.model.ended = self.model.child.result()
                except ChildWorkflowError as err:  # a rollout that did not complete fails, with its result
                    self.model.ended = RolloutResult.of_failure(err) or self._ended_without_result(
                        _ended_outside(active.workflow_id, err)
                    )
                continue
            if self.model.ended is None and self.model.may_continue():
                await workflow.wait_condition(
                    lambda: workflow.all_handlers_finished() and self.model.publishing == 0
                )
                if self.model.ended is None and self.model.delete_by is None:
                    workflow.logger.info("model continues as new while %s runs", active.workflow_id)
                    workflow.continue_as_new(
                        self.model.input.model_copy(
                            update={"record": self.model.record, "spec": self.model.spec}
                        )
                    )
                every = every or timedelta(seconds=self.model.input.rollout_check_seconds)
        outside = self.model.ended_outside
        self._finish(active, self.model.ended)
        self.model.ended_outside = ""
        if outside and workflow.patched(RESTORE_PATCH):
            await self._restore_serving(active, outside)

    async def _restore_serving(self, active: ActiveRollout, how: str) -> None:
        """A rollout that ended without rolling back (terminated) may have left the routers split
        and the old set scaled down: the serving check puts every router back on the serving set
        (at a generation above the one each router holds, so above every one the rollout
        applied) and the set back to its plan's size, now rather than at the next interval. What
        it did, or why it could not, goes on the set's and the rollout's record."""
        r = self.model.record
        serving, before = r.serving_set, r.reconcile
        await self.check_serving()
        after = r.reconcile
        if serving is None:
            done = "nothing served before it: nothing to put back"
        elif after.failures > before.failures:
            done = (
                f"the routers could not be put back on {serving} yet ({after.last_failure}); the "
                f"serving check tries again every {after.interval_seconds:g} s"
            )
        elif after.repairs > before.repairs:
            done = f"routers put back on {serving} (generation {after.generation_floor}): {after.last_repair}"
        else:
            done = f"the routers were on {serving} already"
        detail = f"{how}; {done}; its new set's apps may still run, with no traffic (remove them by hand)"
        workflow.logger.warning("model %s: %s", self.model.spec.name, detail)
        self.model.set_status(active.new_set, self._set_of(active.new_set), detail)
        if r.rollout is not None and r.rollout.workflow_id == active.workflow_id:
            r.rollout = r.rollout.model_copy(update={"detail": detail})
        self.model.upsert_state()

    def _set_of(self, set_id: str) -> SetStatus:
        found = self.model.find(set_id)
        return found.status if found is not None else SetStatus.FAILED

    def _ended_without_result(self, how: str) -> RolloutResult:
        self.model.ended_outside = how
        return RolloutResult.ended_outside(self.model.record.serving_apps, how)

    def _finish(self, active: ActiveRollout, result: RolloutResult) -> None:
        record = self.model.record
        record.active_rollout = None
        if self.model.child is not None:  # its failure (an outcome but completed) is read: no warning
            self.model.child.add_done_callback(_read_failure)
        self.model.child, self.model.ended = None, None
        self.model.reconcile_due = True
        if result.generations and max(result.generations) > record.reconcile.generation_floor:
            record.reconcile = record.reconcile.model_copy(
                update={"generation_floor": max(result.generations)}
            )
        old, new = self.model.find(active.old_set), self.model.find(active.new_set)
        if new is None:
            raise ApplicationError(
                f"model {self.model.spec.name}: rollout {active.workflow_id} ended for {active.new_set}, "
                f"which is not one of its sets {[s.id for s in record.sets]}",
                type="ModelRecordError",
                non_retryable=True,
            )
        if result.status is not None:  # the rollout's own last word: steps, split, gates, pauses
            record.rollout = result.status.model_copy(update={"detail": result.detail or active.detail})
        else:
            record.rollout = self.model.rollout_status(
                active.workflow_id, result.state, result.generations, result.detail or active.detail, old, new
            )
        done = result.state == RolloutState.COMPLETED
        if active.kind != "capacity":
            self.updates.end(new.id, done, result.state.value)
        if active.kind == "capacity":
            if done and active.new_plan is not None:
                record.plan = active.new_plan
                record.serving_apps = dict(result.apps)
            elif (
                record.pending_plan is None  # a newer placement waits: it replaces this one
                and self.model.delete_by is None
                and not self.model.ended_outside  # terminated or cancelled from the UI: on-call's call
                and (retry := capacity_retry(active.move, result.state)) is not None
                and workflow.patched(CAPACITY_RETRY_PATCH)
            ):
                record.pending_plan = retry
                record.rollout = record.rollout.model_copy(
                    update={
                        "detail": f"{record.rollout.detail}; tried again after the next serving check "
                        f"(try {retry.attempt} of {CAPACITY_MOVE_ATTEMPTS})"
                    }
                )
                workflow.logger.warning(
                    "capacity move to placement revision %s failed (try %d of %d), tried again: %s",
                    retry.plan.revision,
                    retry.attempt - 1,
                    CAPACITY_MOVE_ATTEMPTS,
                    result.detail,
                )
        elif done:
            if old is not None:
                self.model.set_status(old.id, SetStatus.RETIRED, f"replaced by {new.id}")
            self.model.set_status(new.id, SetStatus.SERVING)
            record.serving_set = new.id
            record.serving_apps = dict(result.apps)
        else:  # failed, rolled_back, aborted or refused: the old set serves as before
            self.model.set_status(new.id, SetStatus(result.state.value), result.detail)
            if active.old_plan is not None and record.serving_apps:
                record.plan = active.old_plan  # the old apps still run on the placement they had
            if active.replanned is not None and record.pending_plan is None and record.serving_apps:
                record.pending_plan = active.replanned  # the serving set moves to it next
        self.model.record.trim_sets(self.model.input.sets_kept)
        self.model.upsert_state()

    def child_done(self) -> bool:
        return self.model.child is not None and self.model.child.done()


def _ended_outside(child_id: str, err: ChildWorkflowError) -> str:
    """How a rollout child ended without a result, in words for the model's record."""
    cause = err.cause
    if isinstance(cause, TerminatedError):
        return f"rollout {child_id} was terminated"
    if isinstance(cause, CancelledError):
        return f"rollout {child_id} was cancelled"
    if isinstance(cause, WorkflowTimeoutError):
        return f"rollout {child_id} timed out"
    return f"rollout {child_id} failed: {cause if cause is not None else err.message}"


def _read_failure(child: Any) -> None:
    """Mark a rollout child's failure read: its outcome came by signal (or from the failure
    already), and an unread failure would be logged as an error of the workflow's loop."""
    if not child.cancelled():
        child.exception()
