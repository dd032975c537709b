"""RolloutWorkflow rules on a real Temporal dev server, activities replaced at their seam: gates
rolling a bad set back, pause / resume / abort sent with the `temporal` CLI as on-call would,
too little traffic, and freeze windows (refused, overridden, holding a running rollout)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError

from ipnext.contracts.freeze import FreezeOverride, FreezeWindow
from ipnext.contracts.model import PublishResult
from ipnext.contracts.rollout import RolloutResult, RolloutStatus
from ipnext.names import STATE_KEY, RolloutOutcome, RolloutState, poll_until, rollout_workflow_id
from ipnext.spec.model import RouterSpec

from .fakes import (
    WAIT_S,
    FakeServing,
    checks_in,
    request,
    start,
    until,
    until_idle,
    until_reads,
    until_rollout,
    with_rollout,
)

pytestmark = pytest.mark.timeout(120)

TEMPORAL = str(Path(sys.executable).parent / "temporal")
HELD_CHECKS = 5  # checks judged, each a check interval apart, that a hold must outlast


async def on_call(client: Client, *args: str) -> str:
    """Run the temporal CLI against the test server, as on-call would (without blocking the
    event loop the test's worker runs on)."""
    address = client.service_client.config.target_host
    proc = await asyncio.create_subprocess_exec(
        TEMPORAL, *args, "--address", address, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def signal(client: Client, set_id: str, name: str, payload: str) -> None:
    await on_call(
        client,
        "workflow",
        "signal",
        "--workflow-id",
        rollout_workflow_id("wf-model", set_id),
        "--name",
        name,
        "--input",
        payload,
    )


async def serve_v1(handle: WorkflowHandle[Any, Any]) -> None:
    await handle.execute_update("publish", request("v1"), result_type=PublishResult)
    await until(handle, lambda s: s.serving_set == "wf-model@1")


async def roll_out_v2(client: Client, handle: WorkflowHandle[Any, Any], step: str | None = None) -> None:
    """v1 serving, then v2 published; with `step`, return once v2's rollout is at it."""
    await serve_v1(handle)
    await handle.execute_update("publish", request("v2"), result_type=PublishResult)
    if step is not None:
        await until_rollout(client, "wf-model@2", lambda s: step in s.step)


async def test_healthy_rollout_walks_every_step_with_one_generation_each(temporal: Client) -> None:
    fake = FakeServing()
    worker, handle = await start(temporal, fake, with_rollout(steps=[10, 50, 100]))
    async with worker:
        await roll_out_v2(temporal, handle)
        state = await until(handle, lambda s: s.serving_set == "wf-model@2")
        status = await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.COMPLETED)
    assert [r["us-east"] for r in fake.routes[1:]] == [
        {"app-1": 90.0, "app-2": 10.0},
        {"app-1": 50.0, "app-2": 50.0},
        {"app-2": 100.0},
    ]
    assert status.generations == [2, 3, 4]  # one per step, in order, none twice
    assert status.steps == [10, 50, 100] and status.steps_done == 3
    assert status.traffic_percent == {"wf-model@2": 100.0, "wf-model@1": 0.0}
    assert status.gates and all(g.judged and not g.breached for g in status.gates)
    assert fake.scales[1:] == [
        ("wf-model@2", 1, 0.1),
        ("wf-model@1", 1, 0.9),
        ("wf-model@2", 1, 0.5),
        ("wf-model@1", 1, 0.5),
        ("wf-model@2", 1, 1.0),
    ]
    assert fake.removed == ["app-1"] and state.sets[0].status == "retired"


async def test_every_route_carries_the_specs_router_bound(temporal: Client) -> None:
    fake = FakeServing()
    spec = with_rollout(steps=[50, 100])
    spec = spec.model_copy(update={"router": RouterSpec(max_ongoing_requests=33)})
    worker, handle = await start(temporal, fake, spec)
    async with worker:
        await roll_out_v2(temporal, handle)
        await until(handle, lambda s: s.serving_set == "wf-model@2")
    assert len(fake.router_caps) == 3 and set(fake.router_caps) == {33}


async def test_a_breached_gate_rolls_back_in_one_weight_change(temporal: Client) -> None:
    fake = FakeServing()
    fake.bad_apps.add("app-2")
    worker, handle = await start(temporal, fake, with_rollout(steps=[25, 50, 100]))
    async with worker:
        await roll_out_v2(temporal, handle)
        state = await until(handle, lambda s: s.sets[-1].status == "rolled_back")
        status = await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.ROLLED_BACK)
    assert state.serving_set == "wf-model@1" and state.serving_apps == {"us-east": "app-1"}
    # 25% moved, the gate breached in the bake, and all traffic went back in one change.
    assert [r["us-east"] for r in fake.routes[1:]] == [{"app-1": 75.0, "app-2": 25.0}, {"app-1": 100.0}]
    assert fake.scales[1:] == [("wf-model@2", 1, 0.25)]  # the old set was never scaled down
    assert fake.removed == ["app-2"]
    assert "error_rate" in status.detail and "BREACH" in status.detail
    breached = [g for g in status.gates if g.breached]
    assert breached and breached[0].metric == "error_rate" and breached[0].value == 1.0
    assert status.traffic_percent == {"wf-model@2": 0.0, "wf-model@1": 100.0}


async def test_a_rollback_to_a_set_that_fails_its_checksum_holds_for_on_call(temporal: Client) -> None:
    """The gates breach, but the old set's pinned files no longer hash right: the rollout does
    not send traffic back to it (nor fail its model); it holds the split, paused with
    needs_attention and why. Once the files are whole again, on-call's resume rolls back."""
    fake = FakeServing()
    fake.bad_apps.add("app-2")
    fake.corrupt.add("wf-model@1")
    worker, handle = await start(temporal, fake, with_rollout(steps=[25, 50, 100]))
    async with worker:
        await roll_out_v2(temporal, handle)
        held = await until_rollout(
            temporal, "wf-model@2", lambda s: s.state == RolloutState.PAUSED and bool(s.pauses)
        )
        assert held.pauses[-1].reason == "needs_attention" and held.pauses[-1].who == "ipnext"
        assert "wf-model@1 fails its checksum" in held.detail and "error_rate" not in held.detail, held.detail
        await until_idle(rollout(temporal))  # so nothing moves until a resume
        assert [r["us-east"] for r in fake.routes[1:]] == [{"app-1": 75.0, "app-2": 25.0}]
        state = await until(handle, lambda s: True)
        assert state.state == "rolling_out" and state.sets[-1].status == "rolling_out"
        fake.corrupt.clear()  # the operator restored the pinned files
        await signal(temporal, "wf-model@2", "resume", '{"who": "oncall-a"}')
        status = await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.ROLLED_BACK)
        state = await until(handle, lambda s: s.sets[-1].status == "rolled_back")
    assert fake.verified == ["wf-model@1", "wf-model@1"]
    assert [r["us-east"] for r in fake.routes[1:]] == [{"app-1": 75.0, "app-2": 25.0}, {"app-1": 100.0}]
    assert "error_rate" in status.detail and state.serving_set == "wf-model@1"


async def test_rollback_from_a_late_step_scales_the_old_set_up_before_the_rest_moves(
    temporal: Client,
) -> None:
    fake = FakeServing()
    fake.replicas = 10
    worker, handle = await start(temporal, fake, with_rollout(steps=[50, 90, 100]))
    async with worker:
        await roll_out_v2(temporal, handle)
        await until_rollout(temporal, "wf-model@2", lambda s: s.steps_done == 1 and "90%" in s.step)
        fake.bad_apps.add("app-2")  # the new set goes bad at 90%
        await until(handle, lambda s: s.sets[-1].status == "rolled_back")
    # In the 90% step the old set runs at half size (5 of 10 replicas, planned at 0.8 load): it
    # carries 62.5% at full load, so that much moves back at once, the rest once it is whole.
    assert [r["us-east"] for r in fake.routes[3:]] == [{"app-1": 62.5, "app-2": 37.5}, {"app-1": 100.0}]
    assert fake.scales[-1] == ("wf-model@1", 1, 1.0)
    assert fake.removed == ["app-2"]


async def test_pause_holds_the_split_through_the_bake_and_resume_continues(temporal: Client) -> None:
    fake = FakeServing()
    spec = with_rollout(steps=[30, 100], bake_seconds=5.0)
    worker, handle = await start(temporal, fake, spec)
    async with worker:
        await roll_out_v2(temporal, handle, "baking")
        await signal(temporal, "wf-model@2", "pause", '{"reason": "checking a dashboard", "who": "oncall-a"}')
        paused = await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.PAUSED)
        routes_when_paused = len(fake.routes)
        # Readings judged (workflow time) a bake apart, still in this step's bake: an unpaused bake
        # would have ended by the second, and no reading of it comes after its end. The first is
        # the first after the pause, so it comes after the bake's start (the pause may not).

        def baking_after(at: datetime) -> Callable[[RolloutStatus], bool]:
            return lambda s: "(30%): baking" in s.step and s.updated_at is not None and s.updated_at > at

        first = await until_rollout(temporal, "wf-model@2", baking_after(paused.pauses[-1].at))
        assert first.updated_at is not None
        bake = timedelta(seconds=spec.rollout.bake_seconds)
        held = await until_rollout(temporal, "wf-model@2", baking_after(first.updated_at + bake))
        assert held.state == RolloutState.PAUSED and len(fake.routes) == routes_when_paused
        assert held.traffic_percent == {"wf-model@2": 30.0, "wf-model@1": 70.0}
        listed = await on_call(temporal, "workflow", "list", "--query", "IpnextState = 'paused'")
        assert rollout_workflow_id("wf-model", "wf-model@2") in listed
        await signal(temporal, "wf-model@2", "resume", '{"who": "oncall-b"}')
        done = await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.COMPLETED)
    assert paused.pauses[0].reason == "checking a dashboard" and paused.pauses[0].who == "oncall-a"
    assert done.pauses[0].resumed_by == "oncall-b" and done.pauses[0].resumed_at is not None
    assert done.generations == [2, 3]


def rollout(client: Client) -> WorkflowHandle[Any, Any]:
    return client.get_workflow_handle(rollout_workflow_id("wf-model", "wf-model@2"))


async def test_bare_and_malformed_signals_never_fail_a_workflow_task(temporal: Client) -> None:
    """What the Temporal UI's "Send a Signal" can send: no payload, a malformed one, one too
    many. Bare pause and resume act (by "unknown"), a bare abort is refused, a malformed one is
    dropped; the rollout goes on and completes, and no workflow task of it or of its model
    failed."""
    fake = FakeServing()
    worker, handle = await start(temporal, fake, with_rollout(steps=[30, 100], bake_seconds=2.0))
    rid = rollout_workflow_id("wf-model", "wf-model@2")

    async def send(workflow_id: str, name: str, *payloads: str) -> None:
        inputs = [arg for payload in payloads for arg in ("--input", payload)]
        await on_call(temporal, "workflow", "signal", "--workflow-id", workflow_id, "--name", name, *inputs)

    async with worker:
        await roll_out_v2(temporal, handle, "baking")
        await send(rid, "abort")  # refused: no who, no why
        await send(rid, "pause", '{"reason": 5}')  # malformed: dropped by the SDK
        await send(rid, "pause")
        paused = await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.PAUSED)
        await send(rid, "resume", '{"who": "oncall"}', '"extra"')  # one payload too many
        await send(handle.id, "reconcile", '"unexpected"')
        await send(handle.id, "apply_plan")
        done = await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.COMPLETED)
        await until(handle, lambda s: s.serving_set == "wf-model@2")
    assert paused.pauses[0].who.startswith("unknown") and paused.pauses[0].reason.startswith("a pause signal")
    assert done.pauses[0].resumed_by == "oncall" and len(done.pauses) == 1
    for workflow_id in (rid, handle.id):
        history = await temporal.get_workflow_handle(workflow_id).fetch_history()
        failed = [e for e in history.events if e.HasField("workflow_task_failed_event_attributes")]
        assert failed == [], (workflow_id, failed[:1])


async def test_abort_rolls_back_and_ends_aborted(temporal: Client) -> None:
    fake = FakeServing()
    worker, handle = await start(temporal, fake, with_rollout(steps=[30, 100], bake_seconds=30.0))
    async with worker:
        await roll_out_v2(temporal, handle, "baking")
        await signal(
            temporal, "wf-model@2", "abort", '{"reason": "bad canary on a dashboard", "who": "oncall-a"}'
        )
        state = await until(handle, lambda s: s.sets[-1].status == "aborted")
        status = await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.ABORTED)
    assert "oncall-a" in status.detail and "bad canary" in status.detail
    assert state.serving_set == "wf-model@1"
    assert fake.routes[-1] == {"us-east": {"app-1": 100.0}} and fake.removed == ["app-2"]


async def test_too_little_traffic_extends_the_bake_then_pauses_until_traffic_comes(temporal: Client) -> None:
    fake = FakeServing()
    fake.rate = 0
    worker, handle = await start(temporal, fake, with_rollout(steps=[50, 100], bake_seconds=0.3))
    async with worker:
        await roll_out_v2(temporal, handle)
        status = await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.PAUSED)
        assert status.pauses[0].reason == "insufficient_traffic" and status.pauses[0].who == "ipnext"
        assert status.steps_done == 0
        fake.rate = 100  # traffic comes: ipnext ends its own pause, no one has to resume
        done = await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.COMPLETED)
    assert done.generations == [2, 3]
    assert done.pauses[0].resumed_by == "ipnext"


async def test_an_oncall_pause_takes_over_a_pause_for_traffic(temporal: Client) -> None:
    fake = FakeServing()
    fake.rate = 0
    worker, handle = await start(temporal, fake, with_rollout(steps=[50, 100], bake_seconds=0.3))
    async with worker:
        await roll_out_v2(temporal, handle)
        await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.PAUSED)
        await signal(temporal, "wf-model@2", "pause", '{"reason": "hold for the launch", "who": "oncall-a"}')
        held = await until_rollout(temporal, "wf-model@2", lambda s: len(s.pauses) == 2)
        fake.rate = 100  # every read from the next one on counts traffic
        # Checks that count traffic judged: ipnext would end its own pause at the first of them.
        await until_reads(fake, fake.reads + HELD_CHECKS + 1, "checks with traffic", len(fake.routes))
        still = await until_rollout(temporal, "wf-model@2", lambda s: True)
        assert still.state == RolloutState.PAUSED and still.steps_done == 0, still
        await signal(temporal, "wf-model@2", "resume", '{"who": "oncall-a"}')
        done = await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.COMPLETED)
    assert held.pauses[0].resumed_by == "oncall-a" and held.pauses[1].who == "oncall-a"
    assert done.pauses[1].resumed_by == "oncall-a"


def _window(reason: str, seconds: float) -> FreezeWindow:
    now = datetime.now(UTC)
    return FreezeWindow(reason=reason, start=now - timedelta(seconds=1), end=now + timedelta(seconds=seconds))


async def test_freeze_refuses_a_start_and_an_override_goes_on_the_record(temporal: Client) -> None:
    fake = FakeServing()
    worker, handle = await start(temporal, fake)
    async with worker:
        await serve_v1(handle)
        fake.windows = [_window("year-end holidays", 3600)]
        await handle.execute_update("publish", request("v2"), result_type=PublishResult)
        refused = await until(handle, lambda s: s.sets[-1].status == "refused")
        routes_before = list(fake.routes)
        override = FreezeOverride(reason="fix for incident 42", who="oncall-lead")
        await handle.execute_update("publish", request("v3", override), result_type=PublishResult)
        state = await until(handle, lambda s: s.serving_set == "wf-model@3")
        status = await until_rollout(temporal, "wf-model@3", lambda s: s.state == RolloutState.COMPLETED)
        history = await temporal.get_workflow_handle(
            rollout_workflow_id("wf-model", "wf-model@3")
        ).fetch_history()
    assert "year-end holidays" in refused.sets[-1].detail and refused.serving_set == "wf-model@1"
    assert routes_before == fake.routes[:1]  # the refused set never took traffic
    assert status.freeze_override == override and state.sets[-1].status == "serving"
    # The override is in the rollout's history: its start event's input carries it.
    started = history.events[0].workflow_execution_started_event_attributes.input.payloads[0].data
    assert b"fix for incident 42" in started and b"oncall-lead" in started


async def test_a_freeze_that_begins_holds_the_rollout_at_its_step(temporal: Client) -> None:
    fake = FakeServing()
    worker, handle = await start(temporal, fake, with_rollout(steps=[20, 100], bake_seconds=0.5))
    async with worker:
        await roll_out_v2(temporal, handle, "baking")
        fake.windows = [_window("launch day", 4.0)]
        held = await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.PAUSED)
        assert held.traffic_percent["wf-model@2"] == 20.0 and held.steps_done == 0
        await signal(temporal, "wf-model@2", "resume", '{"who": "oncall-a"}')  # a freeze is not a pause
        await handled(temporal, rollout_workflow_id("wf-model", "wf-model@2"), SIGNALED, "the resume")
        still = await until_rollout(temporal, "wf-model@2", lambda s: True)
        assert still.state == RolloutState.PAUSED and still.pauses[0].resumed_by is None
        done = await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.COMPLETED)
    assert held.pauses[0].reason == "freeze: launch day"
    assert done.pauses[0].resumed_by == "freeze calendar"
    assert done.generations == [2, 3]


async def test_on_call_overrides_a_freeze_that_holds_a_rollout(temporal: Client) -> None:
    fake = FakeServing()
    worker, handle = await start(temporal, fake, with_rollout(steps=[20, 100], bake_seconds=0.5))
    async with worker:
        await roll_out_v2(temporal, handle, "baking")
        fake.windows = [_window("change freeze", 3600)]
        await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.PAUSED)
        await signal(temporal, "wf-model@2", "override_freeze", '{"reason": "hotfix 7", "who": "lead"}')
        done = await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.COMPLETED)
        history = await temporal.get_workflow_handle(
            rollout_workflow_id("wf-model", "wf-model@2")
        ).fetch_history()
    assert done.pauses[0].reason == "freeze: change freeze" and done.pauses[0].resumed_by == "lead"
    assert done.freeze_override == FreezeOverride(reason="hotfix 7", who="lead")
    signals = [
        e.workflow_execution_signaled_event_attributes
        for e in history.events
        if e.HasField("workflow_execution_signaled_event_attributes")
    ]
    assert [s.signal_name for s in signals] == ["override_freeze"]
    assert b"hotfix 7" in signals[0].input.payloads[0].data


async def test_a_pause_between_steps_holds_the_split_until_resumed(temporal: Client) -> None:
    fake = FakeServing()
    spec = with_rollout(steps=[30, 60, 100], bake_seconds=0.5)
    bake = checks_in(spec.rollout.bake_seconds, spec.rollout.check_interval_seconds)
    worker, handle = await start(temporal, fake, spec)
    async with worker:
        await serve_v1(handle)
        fake.release["wf-model@1"] = asyncio.Event()  # the old set's scale-down after step 1 waits
        await handle.execute_update("publish", request("v2"), result_type=PublishResult)
        await until_rollout(temporal, "wf-model@2", lambda s: "scaling the old set down" in s.step)
        await signal(temporal, "wf-model@2", "pause", '{"reason": "between steps", "who": "oncall-a"}')
        reads = fake.reads  # none while the scale-down waits
        fake.release["wf-model@1"].set()
        # Past the scale-down, more than a bake's checks judged, paused: the split holds.
        await until_reads(
            fake, reads + max(bake, HELD_CHECKS) + 1, "a bake's checks between steps", len(fake.routes)
        )
        held = await until_rollout(temporal, "wf-model@2", lambda s: True)
        assert held.state == RolloutState.PAUSED and held.steps_done == 1
        assert held.traffic_percent["wf-model@2"] == 30.0 and len(fake.routes) == 2
        await signal(temporal, "wf-model@2", "resume", '{"who": "oncall-a"}')
        done = await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.COMPLETED)
    assert done.generations == [2, 3, 4] and done.pauses[0].resumed_by == "oncall-a"


async def ended(client: Client, set_id: str) -> tuple[WorkflowExecutionStatus | None, RolloutResult]:
    """The rollout of `set_id` once closed: its Temporal status and its result (whose outcome its
    IpnextState search attribute, as described, names too). A rollout that did not complete
    failed, with its result in the failure's details and the outcome as its type and message."""
    handle = client.get_workflow_handle(rollout_workflow_id("wf-model", set_id), result_type=RolloutResult)
    try:
        result = await asyncio.wait_for(handle.result(), timeout=60)
    except WorkflowFailureError as err:
        found = RolloutResult.of_failure(err)
        assert found is not None and found.outcome != RolloutOutcome.COMPLETED, err
        assert isinstance(err.cause, ApplicationError) and err.cause.type == found.failure_type()
        assert err.cause.message == found.failure_message() and err.cause.non_retryable
        last = (await handle.fetch_history()).events[-1]
        failed = last.workflow_execution_failed_event_attributes.failure
        assert failed.message == found.failure_message() and failed.stack_trace == "", failed  # an outcome
        result = found
    described = await handle.describe()
    assert described.typed_search_attributes.get(STATE_KEY) == result.outcome.value
    return described.status, result


async def no_failed_tasks(client: Client, *workflow_ids: str) -> None:
    for workflow_id in workflow_ids:
        history = await client.get_workflow_handle(workflow_id).fetch_history()
        failed = [e for e in history.events if e.HasField("workflow_task_failed_event_attributes")]
        assert failed == [], (workflow_id, failed[:1])


SIGNALED = "workflow_execution_signaled_event_attributes"
CANCEL_REQUESTED = "workflow_execution_cancel_requested_event_attributes"


async def handled(client: Client, workflow_id: str, asked: str, what: str) -> None:
    """Once the workflow has run a task after the last `asked` event of its history (a signal,
    a cancellation request): that task ran its handler."""

    async def events() -> list[str]:
        history = await client.get_workflow_handle(workflow_id).fetch_history()
        return [e.WhichOneof("attributes") or "" for e in history.events]

    def seen(names: list[str]) -> bool:
        if asked not in names:
            return False
        last = len(names) - 1 - names[::-1].index(asked)
        return "workflow_task_completed_event_attributes" in names[last:]

    await poll_until(events, seen, timeout_s=WAIT_S, interval_s=0.1, what=f"{what} handled")


async def cancel_seen(client: Client, workflow_id: str) -> None:
    await handled(client, workflow_id, CANCEL_REQUESTED, "the cancellation")


async def test_a_breached_or_aborted_rollout_fails_with_its_outcome(temporal: Client) -> None:
    """Only a completed rollout is Temporal's green COMPLETED: a rolled-back or aborted one ends
    FAILED (the UI's red, its failure filter finds it), the outcome and its reason its failure's
    message, its result the failure's details; the IpnextState search attribute says it too, and
    the model, told first, records the outcome, not a crash."""
    fake = FakeServing()
    fake.bad_apps.add("app-2")
    worker, handle = await start(temporal, fake, with_rollout(steps=[30, 100], bake_seconds=30.0))
    async with worker:
        await roll_out_v2(temporal, handle)
        await until(handle, lambda s: s.sets[-1].status == "rolled_back")
        rolled_back = await ended(temporal, "wf-model@2")
        fake.bad_apps.clear()
        await handle.execute_update("publish", request("v3"), result_type=PublishResult)
        await until_rollout(temporal, "wf-model@3", lambda s: "baking" in s.step)
        await signal(temporal, "wf-model@3", "abort", '{"reason": "drill", "who": "oncall-a"}')
        state = await until(handle, lambda s: s.sets[-1].status == "aborted")
        aborted = await ended(temporal, "wf-model@3")
    for (status, result), outcome in (
        (rolled_back, RolloutOutcome.ROLLED_BACK),
        (aborted, RolloutOutcome.ABORTED),
    ):
        assert status == WorkflowExecutionStatus.FAILED
        assert result.outcome == outcome and result.status is not None and result.status.outcome == outcome
    assert state.rollout is not None and state.rollout.outcome == RolloutOutcome.ABORTED


async def test_cancel_mid_bake_rolls_back_like_abort_and_ends_cancelled(temporal: Client) -> None:
    """`temporal workflow cancel` (the UI's "Request Cancellation") on a baking rollout: it rolls
    back as `abort` does (the routers end on the old set, the new set's apps go), then fails
    with the outcome `cancelled`; the model records it and stays Running; no task failed."""
    fake = FakeServing()
    worker, handle = await start(temporal, fake, with_rollout(steps=[30, 100], bake_seconds=30.0))
    rid = rollout_workflow_id("wf-model", "wf-model@2")
    async with worker:
        await roll_out_v2(temporal, handle, "baking")
        await on_call(temporal, "workflow", "cancel", "--workflow-id", rid)
        state = await until(handle, lambda s: s.sets[-1].status == "cancelled")
        status, result = await ended(temporal, "wf-model@2")
        model = (await handle.describe()).status
        await no_failed_tasks(temporal, rid, handle.id)
    assert status == WorkflowExecutionStatus.FAILED and model == WorkflowExecutionStatus.RUNNING
    assert result.outcome == RolloutOutcome.CANCELLED and result.state == RolloutState.CANCELLED
    assert "cancellation requested" in result.detail, result.detail
    assert fake.routes[-1] == {"us-east": {"app-1": 100.0}} and fake.weights["us-east"] == {"app-1": 100.0}
    assert fake.removed == ["app-2"]
    assert state.serving_set == "wf-model@1" and state.serving_apps == {"us-east": "app-1"}
    assert state.rollout is not None and state.rollout.state == RolloutState.CANCELLED


async def test_cancel_during_a_deploy_lets_it_finish_and_moves_no_traffic(temporal: Client) -> None:
    """A cancellation while a step's deploy runs never half-cancels it: the deploy finishes, the
    rollout stops before it shifts any traffic, and rolls back."""
    fake = FakeServing()
    fake.release["wf-model@2"] = asyncio.Event()
    worker, handle = await start(temporal, fake, with_rollout(steps=[30, 100], bake_seconds=30.0))
    rid = rollout_workflow_id("wf-model", "wf-model@2")
    async with worker:
        await roll_out_v2(temporal, handle, "scaling the new set up")
        await on_call(temporal, "workflow", "cancel", "--workflow-id", rid)
        await cancel_seen(temporal, rid)
        fake.release["wf-model@2"].set()
        status, result = await ended(temporal, "wf-model@2")
        await no_failed_tasks(temporal, rid)
    assert status == WorkflowExecutionStatus.FAILED and result.outcome == RolloutOutcome.CANCELLED
    assert fake.deployed.count("wf-model@2") == 1  # it ran to its end
    assert all("app-2" not in r["us-east"] for r in fake.routes)  # no traffic ever moved
    assert fake.removed == ["app-2"]
