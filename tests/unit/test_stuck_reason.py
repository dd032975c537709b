"""`temporal.stuck_reason` on Temporal's answers, faked at the client: a pending workflow task
past its first attempt, and between attempts (no task pending) a task failure last in history."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType, WorkflowExecutionStatus
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.workflow.v1 import PendingWorkflowTaskInfo, WorkflowExecutionInfo
from temporalio.api.workflowservice.v1 import (
    DescribeWorkflowExecutionResponse,
    GetWorkflowExecutionHistoryReverseResponse,
)
from temporalio.service import RPCError, RPCStatusCode

from ipnext.client.temporal import stuck_reason

RUNNING = WorkflowExecutionStatus.WORKFLOW_EXECUTION_STATUS_RUNNING


class FakeClient:
    def __init__(
        self, described: DescribeWorkflowExecutionResponse | RPCError, last: EventType.ValueType
    ) -> None:
        self.namespace = "default"
        self.described, self.last, self.reads = described, last, 0

        async def reverse(request: Any) -> GetWorkflowExecutionHistoryReverseResponse:
            self.reads += 1
            answer = GetWorkflowExecutionHistoryReverseResponse()
            answer.history.events.append(HistoryEvent(event_type=self.last))
            return answer

        self.workflow_service = SimpleNamespace(get_workflow_execution_history_reverse=reverse)

    def get_workflow_handle(self, workflow_id: str) -> Any:
        async def describe() -> Any:
            if isinstance(self.described, RPCError):
                raise self.described
            return SimpleNamespace(raw_description=self.described)

        return SimpleNamespace(describe=describe)


def described(
    attempt: int | None, status: WorkflowExecutionStatus.ValueType = RUNNING
) -> DescribeWorkflowExecutionResponse:
    answer = DescribeWorkflowExecutionResponse(workflow_execution_info=WorkflowExecutionInfo(status=status))
    if attempt is not None:
        answer.pending_workflow_task.CopyFrom(PendingWorkflowTaskInfo(attempt=attempt))
    return answer


COMPLETED = EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
FAILED = EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED


@pytest.mark.parametrize(
    ("answer", "last", "says"),
    [
        (described(1), FAILED, ""),  # a first attempt runs: nothing failed twice yet
        (described(4), COMPLETED, "has failed 3 time(s) in a row"),
        (described(None), FAILED, "has failed 1+ time(s) in a row"),  # between attempts
        (described(None), COMPLETED, ""),
        (described(None, WorkflowExecutionStatus.WORKFLOW_EXECUTION_STATUS_COMPLETED), FAILED, ""),
        (RPCError("gone", RPCStatusCode.NOT_FOUND, b""), FAILED, ""),
        (RPCError("busy", RPCStatusCode.UNAVAILABLE, b""), FAILED, "could not describe it (UNAVAILABLE"),
    ],
)
async def test_a_stuck_workflow_is_found_during_and_between_its_attempts(
    answer: Any, last: EventType.ValueType, says: str
) -> None:
    client = FakeClient(answer, last)
    reason = await stuck_reason(client, "rollout/m/m@2")  # type: ignore[arg-type]
    assert (says in reason) if says else reason == "", reason
