"""ValidateModelWorkflow on a real Temporal server with the real activity: the spec check runs
on the worker (its factories imported in a child process) and a bad spec's error comes back
typed, naming the field."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from ipnext.activities.validate import validate_model_spec
from ipnext.contracts.model import ValidateSpecInput
from ipnext.names import Workflows, validate_workflow_id
from ipnext.spec.model import ModelSpec, load_model_spec
from ipnext.workflows.validate_model_workflow import ValidateModelWorkflow

REPO = Path(__file__).resolve().parents[2]
SPEC = load_model_spec(REPO / "examples" / "click_ranker" / "model.yaml")

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(120)]


async def check(temporal: Client, queue: str, spec: ModelSpec) -> None:
    await temporal.execute_workflow(
        Workflows.VALIDATE_MODEL,
        ValidateSpecInput(spec=spec),
        id=validate_workflow_id(spec.name, uuid.uuid4().hex),
        task_queue=queue,
    )


async def test_the_worker_checks_the_spec_and_names_the_bad_factory(temporal: Client) -> None:
    queue = f"validate-{uuid.uuid4().hex[:8]}"
    data = SPEC.model_dump(mode="json")
    data["parts"]["dense"]["factory"] = "ipnext.examples.click_ranker.parts:NoSuchPart"
    bad = ModelSpec.model_validate(data)
    with ThreadPoolExecutor(max_workers=2) as executor:
        async with Worker(
            temporal,
            task_queue=queue,
            workflows=[ValidateModelWorkflow],
            activities=[validate_model_spec],
            activity_executor=executor,
        ):
            await check(temporal, queue, SPEC)
            with pytest.raises(WorkflowFailureError) as failed:
                await check(temporal, queue, bad)
    cause = failed.value.cause
    while cause is not None and not isinstance(cause, ApplicationError):
        cause = cause.cause
    assert isinstance(cause, ApplicationError) and cause.type == "SpecError", failed.value
    assert "parts.dense.factory" in cause.message and "NoSuchPart" in cause.message
