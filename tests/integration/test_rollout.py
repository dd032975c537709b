"""Gradual rollouts on the real dev stack under a closed-loop load: a bad snapshot is rolled
back by the gates, on-call pauses and resumes through the `ipnext rollout` CLI, and a rollout
goes on where it was after its worker is killed and after the Temporal server restarts."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from ipnext.config import Settings
from ipnext.contracts import poll_until
from ipnext.devstack import DevStack
from ipnext.examples.click_ranker.train import poisoned_copy
from ipnext.model import GateSpec
from ipnext.rollout import RolloutState
from ipnext.sdk import Client

from .conftest import one_region_spec, train_version, until_rolled_back
from .load import Load
from .test_cli import ipnext
from .test_lifecycle import serve_apps

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


async def test_bad_snapshot_is_rolled_back_by_the_gates(
    stack: Settings, stack_config: Path, client: Client, model_name: str
) -> None:
    await client.publish_model(one_region_spec(model_name))
    good, _ = train_version(stack, model_name, "v1")
    first = await client.publish_snapshot(model_name, good)
    await client.wait_until_serving(model_name, first.set_id)
    bad = poisoned_copy(stack.snapshot_roots[0], model_name, "v2-bad", good)
    async with Load(stack.serve_url, f"/us-east/models/{model_name}/predict") as load:
        published = await client.publish_snapshot(model_name, bad)
        state = await until_rolled_back(client, model_name)
        rolled_back_at = load.elapsed()
        await asyncio.sleep(3.0)  # keep the load on: nothing may fail from here
    assert state.serving_set == first.set_id
    status = state.rollout
    assert status is not None and status.state == RolloutState.ROLLED_BACK
    assert "error_rate" in status.detail, status.detail
    bad_answers = [a for a in load.answers if a.set == published.set_id]
    assert bad_answers and all(a.status == 500 for a in bad_answers if "not finite" in a.error)
    assert load.failed(since=rolled_back_at) == []
    after = [a for a in load.answers if a.at >= rolled_back_at]
    assert len(after) > 20 and all(a.set == first.set_id for a in after)
    assert status.generations and len(status.generations) == 2  # the 10% step, then all back at once
    async with httpx.AsyncClient(base_url=stack.serve_url, timeout=30) as http:
        router = (await http.get(f"/us-east/models/{model_name}")).json()
    assert router["weights"] == {f"{model_name}.us-east.s1.r1": 100.0}
    assert f"{model_name}.us-east.s2.r1" not in serve_apps(stack)
    shown = ipnext(stack_config, "rollout", "status", model_name)
    assert shown.returncode == 0 and "ROLLED_BACK" in shown.stdout and "BREACH" in shown.stdout, shown
    print(
        f"rolled back {published.set_id}: {len(load.answers)} requests, "
        f"{len(load.failed())} failed before the rollback completed, none after"
    )
    await client.delete_model(model_name)


async def test_on_call_pauses_and_resumes_with_the_cli(
    stack: Settings, stack_config: Path, client: Client, model_name: str
) -> None:
    spec = one_region_spec(model_name)
    # A bake long enough that the CLI's pause (a new process) lands inside the first one.
    rollout = spec.rollout.model_copy(update={"steps": [30, 100], "bake_seconds": 10})
    spec = spec.model_copy(update={"rollout": rollout})
    await client.publish_model(spec)
    v1, _ = train_version(stack, model_name, "v1")
    await client.wait_until_serving(model_name, (await client.publish_snapshot(model_name, v1)).set_id)
    v2, _ = train_version(stack, model_name, "v2", seed=2)
    async with Load(stack.serve_url, f"/us-east/models/{model_name}/predict") as load:
        published = await client.publish_snapshot(model_name, v2)
        await poll_until(
            lambda: client.rollout_status(model_name),
            lambda s: s is not None and s.set_id == published.set_id and "baking" in s.step,
            timeout_s=120,
            interval_s=0.2,
            what=f"{published.set_id} baking",
        )
        out = ipnext(
            stack_config, "rollout", "pause", model_name, "--reason", "looking at a dashboard", "--who", "ann"
        )
        assert out.returncode == 0, out.stderr
        await asyncio.sleep(12.0)  # more than a bake: the split holds
        held = await client.rollout_status(model_name)
        assert held is not None and held.state == RolloutState.PAUSED
        assert held.traffic_percent == {published.set_id: 30.0, f"{model_name}@1": 70.0}
        paused_split = [a.set for a in load.answers[-100:]]
        out = ipnext(stack_config, "rollout", "resume", model_name, "--who", "bob")
        assert out.returncode == 0, out.stderr
        state = await client.wait_until_serving(model_name, published.set_id, timeout_s=120)
    assert published.set_id in paused_split and f"{model_name}@1" in paused_split
    assert load.failed() == []
    assert state.rollout is not None and state.rollout.pauses[0].who == "ann"
    assert state.rollout.pauses[0].resumed_by == "bob"
    watched = ipnext(stack_config, "rollout", "watch", model_name)
    assert watched.returncode == 0 and "COMPLETED" in watched.stdout and "[30%] [100%]" in watched.stdout
    await client.delete_model(model_name)


async def test_rollout_survives_a_killed_worker_and_a_restarted_temporal(
    stack: Settings, stack_config: Path, client: Client, model_name: str
) -> None:
    spec = one_region_spec(model_name)
    # Shares and a request floor that a loaded 2-core box still meets in one bake. The drill is
    # about crashes, not gates: restarting a worker (torch and Ray imports) on two cores slows the
    # replicas for seconds, so the latency gate gets a floor no healthy snapshot reaches here.
    gates = [
        GateSpec(metric="error_rate", max=0.01),
        GateSpec(metric="latency_p99_ms", max_ratio_to_old=2.0, floor=5000),
    ]
    rollout = spec.rollout.model_copy(
        update={"steps": [30, 60, 100], "bake_seconds": 5, "min_requests": 10, "gates": gates}
    )
    spec = spec.model_copy(update={"rollout": rollout})
    await client.publish_model(spec)
    v1, _ = train_version(stack, model_name, "v1")
    await client.wait_until_serving(model_name, (await client.publish_snapshot(model_name, v1)).set_id)
    async with httpx.AsyncClient(base_url=stack.serve_url, timeout=30) as http:
        before = (await http.get(f"/us-east/models/{model_name}")).json()["generation"]
    v2, _ = train_version(stack, model_name, "v2", seed=2)
    dev = DevStack(config_path=stack_config, log=print)
    async with Load(stack.serve_url, f"/us-east/models/{model_name}/predict") as load:
        published = await client.publish_snapshot(model_name, v2)

        async def reach(step: str) -> None:
            deadline = time.monotonic() + 180
            status = None
            while True:
                with contextlib.suppress(Exception):  # Temporal may be down for a moment
                    status = await client.rollout_status(model_name)
                    if status is not None and status.set_id == published.set_id and step in status.step:
                        return
                ended = (RolloutState.ROLLED_BACK, RolloutState.ABORTED, RolloutState.FAILED)
                assert status is None or status.set_id != published.set_id or status.state not in ended, (
                    status
                )
                assert time.monotonic() < deadline, f"never reached {step}: {status}"
                await asyncio.sleep(0.2)

        await reach("step 1/3 (30%): baking")
        dev.crash("worker")  # in the middle of the first step's bake
        await asyncio.sleep(2.0)
        dev.start("worker")
        await reach("step 2/3 (60%): baking")
        dev.crash("temporal")  # same db file when it comes back
        await asyncio.sleep(2.0)
        dev.start("temporal")
        state = await client.wait_until_serving(model_name, published.set_id, timeout_s=300)
    assert state.rollout is not None
    # Every planned step applied exactly once, in order, none skipped: one generation each.
    assert state.rollout.generations == [before + 1, before + 2, before + 3]
    assert state.rollout.steps_done == 3 and state.rollout.state == RolloutState.COMPLETED
    assert load.failed() == [], load.failed()[:3]
    print(
        f"crash drill: {len(load.answers)} requests through a worker kill and a Temporal restart, none failed"
    )
    await client.delete_model(model_name)


async def test_independent_parts_roll_one_after_the_other(
    stack: Settings, client: Client, model_name: str
) -> None:
    """sync: independent, both parts changed: embed walks its steps first while dense stays on
    v1, then dense walks its own; mixed answers (new embed, old dense) are the point."""
    spec = one_region_spec(model_name, sync="independent")
    rollout = spec.rollout.model_copy(update={"steps": [50, 100], "bake_seconds": 1.5, "min_requests": 10})
    await client.publish_model(spec.model_copy(update={"rollout": rollout}))
    v1, _ = train_version(stack, model_name, "v1")
    await client.wait_until_serving(model_name, (await client.publish_snapshot(model_name, v1)).set_id)
    v2, _ = train_version(stack, model_name, "v2", seed=2)
    async with Load(stack.serve_url, f"/us-east/models/{model_name}/predict") as load:
        published = await client.publish_snapshot(model_name, v2)
        state = await client.wait_until_serving(model_name, published.set_id, timeout_s=240)
    assert load.failed() == [], load.failed()[:3]
    versions = [
        (a.parts["embed"].rsplit("@", 1)[-1], a.parts["dense"].rsplit("@", 1)[-1]) for a in load.answers
    ]
    seen = Counter(versions)
    assert seen[("v2", "v1")] > 0, seen  # embed moved on its own
    assert seen[("v1", "v2")] == 0, seen  # dense moved only after embed reached 100%
    first_new_dense = min(i for i, v in enumerate(versions) if v[1] == "v2")
    assert all(v[0] == "v2" for v in versions[first_new_dense:]), "embed went back while dense moved"
    status = state.rollout
    assert status is not None and status.state == RolloutState.COMPLETED
    assert status.steps == [50, 100, 50, 100] and status.steps_done == 4
    assert status.part_traffic == {"embed": 100.0, "dense": 100.0}
    assert f"{model_name}.us-east.s1.r1" not in serve_apps(stack)
    print(
        f"independent rollout: {len(load.answers)} requests, none failed; answers by (embed, dense): {seen}"
    )
    await client.delete_model(model_name)
