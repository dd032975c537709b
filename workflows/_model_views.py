"""How a model shows itself: its state, the Temporal UI's details and search attributes, and its
summary of a rollout. ModelWorkflow inherits these; nothing here runs outside a workflow.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from ipnext.contracts.model import ModelRecord
    from ipnext.contracts.plan import Plan
    from ipnext.contracts.rollout import RolloutStatus
    from ipnext.names import MODEL_KEY, STATE_KEY, ModelStatus, RolloutState
    from ipnext.spec.model import ModelSpec, SnapshotSet

__all__ = ["ModelViews"]


class ModelViews:
    """Read-only views of the model's state; ModelWorkflow sets the state in its constructor."""

    _spec: ModelSpec
    _record: ModelRecord
    _delete_by: str | None

    def _rollout_status(
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
            model=self._spec.name,
            set_id=new.id,
            from_set_id=old.id if old else None,
            state=state,
            step="finished" if state != RolloutState.RUNNING else "running",
            traffic_percent=traffic,
            generations=generations,
            detail=detail,
            workflow_id=child_id,
            steps=list(self._spec.rollout.steps),
            updated_at=workflow.now(),
        )

    def _state(self) -> ModelStatus:
        if self._delete_by is not None:
            return ModelStatus.DELETING
        if self._record.active_rollout is not None:
            return ModelStatus.ROLLING_OUT
        return ModelStatus.SERVING if self._record.serving_set else ModelStatus.EMPTY

    def _upsert_state(self) -> None:
        workflow.upsert_search_attributes(
            [MODEL_KEY.value_set(self._spec.name), STATE_KEY.value_set(self._state().value)]
        )
        self._publish_details()

    def _publish_details(self) -> None:
        """The UI's current details, and the time `get` is as of (no command: replay-safe)."""
        record = self._record
        record.updated_at = workflow.now()
        lines = [f"**{self._state()}**, owner {self._spec.owner}"]
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
