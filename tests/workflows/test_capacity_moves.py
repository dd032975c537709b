"""Capacity moves on a real Temporal dev server, activities at their seam (tests/workflows/fakes.py):
a replanned placement moved to make before break, a plan made without a down region and the
return, a placement replanned before anything serves, a replan that outlives a failed rollout,
and a failed move tried again (and, past its tries, left on the old placement)."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import Client

from ipnext.contracts.model import ApplyPlanInput, PublishResult
from ipnext.names import RolloutState, poll_until
from ipnext.policy.rollout_steps import CAPACITY_MOVE_ATTEMPTS, capacity_retry

from .fakes import FakeServing, plan_in, request, start, until, until_rollout, with_rollout

pytestmark = pytest.mark.timeout(120)


async def test_replanned_placement_moves_capacity_make_before_break(temporal: Client) -> None:
    fake = FakeServing()
    worker, handle = await start(temporal, fake)
    async with worker:
        await handle.execute_update("publish", request("v1"), result_type=PublishResult)
        before = await until(handle, lambda s: s.serving_set == "wf-model@1")
        await handle.signal("apply_plan", ApplyPlanInput(plan=plan_in("eu-west", 2), fleet_revision=7))
        state = await until(handle, lambda s: s.plan is not None and s.plan.revision == 2)
    # Same set, same statuses; its apps moved to the new placement.
    assert state.serving_set == "wf-model@1" and state.sets == before.sets
    assert state.serving_apps == {"eu-west": "app-1-r2"}
    # Step by step: the new placement at half size, half the traffic, the old one halved,
    # then the new one whole and all traffic; every router (the old region's too) moves.
    assert fake.scales == [
        ("wf-model@1", 1, 1.0),
        ("wf-model@1", 2, 0.5),
        ("wf-model@1", 1, 0.5),
        ("wf-model@1", 2, 1.0),
    ]
    assert fake.routes == [
        {"us-east": {"app-1": 100.0}},
        {"eu-west": {"app-1-r2": 100.0}, "us-east": {"app-1": 50.0, "app-1-r2": 50.0}},
        {"eu-west": {"app-1-r2": 100.0}, "us-east": {"app-1-r2": 100.0}},
    ]
    assert fake.removed == ["app-1"]
    assert state.rollout is not None and state.rollout.state.value == "completed"
    assert state.rollout.traffic_percent == {"wf-model@1": 100.0}
    assert "fleet plan 7" in state.rollout.detail
    assert state.pending_plan is None


async def test_a_plan_without_a_down_region_never_deploys_routes_or_waits_there_and_the_return_brings_it_back(
    temporal: Client,
) -> None:
    fake = FakeServing()
    worker, handle = await start(temporal, fake)
    async with worker:
        await handle.execute_update("publish", request("v1"), result_type=PublishResult)
        await until(handle, lambda s: s.serving_set == "wf-model@1")
        assert fake.weights == {"us-east": {"app-1": 100.0}}
        # us-east's node is gone: the emergency plan serves its callers from eu-west.
        emergency = ApplyPlanInput(plan=plan_in("eu-west", 2), fleet_revision=8, down_regions=["us-east"])
        await handle.signal("apply_plan", emergency)
        state = await until(handle, lambda s: s.plan is not None and s.plan.revision == 2)
        routed_while_down = list(fake.routes[1:])
        deployed_while_down = list(fake.scales[1:])
        # us-east back: the return plan deploys and routes there again.
        fake.routes.clear()
        await handle.signal("apply_plan", ApplyPlanInput(plan=plan_in("us-east", 3), fleet_revision=9))
        back = await until(handle, lambda s: s.plan is not None and s.plan.revision == 3)
    # Nothing of us-east's deployed, routed or waited on while it was down; its app removed
    # without waiting; the new placement took the traffic at once (nothing left there to step from).
    assert deployed_while_down == [("wf-model@1", 2, 1.0)]
    assert routed_while_down and all("us-east" not in weights for weights in routed_while_down)
    assert routed_while_down[-1] == {"eu-west": {"app-1-r2": 100.0}}
    assert fake.removed_unwaited == ["app-1"]
    assert state.serving_apps == {"eu-west": "app-1-r2"}
    assert state.rollout is not None and state.rollout.state.value == "completed"
    assert back.serving_apps == {"us-east": "app-1-r3"}
    assert fake.routes[-1]["us-east"] == {"app-1-r3": 100.0}
    assert fake.removed[-1] == "app-1-r2" and fake.removed_unwaited == ["app-1"]


async def test_a_capacity_move_that_failed_is_tried_again_and_lands(temporal: Client) -> None:
    """A region's return whose first move fails (Serve did not start the apps in time) is
    tried again after a serving check, with no command, and lands on the new placement."""
    fake = FakeServing()
    fake.fail_plans[2] = 1
    worker, handle = await start(temporal, fake, with_rollout(steps=[100], bake_seconds=0.1))
    async with worker:
        await handle.execute_update("publish", request("v1"), result_type=PublishResult)
        await until(handle, lambda s: s.serving_set == "wf-model@1")
        checks = len(fake.reconciled)
        await handle.signal("apply_plan", ApplyPlanInput(plan=plan_in("eu-west", 2), fleet_revision=7))
        state = await until(handle, lambda s: s.plan is not None and s.plan.revision == 2)
    assert fake.fail_plans[2] == 0 and fake.deploy_plans == [1, 2]  # one failed try, one landed
    assert state.serving_apps == {"eu-west": "app-1-r2"} and state.pending_plan is None
    assert state.rollout is not None and state.rollout.state.value == "completed"
    assert "try 2 of 3" in state.rollout.detail, state.rollout.detail
    assert len(fake.reconciled) > checks  # a serving check ran between the two tries
    assert state.rollout.workflow_id.endswith("/plan-r2-try2"), state.rollout.workflow_id


async def test_a_capacity_move_that_keeps_failing_stops_after_its_tries_on_the_old_placement(
    temporal: Client,
) -> None:
    fake = FakeServing()
    fake.fail_plans[2] = 10
    worker, handle = await start(temporal, fake, with_rollout(steps=[100], bake_seconds=0.1))
    async with worker:
        await handle.execute_update("publish", request("v1"), result_type=PublishResult)
        await until(handle, lambda s: s.serving_set == "wf-model@1")
        await handle.signal("apply_plan", ApplyPlanInput(plan=plan_in("eu-west", 2), fleet_revision=7))
        state = await until(
            handle,
            lambda s: (
                s.rollout is not None
                and s.rollout.workflow_id.endswith("/plan-r2-try3")
                and s.rollout.state == "failed"
            ),
        )
        # Three more serving checks, each a retry's wait: no fourth try came.
        checks = len(fake.reconciled)
        await poll_until(
            lambda: _now(len(fake.reconciled)), lambda n: n >= checks + 3, timeout_s=30, what="3 checks"
        )
        state = await until(handle, lambda s: s.rollout is not None)
    assert fake.fail_plans[2] == 10 - 3 and fake.deploy_plans == [1]  # three tries, none landed
    assert state.plan is not None and state.plan.revision == 1 and state.pending_plan is None
    assert state.serving_apps == {"us-east": "app-1"}
    assert state.rollout is not None and "tried again" not in state.rollout.detail, state.rollout.detail


async def test_a_rolled_back_capacity_move_is_not_tried_again() -> None:
    """Only a fault is tried again: a breach, an abort or a freeze is an answer."""
    move = ApplyPlanInput(plan=plan_in("eu-west", 2), fleet_revision=7)
    assert capacity_retry(move, RolloutState.FAILED) == move.model_copy(update={"attempt": 2})
    for ended in (
        RolloutState.ROLLED_BACK,
        RolloutState.ABORTED,
        RolloutState.REFUSED,
        RolloutState.CANCELLED,
    ):
        assert capacity_retry(move, ended) is None
    last = move.model_copy(update={"attempt": CAPACITY_MOVE_ATTEMPTS})
    assert (
        capacity_retry(last, RolloutState.FAILED) is None
        and capacity_retry(None, RolloutState.FAILED) is None
    )


async def test_placement_replanned_before_anything_serves_is_used_by_the_first_rollout(
    temporal: Client,
) -> None:
    fake = FakeServing()
    worker, handle = await start(temporal, fake)
    async with worker:
        await until(handle, lambda s: s.plan is not None)
        await handle.signal("apply_plan", ApplyPlanInput(plan=plan_in("eu-west", 2), fleet_revision=1))
        await until(handle, lambda s: s.plan is not None and s.plan.revision == 2)
        await handle.execute_update("publish", request("v1"), result_type=PublishResult)
        state = await until(handle, lambda s: s.serving_set == "wf-model@1")
    assert fake.deploy_plans == [2]  # one deploy, straight onto the replanned placement
    assert state.serving_apps == {"eu-west": "app-1-r2"}


async def test_a_replan_outlives_the_failed_rollout_that_was_to_carry_it(temporal: Client) -> None:
    """A replanned placement arrives while a rollout runs; the next set was to come up on it,
    but its rollout fails: the replan is not dropped, the serving set moves to it."""
    fake = FakeServing()
    fake.release["wf-model@2"] = asyncio.Event()  # v2's rollout holds in its deploy
    fake.fail.add("wf-model@3")
    worker, handle = await start(temporal, fake, with_rollout(steps=[100], bake_seconds=0.1))
    async with worker:
        await handle.execute_update("publish", request("v1"), result_type=PublishResult)
        await until(handle, lambda s: s.serving_set == "wf-model@1")
        await handle.execute_update("publish", request("v2"), result_type=PublishResult)
        await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.RUNNING)
        await handle.signal("apply_plan", ApplyPlanInput(plan=plan_in("eu-west", 2), fleet_revision=1))
        await handle.execute_update("publish", request("v3"), result_type=PublishResult)
        await until(handle, lambda s: s.pending_plan == 2 and s.queued == ["wf-model@3"])
        fake.release["wf-model@2"].set()
        state = await until(
            handle,
            lambda s: s.sets[-1].status == "failed" and s.plan is not None and s.plan.revision == 2,
            timeout=60,
        )
    assert state.serving_set == "wf-model@2" and state.serving_apps == {"eu-west": "app-2-r2"}
    assert state.pending_plan is None
    assert fake.deployed[-1] == "wf-model@2" and fake.deploy_plans[-1] == 2  # moved to the replan


async def _now(value: int) -> int:
    return value
