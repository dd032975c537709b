"""Every history in histories/ replays on today's workflows without a nondeterminism error: what
a worker upgraded mid-life meets. `rollout-` and `fleet-before-identities` were recorded before the
workflows read the operator identity header; `model-before-composition-*` (a ModelWorkflow's
publish, termination, adoption, rollout, experiment and delete, with its RolloutWorkflow and
ExperimentWorkflow) before ModelWorkflow was composed of collaborators. `record_histories.py`
records a new set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from ipnext.client.worker import INTERCEPTORS, WORKFLOWS

HISTORIES = Path(__file__).parent / "histories"
RECORDED = sorted(p.name for p in HISTORIES.glob("*.json"))


def test_the_histories_folder_holds_every_workflow_kind_recorded() -> None:
    """A recording that lost a file would shrink what the replay test below shows."""
    kinds = {
        json.loads((HISTORIES / name).read_text())["events"][0]["workflowExecutionStartedEventAttributes"][
            "workflowType"
        ]["name"]
        for name in RECORDED
    }
    assert kinds >= {"ModelWorkflow", "RolloutWorkflow", "ExperimentWorkflow", "FleetWorkflow"}, kinds


@pytest.mark.parametrize("recorded", RECORDED)
async def test_a_recorded_history_replays_on_todays_workflows(recorded: str) -> None:
    history = WorkflowHistory.from_json(
        recorded.removesuffix(".json"), json.loads((HISTORIES / recorded).read_text())
    )
    replayer = Replayer(
        workflows=WORKFLOWS, interceptors=INTERCEPTORS, data_converter=pydantic_data_converter
    )
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, result.replay_failure
