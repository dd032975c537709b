"""What `ipnext rollout status` and `ipnext model get` show says how fresh it is (on a real
Temporal dev server, the activities faked): the age of the status, and a warning when the
workflow's task keeps failing, so that what it answers is its last good state."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.worker import Worker

from ipnext.activities.rollouts import RolloutActivities
from ipnext.client.worker import WORKFLOWS
from ipnext.contracts.model import ModelWorkflowInput, PublishResult
from ipnext.names import poll_until, rollout_workflow_id

from .fakes import FakeServing, request, until, until_rollout, with_rollout

pytestmark = pytest.mark.timeout(180)

TEMPORAL = str(Path(sys.executable).parent / "temporal")


async def _cli(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "IPNEXT_TEMPORAL__ADDRESS": address}
    argv = [sys.executable, "-m", "ipnext.client.cli", *args]
    return await asyncio.to_thread(subprocess.run, argv, env=env, capture_output=True, text=True, timeout=90)


async def test_status_says_its_age_and_warns_when_the_workflow_is_stuck(temporal: Client) -> None:
    fake = FakeServing()
    queue = f"wf-{uuid.uuid4().hex[:8]}"
    activities = [*fake.activities(), RolloutActivities(temporal).rollout_outcome]
    worker = Worker(temporal, task_queue=queue, workflows=WORKFLOWS, activities=activities)
    spec = with_rollout(steps=[50, 100], bake_seconds=120.0)
    model = await temporal.start_workflow(
        "ModelWorkflow", ModelWorkflowInput(spec=spec), id="model/wf-model", task_queue=queue
    )
    address = temporal.service_client.config.target_host
    rid = rollout_workflow_id("wf-model", "wf-model@2")
    async with worker:
        await model.execute_update("publish", request("v1"), result_type=PublishResult)
        await until(model, lambda s: s.serving_set == "wf-model@1")
        await model.execute_update("publish", request("v2"), result_type=PublishResult)
        await until_rollout(temporal, "wf-model@2", lambda s: "baking" in s.step)
        fresh = await _cli(address, "rollout", "status", "wf-model")
        got = await _cli(address, "model", "get", "wf-model")
        # Three payloads: the one shape a signal handler cannot take (workflows/_signals.py), so
        # the rollout's workflow task fails, and fails again on every retry.
        proc = await asyncio.create_subprocess_exec(
            TEMPORAL,
            *("workflow", "signal", "--workflow-id", rid, "--name", "resume"),
            *("--input", '"a"', "--input", '"b"', "--input", '"c"', "--address", address),
        )
        assert await proc.wait() == 0

        async def attempt() -> int:
            raw = (await temporal.get_workflow_handle(rid).describe()).raw_description
            return raw.pending_workflow_task.attempt if raw.HasField("pending_workflow_task") else 0

        await poll_until(attempt, lambda n: n > 1, timeout_s=60, what="a failing workflow task")
        stuck = await _cli(address, "rollout", "status", "wf-model")
    print(fresh.stdout, got.stderr, stuck.stdout, stuck.stderr, sep="\n---\n")
    assert fresh.returncode == 0 and got.returncode == 0 and stuck.returncode == 0, (fresh, got, stuck)
    age = re.search(r"as of (\d+) s ago", fresh.stdout)
    assert age is not None and "MAY BE STALE" not in fresh.stdout, fresh.stdout
    assert re.search(r"model/wf-model: as of \d+ s ago", got.stderr), got.stderr
    assert '"updated_at"' in got.stdout  # the query's answer carries its time too
    assert "MAY BE STALE" in stuck.stdout and "workflow task has failed" in stuck.stdout, stuck.stdout
    assert re.search(r"as of \d+ s ago", stuck.stdout), stuck.stdout  # the model's record, stamped
