"""One run of ModelWorkflow as an object: its record and what only the run holds, how the model
shows itself (its state, the Temporal UI's details and search attributes, its summary of a
rollout) and the record's small edits. Nothing here runs outside a workflow.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow
from temporalio.workflow import ChildWorkflowHandle

with workflow.unsafe.imports_passed_through():
    from ipnext.contracts.experiment import ArmsMoved, ExperimentStatus
    from ipnext.contracts.model import ApplyPlanInput, ModelWorkflowInput
    from ipnext.contracts.plan import Plan
    from ipnext.contracts.rollout import RolloutResult, RolloutStatus
    from ipnext.names import MODEL_KEY, STATE_KEY, ModelStatus, RolloutState, SetStatus
    from ipnext.spec.model import SnapshotSet

__all__ = ["ModelRun"]


class ModelRun:
    """One run of ModelWorkflow: its record (what continues as new) and what only this run holds,
    with the views every handler needs (its state, the UI's details, a rollout's summary) and the
    record's small edits. The workflow and its collaborators (`SpecUpdates`, `Experiments`) share
    one instance."""

    def __init__(self, input: ModelWorkflowInput) -> None:
        self.spec = input.spec
        # The one state object, carried whole when the run continues as new.
        self.record = input.record.model_copy(deep=True)
        # What only this run's handlers and child hold: it continues as new only when none runs.
        self.input = input
        self.child: ChildWorkflowHandle[Any, RolloutResult] | None = None  # started by this run
        self.ended: RolloutResult | None = None  # how the active rollout ended, once known
        self.ended_outside = ""  # how it ended, when it ended without a result of its own
        self.delete_by: str | None = None
        self.removed_apps: list[str] | None = None
        # Handlers in flight that hold the run from continuing as new; an update being checked
        # (a second one is refused until it ends).
        self.publishing = 0
        self.updating = False
        self.experiment_child: ChildWorkflowHandle[Any, ExperimentStatus] | None = None  # started by this run
        self.experiment_ended: ExperimentStatus | None = None
        self.experiment_stopping = False
        self.arms_refused: ApplyPlanInput | None = None  # a replan the arms could not take: it waits
        self.arms_moved: ArmsMoved | None = None  # the experiment's answer to the latest move of its arms
        # A serving model checks Serve against its record at the start of each run and after
        # each rollout, then every `reconcile.interval_seconds` while idle.
        self.reconcile_due = self.record.serving_set is not None

    def find(self, set_id: str | None) -> SnapshotSet | None:
        return next((s for s in self.record.sets if s.id == set_id), None)

    def set_status(self, set_id: str, status: SetStatus, detail: str = "") -> None:
        self.record.sets = [
            s.model_copy(update={"status": status, "detail": detail or s.detail}) if s.id == set_id else s
            for s in self.record.sets
        ]

    def may_continue(self) -> bool:
        """The history is full and nothing holds this run (a delete waits for the rollout)."""
        return self.delete_by is None and self.history_full()

    def has_work(self) -> bool:
        """Something the loop must do: a queued set, a replanned placement, an experiment, a delete."""
        r = self.record
        busy = bool(r.queued) or r.pending_plan is not None or r.experiment is not None
        return busy or self.delete_by is not None

    def history_full(self) -> bool:
        info = workflow.info()
        return (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() >= self.input.history_limit
        )

    def rollout_status(
        self,
        child_id: str,
        state: RolloutState,
        generations: list[int],
        detail: str,
        old: SnapshotSet | None,
        new: SnapshotSet,
    ) -> RolloutStatus:
        """The model's summary of its latest rollout; the child's `status` query has the live view."""
        done = state == RolloutState.COMPLETED
        traffic = {new.id: 100.0 if done else 0.0}
        if old is not None and old.id == new.id:  # a capacity move: the same set serves throughout
            traffic = {new.id: 100.0}
        elif old is not None:
            traffic[old.id] = 0.0 if done else 100.0
        return RolloutStatus(
            model=self.spec.name,
            set_id=new.id,
            from_set_id=old.id if old else None,
            state=state,
            step="finished" if state != RolloutState.RUNNING else "running",
            traffic_percent=traffic,
            generations=generations,
            detail=detail,
            workflow_id=child_id,
            steps=list(self.spec.rollout.steps),
            updated_at=workflow.now(),
        )

    def state(self) -> ModelStatus:
        if self.delete_by is not None:
            return ModelStatus.DELETING
        if self.record.active_rollout is not None:
            return ModelStatus.ROLLING_OUT
        return ModelStatus.SERVING if self.record.serving_set else ModelStatus.EMPTY

    def upsert_state(self) -> None:
        workflow.upsert_search_attributes(
            [MODEL_KEY.value_set(self.spec.name), STATE_KEY.value_set(self.state().value)]
        )
        self.publish_details()

    def publish_details(self) -> None:
        """The UI's current details, and the time `get` is as of (no command: replay-safe)."""
        record = self.record
        record.updated_at = workflow.now()
        lines = [f"**{self.state()}**, owner {self.spec.owner}"]
        lines.append(f"serving: {record.serving_set or 'nothing'}")
        if record.queued:
            lines.append(f"queued: {', '.join(record.queued)}")
        if record.plan is not None:
            lines.append(f"placement revision {record.plan.revision}: {', '.join(_regions(record.plan))}")
        for s in record.sets[-5:]:
            lines.append(f"- {s.id} ({s.version}): {s.status}")
        last = record.rollout
        if last is not None and last.state.is_terminal:
            lines.append(f"last rollout {last.workflow_id}: outcome {last.state.value}")
        if record.spec_pending is not None:
            pending = record.spec_pending
            lines.append(f"spec update {pending.change} rolls out with {pending.set_id}")
        elif record.spec_changes:
            change = record.spec_changes[-1]
            lines.append(f"spec update {change.number} by {change.who}: {change.outcome}")
        checks = record.reconcile
        if checks.repairs or checks.failures:
            lines.append(
                f"serving checks: {checks.checks}, {checks.repairs} repaired Serve "
                f"(last: {checks.last_repair or 'none'}), {checks.failures} could not run"
            )
        workflow.set_current_details("\n\n".join(lines))


def _regions(plan: Plan) -> list[str]:
    return sorted({r for p in plan.deployments.values() for r in p.regions()})
