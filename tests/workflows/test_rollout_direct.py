"""RolloutWorkflow driven directly on a real Temporal dev server, activities replaced at their
seam. `sync: independent`: each changed part walks the steps on its own while the rest of the
DAG stays on the old set, the unchanged parts follow in one handover, and a breach in a later
part rolls all back. A long pause continues as new without losing or repeating a step."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.worker import Worker

from ipnext.client.worker import WORKFLOWS
from ipnext.contracts.plan import DeploymentPlacement, Plan
from ipnext.contracts.rollout import PauseInput, ResumeInput, RolloutInput, RolloutResult
from ipnext.names import RolloutState, poll_until
from ipnext.spec.model import ModelSpec, SnapshotRef, SnapshotSet

from .fakes import SPEC, WAIT_S, FakeServing, until_status

pytestmark = pytest.mark.timeout(120)

IDLE = 1e-6  # the share a part that does not move yet keeps (one replica)

TWO_PARTS = ModelSpec.model_validate(
    {
        **SPEC.model_dump(mode="json"),
        "sync": "independent",
        "parts": {
            "embed": {"factory": "m:f", "hardware": {"cpu-std": {"units": 1, "qps": 100}}},
            "dense": {"factory": "m:g", "hardware": {"cpu-std": {"units": 1, "qps": 100}}},
        },
        "dag": [["input", "embed"], ["embed", "dense"], ["dense", "output"]],
    }
)
PLACEMENT = DeploymentPlacement(replicas={"us-east": {"cpu-std": 4}}, fractions={"us-east": {"us-east": 1.0}})
PLAN = Plan(deployments={f"wf-model/{p}": PLACEMENT for p in ("embed", "dense")}, cost=1.0, solver="fake")


def snapshot_set(number: int, versions: dict[str, str]) -> SnapshotSet:
    return SnapshotSet(
        id=f"wf-model@{number}",
        number=number,
        version=f"v{number}",
        parts={
            part: SnapshotRef(
                uri=f"file:///snap/{part}/{v}", sha256="a" * 64, snapshot_id=f"wf-model/{part}@{v}"
            )
            for part, v in versions.items()
        },
        status="serving" if number == 1 else "rolling_out",
        published_at=datetime(2026, 11, 1, tzinfo=UTC),
    )


async def roll(temporal: Client, fake: FakeServing, new_versions: dict[str, str]) -> RolloutResult:
    old = snapshot_set(1, {"embed": "v1", "dense": "v1"})
    new = snapshot_set(2, new_versions)
    queue = f"wf-{uuid.uuid4().hex[:8]}"
    async with Worker(temporal, task_queue=queue, workflows=WORKFLOWS, activities=fake.activities()):
        try:
            result: RolloutResult = await temporal.execute_workflow(
                "RolloutWorkflow",
                RolloutInput(
                    spec=TWO_PARTS, plan=PLAN, new_set=new, old_set=old, old_apps={"us-east": "app-1"}
                ),
                id=f"rollout/wf-model/{uuid.uuid4().hex[:8]}",
                task_queue=queue,
                result_type=RolloutResult,
            )
        except WorkflowFailureError as err:  # a rollout that did not complete: its result is in the failure
            found = RolloutResult.of_failure(err)
            assert found is not None, err
            return found
    return result


async def test_only_the_changed_part_moves_and_the_rest_follows_in_one_handover(temporal: Client) -> None:
    fake = FakeServing()
    result = await roll(temporal, fake, {"embed": "v2", "dense": "v1"})
    assert result.state == RolloutState.COMPLETED, result.detail
    # Every step keeps the DAG on the old set and calls embed on the new one for its share,
    # counting requests by embed's set; the last generation hands the whole DAG over.
    assert fake.routes == [{"us-east": {"app-1": 100.0}}] * 2 + [{"us-east": {"app-2": 100.0}}]
    assert fake.part_routes == [
        ({"us-east": {"embed": {"app-1": 50.0, "app-2": 50.0}}}, "embed"),
        ({"us-east": {"embed": {"app-2": 100.0}}}, "embed"),
        ({}, None),
    ]
    # The new dense keeps one replica until the handover, then scales to the plan before it.
    new = [scales for set_id, scales in fake.part_scales if set_id == "wf-model@2"]
    assert new == [{"embed": 0.5, "dense": IDLE}, {"embed": 1.0, "dense": IDLE}, {}]
    old = [scales for set_id, scales in fake.part_scales if set_id == "wf-model@1"]
    assert old == [{"embed": 0.5, "dense": 1.0}, {"embed": IDLE, "dense": 1.0}]
    assert fake.removed == ["app-1"]
    assert result.status is not None
    assert result.status.steps == [50, 100] and result.status.steps_done == 2
    assert result.status.part_traffic == {"embed": 100.0}
    assert result.status.traffic_percent == {"wf-model@2": 100.0, "wf-model@1": 0.0}
    assert all(g.judged and not g.breached for g in result.status.gates)


async def test_each_changed_part_walks_the_steps_on_its_own_in_dag_order(temporal: Client) -> None:
    fake = FakeServing()
    result = await roll(temporal, fake, {"embed": "v2", "dense": "v2"})
    assert result.state == RolloutState.COMPLETED, result.detail
    assert fake.part_routes == [
        ({"us-east": {"embed": {"app-1": 50.0, "app-2": 50.0}}}, "embed"),
        ({"us-east": {"embed": {"app-2": 100.0}}}, "embed"),
        ({"us-east": {"embed": {"app-2": 100.0}, "dense": {"app-1": 50.0, "app-2": 50.0}}}, "dense"),
        ({"us-east": {"embed": {"app-2": 100.0}, "dense": {"app-2": 100.0}}}, "dense"),
        ({}, None),
    ]
    assert result.status is not None
    assert result.status.steps == [50, 100, 50, 100] and result.status.steps_done == 4
    assert result.status.generations == [1, 2, 3, 4, 5]
    assert result.status.part_traffic == {"embed": 100.0, "dense": 100.0}


async def test_a_breach_in_a_later_part_rolls_every_part_back(temporal: Client) -> None:
    fake = FakeServing()
    fake.bad_parts = {("app-2", "dense")}  # the new dense fails; the new embed is healthy
    result = await roll(temporal, fake, {"embed": "v2", "dense": "v2"})
    assert result.state == RolloutState.ROLLED_BACK
    assert "error_rate" in result.detail
    # embed had moved (100%); dense was at its first step: dense goes back at once (its old
    # replicas carry it), then the old set scales back up and the whole DAG returns to it.
    assert fake.part_routes[2:] == [
        ({"us-east": {"embed": {"app-2": 100.0}, "dense": {"app-1": 50.0, "app-2": 50.0}}}, "dense"),
        ({"us-east": {"embed": {"app-2": 100.0}, "dense": {"app-1": 100.0}}}, "dense"),
        ({}, None),
    ]
    assert fake.routes[-1] == {"us-east": {"app-1": 100.0}}
    assert fake.part_scales[-1] == ("wf-model@1", {})  # the old set back to the plan's size
    assert fake.scales[-1] == ("wf-model@1", 1, 1.0)
    assert fake.removed == ["app-2"]
    assert result.apps == {"us-east": "app-1"}
    assert result.status is not None and result.status.part_traffic == {"embed": 0.0, "dense": 0.0}


async def test_a_long_pause_continues_as_new_and_keeps_its_state(temporal: Client) -> None:
    """A paused rollout checks its gates every interval; its history would grow without end, so
    it continues as new (here after 100 events) carrying what it applied, and resumes fine."""
    fake = FakeServing()
    one_part = SPEC.model_copy(update={"rollout": SPEC.rollout.model_copy(update={"steps": [50, 100]})})
    old = snapshot_set(1, {"embed": "v1"})
    new = snapshot_set(2, {"embed": "v2"})
    queue = f"wf-{uuid.uuid4().hex[:8]}"
    workflow_id = f"rollout/wf-model/{uuid.uuid4().hex[:8]}"
    async with Worker(temporal, task_queue=queue, workflows=WORKFLOWS, activities=fake.activities()):
        handle = await temporal.start_workflow(
            "RolloutWorkflow",
            RolloutInput(
                spec=one_part,
                plan=PLAN,
                new_set=new,
                old_set=old,
                old_apps={"us-east": "app-1"},
                history_limit=100,
            ),
            id=workflow_id,
            task_queue=queue,
            result_type=RolloutResult,
        )
        first_run = handle.first_execution_run_id
        await until_status(handle, lambda s: "baking" in s.step)
        await handle.signal("pause", PauseInput(reason="dashboards look odd", who="ann"))
        first = temporal.get_workflow_handle(workflow_id, run_id=first_run)

        async def first_status() -> WorkflowExecutionStatus | None:
            return (await first.describe()).status

        await poll_until(  # the paused bake keeps checking gates until the history is long
            first_status,
            lambda status: status == WorkflowExecutionStatus.CONTINUED_AS_NEW,
            timeout_s=WAIT_S,
            interval_s=0.1,
            what="the paused rollout continued as new",
        )
        held = await until_status(handle, lambda s: s.state == RolloutState.PAUSED)
        assert held.traffic_percent == {"wf-model@2": 50.0, "wf-model@1": 50.0}
        assert held.generations == [1] and held.pauses[0].who == "ann"
        assert len(fake.routes) == 1  # the continued run applied nothing again
        await handle.signal("resume", ResumeInput(who="bob"))
        result = await handle.result()
    assert result.state == RolloutState.COMPLETED
    assert fake.routes == [{"us-east": {"app-1": 50.0, "app-2": 50.0}}, {"us-east": {"app-2": 100.0}}]
    assert result.status is not None and result.status.generations == [1, 2]
    assert result.status.steps_done == 2 and result.status.pauses[0].resumed_by == "bob"
    assert fake.removed == ["app-1"]
