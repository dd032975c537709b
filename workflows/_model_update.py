"""A model's spec changed after creation: ModelWorkflow's `update_model` Update, checked and applied.

The update is checked like a publish before anything changes: the worker checks the new spec
against its fleet and imports its factories in a child process, places it again when capacity or
parts change, and builds the serving set's snapshots under it when parts change. Only then is it
applied, the lightest way that can (ipnext/policy/spec_update.py): in place (the spec is
replaced and the serving check re-renders the serving set's apps), a capacity move to the new placement, or
a new set that rolls out through the normal steps and brings the new spec with it when it serves
(`ModelRecord.spec_pending`; a rollback leaves the old spec). Every accepted update is in
`ModelRecord.spec_changes` with who made it and its diff; the history holds each Update whole.

`SpecUpdates` is ModelWorkflow's collaborator over its `ModelRun`: the workflow keeps the
handlers' declarations and calls it; nothing here runs outside a workflow.
"""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from ipnext.activities import QUICK_TIMEOUT, RETRY, VALIDATE_TIMEOUT
    from ipnext.activities.metadata import WatchActivities, WatchScheduleInput
    from ipnext.activities.plan import PlanInput, plan_placement
    from ipnext.activities.validate import ValidateSetInput, validate_model_spec, validate_snapshot_set
    from ipnext.contracts.model import (
        ApplyPlanInput,
        SpecChange,
        SpecPending,
        UpdateModelInput,
        UpdateModelResult,
        ValidateSpecInput,
    )
    from ipnext.contracts.plan import Plan, placement_revision
    from ipnext.names import SetStatus
    from ipnext.policy.spec_update import SpecDiff, UpdateKind, diff_specs
    from ipnext.spec.model import ModelSpec, SnapshotRef, SnapshotSet, SnapshotSetRequest
    from ipnext.workflows._model_run import ModelRun

__all__ = ["SPEC_CHANGES_KEPT", "UPDATE_EXAMPLE", "SpecUpdates", "as_update_error"]

UPDATE_EXAMPLE = '{"spec": {<the whole model spec>}, "who": "<who updates>"}'
SPEC_CHANGES_KEPT = 50  # spec changes kept in the record (the history holds every one)


class SpecUpdates:
    """The `update_model` Update of one model run: `refuse` (its validator, no I/O), `apply` (the
    check on the worker, then in place, a capacity move or a new set), and the end of an update
    that rolls out (`end`, `rollout_specs`)."""

    def __init__(self, model: ModelRun) -> None:
        self.model = model

    # ---- the check without I/O (the Update's validator) ----------------------------------------

    def refuse(self, input: UpdateModelInput) -> SpecDiff:
        """Raise ApplicationError for an update that cannot be taken now; else its diff."""
        name, r = self.model.spec.name, self.model.record
        if input.spec.name != name:
            raise ApplicationError(
                f"spec.name: an update keeps the model's name {name!r}, got {input.spec.name!r}. "
                f"Fix: update model {input.spec.name!r} instead, or keep the name.",
                type="SpecError",
            )
        if self.model.delete_by is not None:
            raise ApplicationError(f"model {name} is being deleted", type="ModelNotFoundError")
        if self.model.updating:
            raise ApplicationError(
                f"model {name}: another update is being checked. Fix: send this one when it ends.",
                type="SpecError",
            )
        if r.spec_pending is not None:
            raise ApplicationError(
                f"model {name}: update {r.spec_pending.change} is rolling out with set "
                f"{r.spec_pending.set_id}. Fix: update again when that rollout ends "
                f"(`ipnext rollout status {name}`).",
                type="SpecError",
            )
        diff = diff_specs(self.model.spec, input.spec)
        if diff.kind == UpdateKind.NEW_SET and (r.queued or r.active_rollout is not None):
            # Queued sets were checked under the old spec, and a rollout's sets run under it.
            what = f"set {r.queued[-1]} is queued" if r.queued else "a rollout runs"
            raise ApplicationError(
                f"model {name}: this update changes {', '.join(diff.fields()[:3])}, which needs a new "
                f"set, and {what}. Fix: update again when the rollout ends.",
                type="SpecError",
            )
        if diff.kind == UpdateKind.NEW_SET and r.serving_set is not None:
            serving = self.model.find(r.serving_set)
            have = set(serving.parts if serving else {}) | set(input.snapshots)
            missing = sorted(set(input.spec.parts) - have)
            if missing:
                raise ApplicationError(
                    f"snapshots: the new spec's parts {missing} have no snapshot in the serving set. "
                    "Fix: bring one for each with the update (`ipnext model update -f model.yaml "
                    "--snapshots FOLDER`, a folder whose manifest names them).",
                    type="SnapshotError",
                )
        if input.snapshots and diff.kind != UpdateKind.NEW_SET:
            raise ApplicationError(
                "snapshots: only an update that changes parts, factories, hardware or the DAG takes "
                "snapshots. Fix: publish them (`ipnext snapshot publish`).",
                type="SnapshotError",
            )
        return diff

    # ---- the check with I/O, then the change (the Update's handler) -----------------------------

    async def apply(self, input: UpdateModelInput) -> UpdateModelResult:
        diff = self.refuse(input)
        name, r = self.model.spec.name, self.model.record
        if diff.kind == UpdateKind.NONE:
            return UpdateModelResult(model=name, kind=diff.kind, changes=[], outcome="no change")
        before = self.model.spec
        self.model.updating = True
        self.model.publishing += 1
        try:
            plan, new_parts = await self._check_update(input, diff)
        except ActivityError as err:
            raise as_update_error(err) from None
        finally:
            self.model.publishing -= 1
            self.model.updating = False
        # Asked again: a delete, a publish or a rollout may have started while the checks ran.
        if self.refuse(input) != diff:
            raise ApplicationError(
                f"model {name}: its spec changed while this update was checked. Fix: send it again.",
                type="SpecError",
            )
        number = r.spec_changes[-1].number + 1 if r.spec_changes else 1
        if diff.kind == UpdateKind.NEW_SET and new_parts is not None:
            result = self._queue_spec_set(input, diff, number, new_parts, plan)
        else:
            result = self._apply_now(input, diff, number, plan)
        if before.watch != input.spec.watch:  # retried until done (RETRY): the record is changed
            await workflow.execute_activity_method(
                WatchActivities.ensure_watch_schedule,
                WatchScheduleInput(
                    model=name,
                    interval_seconds=input.spec.watch.interval_seconds,
                    enabled=input.spec.watch.enabled,
                ),
                start_to_close_timeout=QUICK_TIMEOUT,
                retry_policy=RETRY,
                summary="watch schedule of the updated spec",
            )
        r.spec_changes.append(
            SpecChange(
                number=number,
                at=workflow.now(),
                who=input.who,
                kind=diff.kind,
                changes=diff.changes,
                outcome=result.outcome,
            )
        )
        del r.spec_changes[:-SPEC_CHANGES_KEPT]
        workflow.logger.info(
            "model %s updated by %s (%s): %s", name, input.who, diff.kind, "; ".join(diff.changes)
        )
        self.model.upsert_state()
        return result

    async def _check_update(
        self, input: UpdateModelInput, diff: SpecDiff
    ) -> tuple[Plan | None, dict[str, SnapshotRef] | None]:
        """The worker's checks: the spec (fleet, factories), its placement when capacity or parts
        change, and the serving set's snapshots built under it when parts change. Returns the
        placement (None: unchanged) and the new set's snapshots (None: no new set)."""
        r, name = self.model.record, self.model.spec.name
        await workflow.execute_activity(
            validate_model_spec,
            ValidateSpecInput(spec=input.spec),
            start_to_close_timeout=VALIDATE_TIMEOUT,
            retry_policy=RETRY,
            summary=f"check {name}'s updated spec and factories",
        )
        plan = None
        if diff.kind in (UpdateKind.CAPACITY, UpdateKind.NEW_SET):
            plan = await workflow.execute_activity(
                plan_placement,
                PlanInput(spec=input.spec, current=r.plan),
                start_to_close_timeout=QUICK_TIMEOUT,
                retry_policy=RETRY,
                summary=f"place {name} under its updated spec",
            )
            plan = plan.model_copy(update={"revision": placement_revision(r.plan, plan.deployments)})
        serving = self.model.find(r.serving_set)
        if diff.kind != UpdateKind.NEW_SET or serving is None:
            return plan, None
        parts = {p: input.snapshots.get(p) or serving.parts[p] for p in input.spec.parts}
        validated = await workflow.execute_activity(
            validate_snapshot_set,
            ValidateSetInput(
                spec=input.spec,
                request=SnapshotSetRequest(model=name, version=self._update_version(serving), parts=parts),
                serving_parts=None,
            ),
            start_to_close_timeout=VALIDATE_TIMEOUT,
            heartbeat_timeout=VALIDATE_TIMEOUT,
            retry_policy=RETRY,
            summary=f"build {serving.id}'s snapshots under {name}'s updated spec",
        )
        return plan, dict(validated.parts)

    def _apply_now(
        self, input: UpdateModelInput, diff: SpecDiff, number: int, plan: Plan | None
    ) -> UpdateModelResult:
        """In place or a capacity move (or any update while nothing serves): the spec now."""
        r = self.model.record
        self.model.spec = input.spec
        self.model.reconcile_due = r.serving_set is not None
        result = UpdateModelResult(
            model=self.model.spec.name, kind=diff.kind, changes=diff.changes, outcome=""
        )
        if plan is None or (r.plan is not None and plan.deployments == r.plan.deployments):
            where = "" if plan is None else " (its placement is unchanged)"
            return result.model_copy(update={"outcome": f"applied in place{where}"})
        if r.serving_set is None:
            r.plan = plan
            return result.model_copy(
                update={
                    "outcome": f"applied; placement revision {plan.revision} (nothing serves yet)",
                    "plan_revision": plan.revision,
                }
            )
        r.pending_plan = ApplyPlanInput(
            plan=plan, fleet_revision=0, cause=f"model update {number} by {input.who}"
        )
        return result.model_copy(
            update={
                "outcome": f"capacity move to placement revision {plan.revision}",
                "plan_revision": plan.revision,
            }
        )

    def _queue_spec_set(
        self,
        input: UpdateModelInput,
        diff: SpecDiff,
        number: int,
        parts: dict[str, SnapshotRef],
        plan: Plan | None,
    ) -> UpdateModelResult:
        """Parts or the DAG changed while a set serves: a new set under the new spec, queued with
        its placement; the spec changes when it serves."""
        r = self.model.record
        version = self._update_version(self.model.find(r.serving_set))
        set_number = r.next_number
        r.next_number += 1
        new = SnapshotSet(
            id=f"{self.model.spec.name}@{set_number}",
            number=set_number,
            version=version,
            parts=parts,
            status=SetStatus.VALIDATED,
            published_at=workflow.now(),
            detail=f"model update {number} by {input.who}",
        )
        r.sets.append(new)
        r.queued.append(new.id)
        r.spec_pending = SpecPending(spec=input.spec, set_id=new.id, change=number)
        if plan is not None:
            r.pending_plan = ApplyPlanInput(
                plan=plan, fleet_revision=0, cause=f"model update {number} by {input.who}"
            )
        return UpdateModelResult(
            model=self.model.spec.name,
            kind=diff.kind,
            changes=diff.changes,
            outcome=f"rolling out as {new.id}",
            set_id=new.id,
            plan_revision=plan.revision if plan is not None else None,
        )

    def _update_version(self, serving: SnapshotSet | None) -> str:
        """The version label of an update's set: the serving set's, marked with the set number."""
        base = serving.version if serving is not None else "spec"
        return f"{base[:100]}-spec{self.model.record.next_number}"

    # ---- a new set's update ends with its rollout ---------------------------------------------

    def end(self, set_id: str, serves: bool, how: str) -> None:
        """The rollout of an update's set ended: its spec serves now, or the old one stays."""
        r = self.model.record
        pending = r.spec_pending
        if pending is None or pending.set_id != set_id:
            return
        r.spec_pending = None
        if serves:
            self.model.spec = pending.spec
            outcome = f"applied: {set_id} serves"
        else:
            outcome = f"not applied: the rollout of {set_id} {how}; the old spec stays"
        r.spec_changes = [
            c.model_copy(update={"outcome": outcome}) if c.number == pending.change else c
            for c in r.spec_changes
        ]
        workflow.logger.info("model %s: update %d %s", self.model.spec.name, pending.change, outcome)

    def rollout_specs(self, set_id: str) -> tuple[ModelSpec, ModelSpec | None]:
        """(spec, old_spec) for a rollout of `set_id`: an update's set brings its spec."""
        pending = self.model.record.spec_pending
        if pending is not None and pending.set_id == set_id:
            return pending.spec, self.model.spec
        return self.model.spec, None


def as_update_error(
    err: ActivityError, unchecked: str = "the update could not be checked", type: str = "SpecError"
) -> ApplicationError:
    """An Update's failure from its check's: the activity's own error as is, else `unchecked`."""
    cause = err.cause
    if isinstance(cause, ApplicationError):
        return ApplicationError(cause.message, *cause.details, type=cause.type, non_retryable=True)
    return ApplicationError(f"{unchecked}: {cause or err}", type=type, non_retryable=True)
