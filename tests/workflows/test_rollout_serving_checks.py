"""RolloutWorkflow's own serving checks during a bake, activities replaced at their seam: Ray
lost mid-bake (the check finds drift, or the metrics read finds the counters gone) comes back at
the rollout's split and the bake starts again; a check that cannot run holds the bake's
judgement of traffic until one runs."""

from __future__ import annotations

import pytest
from temporalio.client import Client

from ipnext.contracts.model import PublishResult
from ipnext.contracts.rollout import PauseInput, ResumeInput
from ipnext.names import RolloutState

from .fakes import FakeServing, request, start, until_reads, until_rollout, with_rollout
from .test_rollout_workflow import roll_out_v2, rollout, serve_v1

pytestmark = pytest.mark.timeout(120)


async def hold_at_this_step(client: Client) -> None:
    """Pause v2's rollout (its bake goes on reading metrics and checking serving, paused), so a
    slow machine cannot finish the step before the test acts on it."""
    await rollout(client).signal("pause", PauseInput(reason="hold the step", who="test"))
    await until_rollout(client, "wf-model@2", lambda s: s.state == RolloutState.PAUSED)


async def test_serving_lost_mid_bake_comes_back_at_the_rollouts_split_and_the_bake_restarts(
    temporal: Client,
) -> None:
    """Ray restarted in the middle of a bake (the fake's next serving check finds drift): the
    rollout's own check pushes both sets at their step's sizes and the routers as last routed,
    at the generations applied; the bake starts a fresh window; every step is applied once."""
    fake = FakeServing()
    fake.reconcile_interval = 0.2
    worker, handle = await start(temporal, fake, with_rollout(steps=[30, 100], bake_seconds=3.0))
    async with worker:
        await roll_out_v2(temporal, handle, "(30%): baking")
        await hold_at_this_step(temporal)
        checks = len(fake.reconciled)
        fake.drift = ["app-1: lost (the writer holds none)", "wf-model.us-east: router lost"]
        repaired = await until_rollout(temporal, "wf-model@2", lambda s: s.repairs == 1)
        await rollout(temporal).signal("resume", ResumeInput(who="test"))
        done = await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.COMPLETED)
    during = [c for c in fake.reconciled[checks:] if c.sets]
    assert during, "no serving check ran during the bake"
    check = during[0]
    assert [(t.snapshot_set.id, t.scales) for t in check.sets] == [
        ("wf-model@1", {"embed": 1.0}),
        ("wf-model@2", {"embed": 0.3}),
    ]
    assert check.routers["us-east"].weights == {"app-1": 70.0, "app-2": 30.0}
    assert check.routers["us-east"].generation == check.generation_floor == 2
    assert repaired.last_repair.startswith("app-1: lost") and repaired.state == RolloutState.PAUSED
    assert done.generations == [2, 3] and done.repairs == 1  # nothing applied twice


async def test_counters_lost_mid_bake_check_serving_at_once(temporal: Client) -> None:
    """The metrics read finds every counter gone (Ray came back empty): the rollout checks its
    serving at that read, not at its next interval (an hour away here), and bakes again."""
    fake = FakeServing()
    fake.reconcile_interval = 3600
    worker, handle = await start(temporal, fake, with_rollout(steps=[30, 100], bake_seconds=3.0))
    async with worker:
        await roll_out_v2(temporal, handle, "(30%): baking")
        await hold_at_this_step(temporal)
        checks = len(fake.reconciled)
        fake.drift = ["app-2: lost (the writer holds none)"]
        fake.lose_counters = True
        # At that read, well within the hour to the next interval (30 s: a loaded CI took over 10).
        repaired = await until_rollout(temporal, "wf-model@2", lambda s: s.repairs == 1)
        await rollout(temporal).signal("resume", ResumeInput(who="test"))
        done = await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.COMPLETED)
    first = fake.reconciled[checks]  # the check right after the lost counters: still at 30%
    assert first.routers["us-east"].weights == {"app-1": 70.0, "app-2": 30.0}, first.routers
    assert repaired.last_repair.startswith("app-2: lost")
    assert done.generations == [2, 3] and done.repairs == 1


async def test_counters_lost_between_a_bakes_first_check_and_its_first_read(temporal: Client) -> None:
    """Ray lost just after the check a bake starts with (found clean): the bake's first read
    came before it, so the next read sees the counters gone and the check repairs at once."""
    fake = FakeServing()
    fake.reconcile_interval = 3600
    fake.lose_after_check = ["app-2: lost (the writer holds none)"]
    worker, handle = await start(temporal, fake, with_rollout(steps=[30, 100], bake_seconds=2.0))
    async with worker:
        await roll_out_v2(temporal, handle)
        done = await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.COMPLETED)
    assert fake.lose_after_check == [], "the fake never lost the counters"
    assert done.repairs == 1 and done.last_repair.startswith("app-2: lost"), done
    # Repaired in that bake, at 30%: not at the next bake's first check.
    assert fake.repairing[0].routers["us-east"].weights == {"app-1": 70.0, "app-2": 30.0}, fake.repairing


@pytest.mark.timeout(300)
async def test_a_bake_whose_serving_check_cannot_run_neither_ends_nor_pauses_for_traffic(
    temporal: Client,
) -> None:
    """Ray lost mid-bake and slow to come back: every serving check fails. No traffic reaches
    the new set, yet the rollout does not pause for `insufficient_traffic` (the window says
    nothing of the new set), nor does traffic counted meanwhile end the bake; the status says
    why it waits. Once a check runs, a fresh window is judged and the rollout completes with
    no pause on its record (CI, stop 54: the restart drill's rollout paused for traffic while
    its checks could not reach Serve, and the drill failed)."""
    fake = FakeServing()
    fake.reconcile_interval = 0.2
    fake.rate = 0
    # Ended or paused for traffic within 3 bakes: 6 checks, each after a wait of 0.1 s.
    bake, checks = 0.2, 8
    worker, handle = await start(temporal, fake, with_rollout(steps=[30, 100], bake_seconds=bake))
    async with worker:
        await serve_v1(handle)
        fake.reconcile_error, fake.reconcile_unreachable = "Ray is not reachable (the cluster restarts)", True
        await handle.execute_update("publish", request("v2"), result_type=PublishResult)
        await until_rollout(temporal, "wf-model@2", lambda s: s.serving_unchecked != "")
        routes = len(fake.routes)
        # Past three bakes without traffic: had its checks run, the rollout would have paused.
        # Each check fails three attempts first: on a loaded box 8 of them outlast WAIT_S (CI
        # beside a CPU hog saw 7 in 30 s), so these waits get 90 s.
        await until_reads(fake, fake.reads + checks, "checks without traffic", routes, timeout=90)
        fake.rate = 100  # traffic counted while Serve is still unchecked: it does not end the bake
        await until_reads(fake, fake.reads + checks, "checks with traffic", routes, timeout=90)
        held, held_routes = await until_rollout(temporal, "wf-model@2", lambda s: True), list(fake.routes)
        fake.reconcile_error = None
        done = await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.COMPLETED)
    assert held.state == RolloutState.RUNNING and held.steps_done == 0 and held.pauses == [], held
    assert "not reachable" in held.serving_unchecked and len(held_routes) == routes, held_routes
    assert done.pauses == [] and done.serving_unchecked == "" and done.generations == [2, 3], done


async def test_a_serving_check_that_ran_and_failed_leaves_the_bake_to_the_gates(temporal: Client) -> None:
    """A check that reached Serve and failed (Serve refused an app: non-retryable) is not one
    that could not run: the bake goes on, judged by its gates, and the rollout completes."""
    fake = FakeServing()
    fake.reconcile_interval = 0.2
    worker, handle = await start(temporal, fake, with_rollout(steps=[30, 100], bake_seconds=0.2))
    async with worker:
        await serve_v1(handle)
        fake.reconcile_error = "Serve app wf-model.us-east.s2.r1 is DEPLOY_FAILED"
        await handle.execute_update("publish", request("v2"), result_type=PublishResult)
        done = await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.COMPLETED)
    assert done.serving_unchecked == "" and done.pauses == [] and done.generations == [2, 3], done
    assert [c for c in fake.reconciled if c.sets], "the rollout's own checks did not run"
