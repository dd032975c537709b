"""ModelWorkflow: the registry and system of record of one model (`model/<name>`).

Its history is the audit trail: every publish, every rollout (as a child
workflow), the delete. A publish is an Update: the validator rejects malformed
input without I/O, the handler validates the snapshots in an activity and raises
a non-retryable ApplicationError before changing any state. Sets published while
a rollout runs are queued; when it ends the newest starts and older ones are
recorded as superseded.

Composed, not inherited: the run's state is one `ModelRun` (workflows/_model_run.py: the record,
what only this run holds, the model's views), which the workflow shares with its collaborators
`SpecUpdates` (the `update_model` Update, workflows/_model_update.py), `Experiments`
(experiments and shadows, workflows/_model_experiments.py), `Rollouts` (rollout children
started, awaited and recorded, workflows/_model_rollouts.py) and `PinnedReferences` (the pinned
files its kept sets need, named to the pinned store's collection, workflows/_model_pinned.py).
This module keeps every handler's declaration (Temporal reads them off the class), publish, the
serving checks, delete and the loop; what it calls out to lives in activities, and the rollout
in its own workflow.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
)

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
    from ipnext.contracts.rollout import RolloutEnded
    from ipnext.names import ModelWorkflowNames, SetStatus
    from ipnext.spec.model import SnapshotSet
    from ipnext.workflows._model_experiments import START_EXPERIMENT_EXAMPLE, Experiments
    from ipnext.workflows._model_pinned import PinnedReferences
    from ipnext.workflows._model_rollouts import Rollouts
    from ipnext.workflows._model_run import ModelRun
    from ipnext.workflows._model_update import UPDATE_EXAMPLE, SpecUpdates, as_update_error
    from ipnext.workflows._signals import NO_PAYLOAD, signal_input, update_input


# The serving checks came after models that still run: their histories replay without them.
RECONCILE_PATCH = "serving-reconcile"
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
        # Rollout children: started, awaited (across continue-as-new) and recorded.
        self.rollouts = Rollouts(self.model, self.updates, check_serving=self._reconcile)
        # The pinned files its kept sets need, written after the set list changes (and a collection).
        self.pinned = PinnedReferences(self.model)

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
        sends this to every model: it may start because the stack restarted), and write the
        model's references to the pinned store again (its file may have been lost or removed)."""
        self.model.reconcile_due = True
        self.pinned.rewrite()

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
        # Named before the answer: a rollout running now may outlast the store's grace for its files.
        await self.pinned.sync()
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
        result = await self.updates.apply(input)
        if result.set_id is not None:  # a new set, with the update's snapshots
            await self.pinned.sync()
        return result

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
        input = update_input(raw, StartExperimentInput, name, START_EXPERIMENT_EXAMPLE)
        self.experiments.refuse_undirected(input)
        self.experiments.refuse_start(input)

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
            await self.rollouts.await_active()
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
            if self.model.reconcile_due and not self.model.has_work():
                await self._reconcile()
                continue
            if self.pinned.wants_write() and not self.model.has_work():
                await self.pinned.sync()
                continue
            try:
                await workflow.wait_condition(
                    lambda: self.model.has_work() or self.model.reconcile_due or self.model.history_full(),
                    timeout=self._reconcile_every(),
                )
            except TimeoutError:  # idle for an interval: check that Serve serves the record
                self.model.reconcile_due = True
                self.pinned.failed = False  # a write that failed is tried again now
                continue
            # Each of these may change the set list (a rollout's end trims it): the references
            # are written at the next idle moment after it, if the list changed.
            if record.experiment is not None:  # rollouts, replans and checks wait for its end
                await self.experiments.run()
                self.pinned.due = True
                continue
            if self.model.delete_by is not None:
                break
            if record.queued:
                old_plan, replanned = record.plan, record.pending_plan
                if replanned is not None:  # the new set comes up on the new placement
                    record.plan, record.pending_plan = replanned.plan, None
                await self.rollouts.roll_out_newest(old_plan, replanned)
                self.pinned.due = True
                continue
            if record.pending_plan is not None:
                pending, record.pending_plan = record.pending_plan, None
                await self.rollouts.move_capacity(pending)
                self.pinned.due = True
                continue
            await workflow.wait_condition(
                lambda: workflow.all_handlers_finished() and self.model.publishing == 0
            )
            if not record.queued and record.pending_plan is None and self.model.delete_by is None:
                workflow.continue_as_new(
                    self.model.input.model_copy(update={"record": record, "spec": self.model.spec})
                )
        return await self._delete()

    # ---- reconcile: Serve serves what the record says --------------------------------------

    def _reconcile_every(self) -> timedelta | None:
        """How long to wait idle before the next serving check (None: nothing serves). Models
        whose history predates the checks keep waiting as they did (a replay must match)."""
        r = self.model.record
        if r.serving_set is None or r.plan is None or not r.serving_apps:
            return None
        if not workflow.patched(RECONCILE_PATCH):
            return None
        return timedelta(seconds=r.reconcile.idle_seconds or r.reconcile.interval_seconds)

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
            "idle_seconds": result.idle_seconds,
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
        await self.pinned.drop()
        await workflow.wait_condition(workflow.all_handlers_finished)
        return ModelWorkflowResult(
            model=self.model.spec.name,
            deleted_by=self.model.delete_by or "",
            sets=len(self.model.record.sets) + self.model.record.older_sets.count,
        )
