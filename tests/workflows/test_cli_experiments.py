"""`ipnext experiment start|status|stop|report|promote` and `ipnext shadow start|status|stop`
against a real Temporal dev server (the activities faked): a refused start exits 2 with its
reason, a started one is followed live, stopped by on-call, its report printed with the winner,
and the winner promoted: it rolls out; a shadow's comparisons are shown and kept on its set,
and its candidate promoted on that evidence."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid

import pytest
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.worker import Worker

from ipnext.activities.rollouts import RolloutActivities
from ipnext.client.worker import WORKFLOWS
from ipnext.contracts.experiment import ExperimentStatus
from ipnext.contracts.model import ModelWorkflowInput, PublishResult
from ipnext.names import experiment_workflow_id, poll_until

from .fakes import SPEC, WAIT_S, FakeServing, request, until

pytestmark = pytest.mark.timeout(180)

WINDOWS = 3  # experiment windows counted before on-call stops it: evidence enough for a winner


async def cli(address: str, *args: str, command: str = "experiment") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "IPNEXT_TEMPORAL__ADDRESS": address, "USER": "ann"}
    argv = [sys.executable, "-m", "ipnext.client.cli", command, *args]
    return await asyncio.to_thread(subprocess.run, argv, env=env, capture_output=True, text=True, timeout=90)


async def test_experiment_verbs(temporal: Client) -> None:
    fake = FakeServing()
    fake.click_rates = {"app-1": 0.2, "app-2": 0.3}
    fake.rate = 4000
    queue = f"wf-{uuid.uuid4().hex[:8]}"
    activities = [
        *fake.activities(),
        RolloutActivities(temporal).rollout_outcome,
        RolloutActivities(temporal).experiment_outcome,
    ]
    worker = Worker(temporal, task_queue=queue, workflows=WORKFLOWS, activities=activities)
    model = await temporal.start_workflow(
        "ModelWorkflow", ModelWorkflowInput(spec=SPEC), id="model/wf-model", task_queue=queue
    )
    address = temporal.service_client.config.target_host
    async with worker:
        await model.execute_update("publish", request("v1"), result_type=PublishResult)
        await until(model, lambda s: s.serving_set == "wf-model@1")
        refused = await cli(
            address, "start", "wf-model", "--name", "e1", "--treatment", "wf-model@2", "--duration", "1m"
        )
        assert refused.returncode == 2 and "treatment: 'wf-model@2' is not a held set" in refused.stderr, (
            refused.stderr
        )
        await model.execute_update(
            "publish", request("v2").model_copy(update={"hold": True}), result_type=PublishResult
        )
        started = await cli(  # the treatment by its version, the split as control/treatment
            address,
            "start",
            "wf-model",
            "--name",
            "e1",
            "--arms",
            "control=@current,treatment=v2",
            "--split",
            "50/50",
            "--unit",
            "user",
            "--metric",
            "click:higher",
            "--duration",
            "1h",
            "--check",
            "0.2s",
        )
        assert started.returncode == 0, started.stderr
        assert "experiment e1 of wf-model: wf-model@1 (control) against wf-model@2" in started.stdout
        await until(model, lambda s: s.experiment is not None and s.experiment.started)
        per_window = fake.rate // 2  # each arm's requests in one window (split 50/50)
        await poll_until(
            lambda: temporal.get_workflow_handle(experiment_workflow_id("wf-model", "e1")).query(
                "status", result_type=ExperimentStatus
            ),
            lambda status: (
                status.report is not None
                and all(arm.requests >= WINDOWS * per_window for arm in status.report.arms)
            ),
            timeout_s=2 * WAIT_S,  # each window waits its check; a loaded box takes longer
            interval_s=0.2,
            what=f"{WINDOWS} windows counted",
        )
        live = await cli(address, "status", "wf-model")
        assert live.returncode == 0 and "experiment e1 of wf-model: running" in live.stdout, live.stderr
        stopped = await cli(address, "stop", "wf-model", "--reason", "saw enough")
        assert stopped.returncode == 0, stopped.stderr
        await until(model, lambda s: s.experiments != [])
        report = await cli(address, "report", "wf-model")
        as_json = await cli(address, "report", "wf-model", "--name", "e1", "--json")
        promoted = await cli(address, "promote", "wf-model")
        assert promoted.returncode == 0 and "wf-model@2 queued for its rollout" in promoted.stdout, (
            promoted.stderr
        )
        again = await cli(address, "promote", "wf-model")  # no longer held: refused, nothing changes
        assert again.returncode == 2 and "is not a held set" in again.stderr, again.stderr
        state = await until(model, lambda s: s.serving_set == "wf-model@2" and s.state == "serving")
        assert state.sets[1].detail == "promoted by ann: won experiment e1"
    assert (
        "experiment e1 of wf-model: ended, stopped" in report.stdout
        and "stopped by ann: saw enough" in report.stdout
    )
    assert "winner: treatment" in report.stdout and "method: always-valid p-values" in report.stdout, (
        report.stdout
    )
    assert "arms assigned per user; the winner decided on click" in report.stdout, report.stdout
    ended = json.loads(as_json.stdout)
    assert ended["outcome"] == "stopped" and ended["report"]["winner"] == "treatment"
    assert ended["treatment_percent"] == 50 and ended["report"]["metrics"] == ["click:higher"]
    print(report.stdout)


async def test_shadow_verbs(temporal: Client) -> None:
    fake = FakeServing()
    fake.shadow_diff = 0.25
    queue = f"wf-{uuid.uuid4().hex[:8]}"
    activities = [*fake.activities(), RolloutActivities(temporal).experiment_outcome]
    worker = Worker(temporal, task_queue=queue, workflows=WORKFLOWS, activities=activities)
    model = await temporal.start_workflow(  # the fakes' model, left running by the test above
        "ModelWorkflow",
        ModelWorkflowInput(spec=SPEC),
        id="model/wf-model",
        task_queue=queue,
        id_conflict_policy=WorkflowIDConflictPolicy.TERMINATE_EXISTING,
    )
    name = SPEC.name
    address = temporal.service_client.config.target_host

    async def shadow(*args: str) -> subprocess.CompletedProcess[str]:
        return await cli(address, *args, command="shadow")

    bad = await shadow("start", name, "--set", f"{name}@2", "--percent", "0")
    assert bad.returncode == 2 and "treatment_percent" in bad.stderr, bad.stderr  # before connecting
    async with worker:
        await model.execute_update("publish", request("v1"), result_type=PublishResult)
        await until(model, lambda s: s.serving_set == f"{name}@1")
        held = request("v2").model_copy(update={"hold": True})
        await model.execute_update("publish", held, result_type=PublishResult)
        started = await shadow("start", name, "--set", f"{name}@2", "--percent", "50", "--check", "0.2s")
        assert started.returncode == 0, started.stderr
        assert f"shadow shadow-2 of {name}: 50% of {name}@1's requests copied to {name}@2" in started.stdout
        await until(model, lambda s: s.experiment is not None and s.experiment.started)
        shadow_id = experiment_workflow_id(name, "shadow-2")
        await poll_until(  # a window compared (a loaded box may take more than a few checks)
            lambda: temporal.get_workflow_handle(shadow_id).query("status", result_type=ExperimentStatus),
            lambda status: len(status.shadow_windows) >= 2,
            timeout_s=2 * WAIT_S,
            interval_s=0.2,
            what="two shadow windows",
        )
        live = await shadow("status", name)
        stopped = await shadow("stop", name, "--reason", "enough evidence")
        assert stopped.returncode == 0, stopped.stderr
        state = await until(model, lambda s: s.experiments != [])
        as_json = await shadow("status", name, "--json")
        promoted = await cli(address, "promote", name, "--name", "shadow-2")  # no winner: its evidence
        assert promoted.returncode == 0, promoted.stderr
        served = await until(model, lambda s: s.serving_set == f"{name}@2" and s.state == "serving")
    assert served.sets[-1].detail == "promoted by ann: after shadow shadow-2", served.sets[-1].detail
    assert live.returncode == 0 and f"shadow shadow-2 of {name}: running" in live.stdout, live.stderr
    assert "compared" in live.stdout and "max |diff| mean 0.25" in live.stdout, live.stdout
    assert "window:" in live.stdout
    ended = json.loads(as_json.stdout)
    assert ended["mode"] == "shadow" and ended["outcome"] == "stopped" and ended["shadow"]["compared"] > 0
    candidate = next(s for s in state.sets if s.id == f"{name}@2")
    assert candidate.status == "held" and candidate.detail.startswith("shadow shadow-2: "), candidate.detail
