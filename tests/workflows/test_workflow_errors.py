"""A workflow that finds its own state inconsistent fails at once with a non-retryable
ApplicationError naming what was wrong, instead of retrying its task forever."""

from __future__ import annotations

import uuid

import pytest
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from ipnext.client.worker import WORKFLOWS
from ipnext.contracts.model import ModelRecord, ModelWorkflowInput, ModelWorkflowResult

from .fakes import SPEC, FakeServing

pytestmark = pytest.mark.timeout(60)


async def test_a_record_queueing_an_unknown_set_fails_the_model_workflow_by_name(temporal: Client) -> None:
    fake = FakeServing()
    queue = f"wf-{uuid.uuid4().hex[:8]}"
    record = ModelRecord(queued=["wf-model@9"])  # carried over, but no such set was published
    async with Worker(temporal, task_queue=queue, workflows=WORKFLOWS, activities=fake.activities()):
        with pytest.raises(WorkflowFailureError) as failed:
            await temporal.execute_workflow(
                "ModelWorkflow",
                ModelWorkflowInput(spec=SPEC, record=record),
                id=f"model/wf-{uuid.uuid4().hex[:8]}",
                task_queue=queue,
                result_type=ModelWorkflowResult,
            )
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "ModelRecordError"
    assert cause.non_retryable and "wf-model@9" in cause.message
    assert fake.deployed == []  # nothing was rolled out
