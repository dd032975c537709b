"""How a rollout child ended, asked of Temporal: the backstop of its `rollout_ended` signal.

A model workflow that continued as new while its rollout ran no longer holds the child's
handle (Temporal lets a workflow await only children it started itself). The rollout signals
its end to the model's latest run; one that was terminated, or cancelled into a failure, from
the Temporal UI never does, so the model asks here every `rollout_check_seconds`.
"""

from __future__ import annotations

from typing import TypeVar

from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.service import RPCError, RPCStatusCode

from ipnext.contracts.experiment import ExperimentStatus
from ipnext.contracts.rollout import RolloutResult
from ipnext.names import Frozen

__all__ = ["ExperimentOutcome", "RolloutActivities", "RolloutOutcome", "RolloutOutcomeInput"]


class RolloutOutcomeInput(Frozen):
    workflow_id: str


class RolloutOutcome(Frozen):
    running: bool
    result: RolloutResult | None = None  # the rollout's own result, when it completed
    how: str = ""  # how it ended without a result: "terminated", "canceled", "failed", ...


T = TypeVar("T")


class ExperimentOutcome(Frozen):
    running: bool
    result: ExperimentStatus | None = None  # the experiment's own result, when it completed
    how: str = ""


class RolloutActivities:
    def __init__(self, client: Client) -> None:
        self._client = client

    @activity.defn
    async def rollout_outcome(self, input: RolloutOutcomeInput) -> RolloutOutcome:
        """A rollout that did not complete ended FAILED with its result as the failure's
        details: that is its result too (only a failure without one ended it outside its rules)."""
        running, result, how = await self._outcome(input.workflow_id, RolloutResult)
        if how == "failed":
            try:
                await self._client.get_workflow_handle(input.workflow_id).result()
            except WorkflowFailureError as err:
                found = RolloutResult.of_failure(err)
                if found is not None:
                    return RolloutOutcome(running=False, result=found)
        return RolloutOutcome(running=running, result=result, how=how)

    @activity.defn
    async def experiment_outcome(self, input: RolloutOutcomeInput) -> ExperimentOutcome:
        """The same question of an ExperimentWorkflow (its result is its `ExperimentStatus`)."""
        running, result, how = await self._outcome(input.workflow_id, ExperimentStatus)
        return ExperimentOutcome(running=running, result=result, how=how)

    async def _outcome(self, workflow_id: str, result_type: type[T]) -> tuple[bool, T | None, str]:
        """(running, its result once completed, how it ended without one) of a workflow's latest run."""
        handle = self._client.get_workflow_handle(workflow_id, result_type=result_type)
        try:
            described = await handle.describe()
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:  # past retention: it ended long ago
                return False, None, "not found"
            raise
        status = described.status
        if status in (None, WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.CONTINUED_AS_NEW):
            return True, None, ""
        if status == WorkflowExecutionStatus.COMPLETED:
            try:
                return False, await handle.result(), ""
            except WorkflowFailureError as err:  # pragma: no cover - completed runs have a result
                return False, None, f"completed without a result: {err}"
        return False, None, status.name.lower()
