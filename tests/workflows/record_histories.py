"""Records the workflow histories that `test_recorded_histories.py` replays: run it on a commit
before a change to the workflows, keep its files in histories/, and the test then shows that the
changed workflows replay what the old ones wrote (a worker upgraded mid-life meets exactly those).

    python -m tests.workflows.record_histories [--prefix model-before-composition]

It starts its own Temporal dev server and runs the workflows with the activities faked at their
seam (the workflow tests' `FakeServing`), so what it records is the workflows' own decisions:

- `<prefix>-first-run`: a ModelWorkflow publishes v1 and is terminated while serving;
- `<prefix>-adopted`: the SDK adopts that model; the new run rolls v2 out, publishes v3 held,
  runs an experiment of v3 against v2 to its end, and is deleted;
- `<prefix>-rollout`: the RolloutWorkflow of v2 under the adopted run;
- `<prefix>-experiment`: the ExperimentWorkflow of v3 against v2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from pathlib import Path

from temporalio.client import Client, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from ipnext.activities.rollouts import RolloutActivities
from ipnext.client.sdk import Client as IpnextClient
from ipnext.client.worker import INTERCEPTORS, WORKFLOWS
from ipnext.contracts.experiment import ExperimentStarted, StartExperimentInput
from ipnext.contracts.model import DeleteInput, DeleteResult, ModelWorkflowInput, PublishResult
from ipnext.names import (
    ARMS_KEY,
    MODEL_KEY,
    REGIONS_DOWN_KEY,
    STATE_KEY,
    TRAFFIC_KEY,
    model_workflow_id,
    rollout_workflow_id,
)
from ipnext.spec.settings import Settings, TemporalSettings

from .fakes import SPEC, FakeServing, request, until, until_rollout

HISTORIES = Path(__file__).parent / "histories"


async def record(temporal: Client, prefix: str) -> dict[str, WorkflowHistory]:
    """Runs the scenario of the module docstring; returns each history by its file's stem."""
    fake = FakeServing()
    fake.click_rates = {"app-2": 0.2, "app-3": 0.3}
    fake.rate = 400
    queue = f"rec-{uuid.uuid4().hex[:8]}"
    outcomes = RolloutActivities(temporal)
    activities = [*fake.activities(), outcomes.rollout_outcome, outcomes.experiment_outcome]
    model_id = model_workflow_id(SPEC.name)
    async with Worker(
        temporal, task_queue=queue, workflows=WORKFLOWS, activities=activities, interceptors=INTERCEPTORS
    ):
        first = await temporal.start_workflow(
            "ModelWorkflow", ModelWorkflowInput(spec=SPEC), id=model_id, task_queue=queue
        )
        await first.execute_update("publish", request("v1"), result_type=PublishResult)
        await until(first, lambda s: s.serving_set == "wf-model@1" and s.state == "serving")
        await first.terminate("recorded: an operator ends it from the Temporal UI")
        histories = {f"{prefix}-first-run": await first.fetch_history()}

        address = temporal.service_client.config.target_host
        settings = Settings(temporal=TemporalSettings(address=address, task_queue=queue))
        async with await IpnextClient.connect(settings, identity="recorder") as ipn:
            await ipn.adopt_model(SPEC.name)
        adopted = temporal.get_workflow_handle(model_id)
        await until(adopted, lambda s: s.serving_set == "wf-model@1" and s.state == "serving")
        await adopted.execute_update("publish", request("v2"), result_type=PublishResult)
        await until(adopted, lambda s: s.serving_set == "wf-model@2" and s.state == "serving")
        rollout = await until_rollout(temporal, "wf-model@2", lambda s: s.state.is_terminal)
        print(f"rollout of wf-model@2: {rollout.state.value}")
        held = request("v3").model_copy(update={"hold": True})
        await adopted.execute_update("publish", held, result_type=PublishResult)
        ask = StartExperimentInput(
            name="exp-rec", treatment="wf-model@3", duration_seconds=2, check_seconds=0.2, who="recorder"
        )
        started = await adopted.execute_update("start_experiment", ask, result_type=ExperimentStarted)
        state = await until(adopted, lambda s: s.experiments != [] and s.experiment is None, timeout=60)
        print(f"experiment {started.workflow_id}: {state.experiments[-1].outcome}")
        deleted = await adopted.execute_update(
            "delete", DeleteInput(who="recorder"), result_type=DeleteResult
        )
        await adopted.result()
        print(f"deleted, removing {deleted.removed_apps}")
        histories[f"{prefix}-adopted"] = await adopted.fetch_history()
        histories[f"{prefix}-rollout"] = await temporal.get_workflow_handle(
            rollout_workflow_id(SPEC.name, "wf-model@2")
        ).fetch_history()
        histories[f"{prefix}-experiment"] = await temporal.get_workflow_handle(
            started.workflow_id
        ).fetch_history()
    return histories


async def main(prefix: str) -> None:
    env = await WorkflowEnvironment.start_local(
        data_converter=pydantic_data_converter,
        dev_server_existing_path=str(Path(sys.executable).parent / "temporal"),
        search_attributes=[MODEL_KEY, STATE_KEY, TRAFFIC_KEY, REGIONS_DOWN_KEY, ARMS_KEY],
    )
    try:
        histories = await record(env.client, prefix)
    finally:
        await env.shutdown()
    for stem, history in histories.items():
        path = HISTORIES / f"{stem}.json"
        path.write_text(json.dumps(json.loads(history.to_json()), indent=1) + "\n")
        print(f"{path.name}: {len(history.events)} events")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", default="model-before-composition")
    asyncio.run(main(parser.parse_args().prefix))
