"""ModelWorkflow: the registry and system of record of one model (`model/<name>`).

Its history is the audit trail: every publish, every rollout (as a child
workflow), the delete. A publish is an Update: the validator rejects malformed
input without I/O, the handler validates the snapshots in an activity and raises
a non-retryable ApplicationError before changing any state. Sets published while
a rollout runs are queued; when it ends the newest starts and older ones are
recorded as superseded.

Composed, not inherited: the run's state is one `ModelRun` (workflows/_model_run.py: the record,
what only this run holds, the model's views), which the workflow shares with its collaborators
`SpecUpdates` (the `update_model` Update, workflows/_model_update.py) and `Experiments`
(experiments and shadows, workflows/_model_experiments.py). This module keeps every handler's
declaration (Temporal reads them off the class), publish, delete, the rollout's life and the
loop; what it calls out to lives in activities, and the rollout in its own workflow.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    CancelledError,
    ChildWorkflowError,
    TerminatedError,
)
from temporalio.exceptions import TimeoutError as WorkflowTimeoutError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from ipnext.activities import (
        DEPLOY_TIMEOUT,
        HEARTBEAT_TIMEOUT,
        QUICK_TIMEOUT,
        RECONCILE_RETRY,
        RETRY,
        VALIDATE_TIMEOUT,
    )
    from ipnext.activities.metadata import WatchActivities, WatchScheduleInput
    from ipnext.activities.plan import PlanInput, plan_placement
    from ipnext.activities.reconcile import ReconcileInput, reconcile_serving
    from ipnext.activities.rollouts import RolloutActivities, RolloutOutcomeInput
    from ipnext.activities.serving import TeardownInput, teardown_model
    from ipnext.activities.validate import ValidateSetInput, validate_snapshot_set
    from ipnext.contracts.experiment import (
        ArmsMoved,
        ExperimentStarted,
        ExperimentStatus,
        PromoteInput,
        StartExperimentInput,
    )
    from ipnext.contracts.model import (
        ActiveRollout,
        ApplyPlanInput,
        DeleteInput,
        DeleteResult,
        ModelState,
        ModelWorkflowInput,
        ModelWorkflowResult,
        PublishInput,
        PublishResult,
        UpdateModelInput,
        UpdateModelResult,
    )
    from ipnext.contracts.plan import Plan
    from ipnext.contracts.rollout import RolloutEnded, RolloutInput, RolloutResult
    from ipnext.names import ModelWorkflowNames, RolloutState, SetStatus, rollout_workflow_id
    from ipnext.policy.rollout_steps import CAPACITY_MOVE_ATTEMPTS, capacity_retry, rollout_history_limit
    from ipnext.spec.model import SnapshotSet
    from ipnext.workflows._model_experiments import START_EXPERIMENT_EXAMPLE, Experiments
    from ipnext.workflows._model_run import ModelRun
    from ipnext.workflows._model_update import UPDATE_EXAMPLE, SpecUpdates, as_update_error
    from ipnext.workflows._signals import NO_PAYLOAD, signal_input, update_input
    from ipnext.workflows.rollout_workflow import RolloutWorkflow


# The serving checks came after models that still run: their histories replay without them.
RECONCILE_PATCH = "serving-reconcile"
# A rollout that ended without rolling back (terminated) leaves the split where it was: since
# this patch the model puts its routers back on the serving set at once and records it.
RESTORE_PATCH = "restore-after-outside-end"
# Runs started before a capacity move left the down regions alone replay without telling the rollout.
DOWN_REGIONS_PATCH = "capacity-move-without-down-regions"
# Runs started before failed capacity moves were tried again (rollout_steps.capacity_retry)
# replay without the retries.
CAPACITY_RETRY_PATCH = "capacity-move-retried"
PUBLISH_EXAMPLE = '{"request": {"model": ..., "version": ..., "parts": {...}}, "who": ...}'
DELETE_EXAMPLE = '{"who": "<who deletes>"}'
PROMOTE_EXAMPLE = '{"set_id": "<model>@<n>", "who": "<who promotes>"}'


@workflow.defn
class ModelWorkflow:
    @workflow.init
    def __init__(self, input: ModelWorkflowInput) -> None:
        # The run's state, one object the handlers and collaborators share; its record is what
        # continues as new.
        self.model = ModelRun(input)
        self.updates = SpecUpdates(self.model)  # the update_model Update: its check and application
        self.experiments = Experiments(self.model)  # experiments and shadows, and a replan of their arms

    # ---- queries -------------------------------------------------------------------------

    @workflow.query(name=ModelWorkflowNames.GET)
    def get(self) -> ModelState:
        r = self.model.record
        return ModelState(
            spec=self.model.spec,
            state=self.model.state(),
            sets=list(r.sets),
            serving_set=r.serving_set,
            serving_apps=dict(r.serving_apps),
            queued=list(r.queued),
            plan=r.plan,
            rollout=r.rollout,
            pending_plan=r.pending_plan.plan.revision if r.pending_plan else None,
            reconcile=r.reconcile,
            active_rollout=r.active_rollout,
            older_sets=r.older_sets,
            updated_at=r.updated_at,
            spec_changes=list(r.spec_changes),
            spec_pending=r.spec_pending,
            experiment=r.experiment,
            experiments=list(r.experiments),
        )

    # ---- replanned placement -------------------------------------------------------------

    # Signals read their payload by hand (workflows/_signals.py): none, a malformed one or a
    # second one is logged and ignored, never a failed workflow task.

    @workflow.signal(name=ModelWorkflowNames.APPLY_PLAN)
    def apply_plan(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> None:
        """A fleet replan moved this model's capacity; the newest placement wins."""
        input = signal_input(raw, ApplyPlanInput, ModelWorkflowNames.APPLY_PLAN)
        if input is None:
            return
        if self.model.delete_by is None:
            self.model.record.pending_plan = input

    @workflow.signal(name=ModelWorkflowNames.RECONCILE)
    def reconcile(self, _ignored: Any = None) -> None:
        """Check Serve against the record now, not at the next interval (a worker that starts
        sends this to every model: it may start because the stack restarted)."""
        self.model.reconcile_due = True

    @workflow.signal(name=ModelWorkflowNames.ROLLOUT_ENDED)
    def rollout_ended(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> None:
        """The active rollout's own report of its end (any other is stale: ignored)."""
        input = signal_input(raw, RolloutEnded, ModelWorkflowNames.ROLLOUT_ENDED)
        if input is None:  # the rollout_outcome poll still notices the end
            return
        active = self.model.record.active_rollout
        if active is not None and input.workflow_id == active.workflow_id and self.model.ended is None:
            self.model.ended = input.result

    # ---- publish -------------------------------------------------------------------------

    # Updates read their payload by hand too (workflows/_signals.py): their validators refuse a
    # missing or malformed one by name, so the Temporal UI's "Execute Update" with an empty
    # input is refused and never fails a workflow task.

    @workflow.update(name=ModelWorkflowNames.PUBLISH)
    async def publish(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> PublishResult:
        input = update_input(raw, PublishInput, ModelWorkflowNames.PUBLISH, PUBLISH_EXAMPLE)
        serving = self.model.find(self.model.record.serving_set)
        self.model.publishing += 1
        try:
            validated = await workflow.execute_activity(
                validate_snapshot_set,
                ValidateSetInput(
                    spec=self.model.spec,
                    request=input.request,
                    serving_parts=serving.parts if serving else None,
                ),
                start_to_close_timeout=VALIDATE_TIMEOUT,
                heartbeat_timeout=VALIDATE_TIMEOUT,
                retry_policy=RETRY,
                summary=f"validate {input.request.model} {input.request.version}",
            )
        except ActivityError as err:
            raise as_update_error(err, "validation could not run", "SnapshotError") from None
        finally:
            self.model.publishing -= 1
        if self.model.delete_by is not None:
            raise ApplicationError(
                f"model {self.model.spec.name} is being deleted",
                type="ModelNotFoundError",
                non_retryable=True,
            )
        number = self.model.record.next_number
        self.model.record.next_number += 1
        held = " and held: not rolled out (for an experiment or a shadow)" if input.hold else ""
        snapshot_set = SnapshotSet(
            id=f"{self.model.spec.name}@{number}",
            number=number,
            version=input.request.version,
            parts=validated.parts,
            status=SetStatus.HELD if input.hold else SetStatus.VALIDATED,
            published_at=workflow.now(),
            detail=f"published by {input.who}{held}",
        )
        self.model.record.sets.append(snapshot_set)
        if not input.hold:
            self.model.record.queued.append(snapshot_set.id)
        self.model.record.trim_sets(self.model.input.sets_kept)
        if input.freeze_override is not None:
            self.model.record.freeze_overrides[snapshot_set.id] = input.freeze_override
        workflow.logger.info("published %s (%s) by %s", snapshot_set.id, input.request.version, input.who)
        return PublishResult(set_id=snapshot_set.id, status="held" if input.hold else "queued")

    @publish.validator
    def _check_publish(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> None:
        input = update_input(raw, PublishInput, ModelWorkflowNames.PUBLISH, PUBLISH_EXAMPLE)
        request = input.request
        if self.model.delete_by is not None:
            raise ApplicationError(
                f"model {self.model.spec.name} is being deleted", type="ModelNotFoundError"
            )
        pending = self.model.record.spec_pending
        if pending is not None:
            raise ApplicationError(
                f"model {self.model.spec.name}: update {pending.change} of its spec is rolling out with set "
                f"{pending.set_id}. Fix: publish when that rollout ends.",
                type="SnapshotError",
            )
        if request.model != self.model.spec.name:
            raise ApplicationError(
                f"model: the snapshot set is for {request.model!r}, not {self.model.spec.name!r}. "
                f"Fix: publish it to model {request.model!r}.",
                type="SnapshotError",
            )
        unknown = sorted(set(request.parts) - set(self.model.spec.parts))
        if unknown:
            raise ApplicationError(
                f"parts: {unknown} are not parts of {self.model.spec.name} "
                f"({sorted(self.model.spec.parts)}).",
                type="SnapshotError",
            )
        if request.version in self.model.record.older_sets.versions:
            raise ApplicationError(
                f"version: {request.version!r} was already published (an older set). "
                "Fix: give every snapshot set a new version label.",
                type="SnapshotError",
            )
        for existing in self.model.record.sets:
            if existing.version == request.version:
                raise ApplicationError(
                    f"version: {request.version!r} was already published as {existing.id}. "
                    "Fix: give every snapshot set a new version label.",
                    type="SnapshotError",
                )

    # ---- update: a new spec (workflows/_model_update.py) -----------------------------------

    @workflow.update(name=ModelWorkflowNames.UPDATE)
    async def update_model(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> UpdateModelResult:
        input = update_input(raw, UpdateModelInput, ModelWorkflowNames.UPDATE, UPDATE_EXAMPLE)
        return await self.updates.apply(input)

    @update_model.validator
    def _validate_update(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> None:
        self.updates.refuse(update_input(raw, UpdateModelInput, ModelWorkflowNames.UPDATE, UPDATE_EXAMPLE))

    # ---- experiments (workflows/_model_experiments.py) ------------------------------------

    @workflow.update(name=ModelWorkflowNames.START_EXPERIMENT)
    def start_experiment(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> ExperimentStarted:
        input = update_input(
            raw, StartExperimentInput, ModelWorkflowNames.START_EXPERIMENT, START_EXPERIMENT_EXAMPLE
        )
        return self.experiments.start(input)

    @start_experiment.validator
    def _validate_experiment(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> None:
        name = ModelWorkflowNames.START_EXPERIMENT
        self.experiments.refuse_start(update_input(raw, StartExperimentInput, name, START_EXPERIMENT_EXAMPLE))

    @workflow.update(name=ModelWorkflowNames.PROMOTE)
    def promote(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> PublishResult:
        return self.experiments.promote(
            update_input(raw, PromoteInput, ModelWorkflowNames.PROMOTE, PROMOTE_EXAMPLE)
        )

    @promote.validator
    def _validate_promote(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> None:
        self.experiments.refuse_promote(
            update_input(raw, PromoteInput, ModelWorkflowNames.PROMOTE, PROMOTE_EXAMPLE)
        )

    @workflow.signal(name=ModelWorkflowNames.ARMS_MOVED)
    def arms_moved(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> None:
        """The running experiment's answer to a capacity move of its arms (`_move_arms`)."""
        self.model.arms_moved = (
            signal_input(raw, ArmsMoved, ModelWorkflowNames.ARMS_MOVED) or self.model.arms_moved
        )

    @workflow.signal(name=ModelWorkflowNames.EXPERIMENT_ENDED)
    def experiment_ended(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> None:
        """The running experiment's own report of its end (any other is stale: ignored)."""
        input = signal_input(raw, ExperimentStatus, ModelWorkflowNames.EXPERIMENT_ENDED)
        active = self.model.record.experiment
        if input is not None and active is not None and input.workflow_id == active.workflow_id:
            self.model.experiment_ended = input

    # ---- delete --------------------------------------------------------------------------

    @workflow.update(name=ModelWorkflowNames.DELETE)
    async def delete(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> DeleteResult:
        input = update_input(raw, DeleteInput, ModelWorkflowNames.DELETE, DELETE_EXAMPLE)
        if self.model.delete_by is None:
            self.model.delete_by = input.who
        await workflow.wait_condition(lambda: self.model.removed_apps is not None)
        return DeleteResult(model=self.model.spec.name, removed_apps=list(self.model.removed_apps or []))

    @delete.validator
    def _check_delete(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> None:
        """A delete tears serving down: it must say who asks (a bare one is refused)."""
        update_input(raw, DeleteInput, ModelWorkflowNames.DELETE, DELETE_EXAMPLE)

    # ---- the life of the model -----------------------------------------------------------

    @workflow.run
    async def run(self, input: ModelWorkflowInput) -> ModelWorkflowResult:
        record = self.model.record
        self.model.upsert_state()
        if record.active_rollout is not None:  # a run continued as new while its rollout ran
            await self._await_rollout()
        if record.experiment is not None and record.experiment.started:  # likewise, an experiment
            await self.experiments.run()
        if record.plan is None:
            record.plan = await workflow.execute_activity(
                plan_placement,
                PlanInput(spec=self.model.spec),
                start_to_close_timeout=QUICK_TIMEOUT,
                retry_policy=RETRY,
                summary=f"first placement of {self.model.spec.name}",
            )
            await workflow.execute_activity_method(
                WatchActivities.ensure_watch_schedule,
                WatchScheduleInput(
                    model=self.model.spec.name,
                    interval_seconds=self.model.spec.watch.interval_seconds,
                    enabled=self.model.spec.watch.enabled,
                ),
                start_to_close_timeout=QUICK_TIMEOUT,
                retry_policy=RETRY,
                summary="watch schedule",
            )
        while True:
            self.model.publish_details()
            if self.model.reconcile_due and not self._has_work():
                await self._reconcile()
                continue
            try:
                await workflow.wait_condition(
                    lambda: self._has_work() or self.model.reconcile_due or self.model.history_full(),
                    timeout=self._reconcile_every(),
                )
            except TimeoutError:  # idle for an interval: check that Serve serves the record
                self.model.reconcile_due = True
                continue
            if record.experiment is not None:  # rollouts, replans and checks wait for its end
                await self.experiments.run()
                continue
            if self.model.delete_by is not None:
                break
            if record.queued:
                old_plan, replanned = record.plan, record.pending_plan
                if replanned is not None:  # the new set comes up on the new placement
                    record.plan, record.pending_plan = replanned.plan, None
                await self._roll_out_newest(old_plan, replanned)
                continue
            if record.pending_plan is not None:
                pending, record.pending_plan = record.pending_plan, None
                await self._move_capacity(pending)
                continue
            await workflow.wait_condition(
                lambda: workflow.all_handlers_finished() and self.model.publishing == 0
            )
            if not record.queued and record.pending_plan is None and self.model.delete_by is None:
                workflow.continue_as_new(
                    self.model.input.model_copy(update={"record": record, "spec": self.model.spec})
                )
        return await self._delete()

    def _has_work(self) -> bool:
        r = self.model.record
        busy = bool(r.queued) or r.pending_plan is not None or r.experiment is not None
        return busy or self.model.delete_by is not None

    # ---- reconcile: Serve serves what the record says --------------------------------------

    def _reconcile_every(self) -> timedelta | None:
        """How long to wait idle before the next serving check (None: nothing serves). Models
        whose history predates the checks keep waiting as they did (a replay must match)."""
        r = self.model.record
        if r.serving_set is None or r.plan is None or not r.serving_apps:
            return None
        if not workflow.patched(RECONCILE_PATCH):
            return None
        return timedelta(seconds=r.reconcile.interval_seconds)

    async def _reconcile(self) -> None:
        """Check Serve against the record and push what it lost (activities/reconcile.py). A
        check that cannot run (Ray or the writer down through its few attempts) is recorded and
        tried again next interval; it never fails the model."""
        self.model.reconcile_due = False
        r = self.model.record
        serving = self.model.find(r.serving_set)
        if serving is None or r.plan is None or not r.serving_apps or not workflow.patched(RECONCILE_PATCH):
            return
        done = r.reconcile
        try:
            result = await workflow.execute_activity(
                reconcile_serving,
                ReconcileInput(
                    spec=self.model.spec,
                    serving_set=serving,
                    plan=r.plan,
                    apps=dict(r.serving_apps),
                    generation_floor=done.generation_floor,
                ),
                start_to_close_timeout=DEPLOY_TIMEOUT,
                heartbeat_timeout=HEARTBEAT_TIMEOUT,
                retry_policy=RECONCILE_RETRY,
                summary="check that Serve serves the record",
            )
        except ActivityError as err:
            why = str(err.cause or err)
            workflow.logger.warning("serving check of %s failed: %s", self.model.spec.name, why)
            r.reconcile = done.model_copy(
                update={"checks": done.checks + 1, "failures": done.failures + 1, "last_failure": why}
            )
            return
        update: dict[str, object] = {
            "checks": done.checks + 1,
            "interval_seconds": result.interval_seconds,
            "generation_floor": max([done.generation_floor, *result.generations.values()]),
        }
        if result.repaired:
            workflow.logger.warning(
                "serving of %s repaired: %s", self.model.spec.name, "; ".join(result.repaired)
            )
            update |= {
                "repairs": done.repairs + 1,
                "last_repair": "; ".join(result.repaired),
                "last_repair_at": workflow.now(),
            }
        r.reconcile = done.model_copy(update=update)

    async def _roll_out_newest(self, old_plan: Plan | None, replanned: ApplyPlanInput | None) -> None:
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
        await self._run_rollout(
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

    async def _move_capacity(self, pending: ApplyPlanInput) -> None:
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
        await self._run_rollout(
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
                self._has_work, timeout=timedelta(seconds=self.model.record.reconcile.interval_seconds)
            )
        except TimeoutError:
            return True
        if self.model.record.pending_plan is None:
            self.model.record.pending_plan = pending
        self.model.upsert_state()
        return False

    # ---- a rollout child: started, awaited (across continue-as-new), recorded -----------------

    async def _run_rollout(self, input: RolloutInput, active: ActiveRollout, summary: str) -> None:
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
        await self._await_rollout()

    async def _await_rollout(self) -> None:
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
                    lambda: self.model.ended is not None or self._child_done() or self.model.may_continue(),
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
            if self.model.ended is None and self.model.child is not None and self._child_done():
                try:
                    self.model.ended = self.model.child.result()
                except ChildWorkflowError as err:
                    self.model.ended = self._ended_without_result(_ended_outside(active.workflow_id, err))
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
        self._finish_rollout(active, self.model.ended)
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
        await self._reconcile()
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

    def _finish_rollout(self, active: ActiveRollout, result: RolloutResult) -> None:
        record = self.model.record
        record.active_rollout = None
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

    def _child_done(self) -> bool:
        return self.model.child is not None and self.model.child.done()

    async def _delete(self) -> ModelWorkflowResult:
        self.model.upsert_state()
        removed = await workflow.execute_activity(
            teardown_model,
            TeardownInput(model=self.model.spec.name),
            start_to_close_timeout=DEPLOY_TIMEOUT,
            retry_policy=RETRY,
            summary=f"tear down serving of {self.model.spec.name}",
        )
        await workflow.execute_activity_method(
            WatchActivities.ensure_watch_schedule,
            WatchScheduleInput(model=self.model.spec.name, interval_seconds=60, enabled=False),
            start_to_close_timeout=QUICK_TIMEOUT,
            retry_policy=RETRY,
            summary="remove watch schedule",
        )
        self.model.record.serving_apps = {}
        self.model.record.serving_set = None
        self.model.removed_apps = removed.removed
        await workflow.wait_condition(workflow.all_handlers_finished)
        return ModelWorkflowResult(
            model=self.model.spec.name,
            deleted_by=self.model.delete_by or "",
            sets=len(self.model.record.sets) + self.model.record.older_sets.count,
        )

    # ---- helpers -------------------------------------------------------------------------


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
