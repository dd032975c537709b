"""Fleet replanning on the real dev stack: the Schedule's run reads the registry, solves the
fleet, stores the plan (`ipnext plan show`), leaves an unchanged model alone, and moves a
model whose pools got expensive to another region, make before break, while it serves; and
a model sent 3x its declared peak is planned for what it was sent, its demand history kept
across its metrics actor's restart."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import ray
import yaml

from ipnext.client.schedules import ensure_replan_schedule, trigger_and_wait
from ipnext.client.sdk import Client
from ipnext.client.temporal import connect_client
from ipnext.contracts.fleet import FleetReplanInput
from ipnext.contracts.model import ModelState
from ipnext.contracts.plan import Plan
from ipnext.names import REPLAN_SCHEDULE_ID, ModelStatus, poll_until
from ipnext.policy.demand import SOURCE_HEADER, ModelDemand
from ipnext.serving.control import connect
from ipnext.serving.layout import RAY_NAMESPACE, metrics_actor_name
from ipnext.serving.metrics import demand_file
from ipnext.spec.model import HardwareOption
from ipnext.spec.settings import Settings
from ipnext.store.plans import PlanStore

from .conftest import DEMAND_SETTINGS, keyed, one_region_spec, train_version
from .load import Load
from .test_cli import ipnext
from .test_lifecycle import serve_apps

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


async def moved(client: Client, model_name: str, revision: int, started: float) -> ModelState:
    """The model's state once it serves on plan `revision`; fails fast if the move stalls."""

    async def read() -> ModelState:
        live = await client.rollout_status(model_name)
        assert live is None or live.state.value not in ("paused", "rolled_back"), live  # fail fast
        return await client.get_model(model_name)

    return await poll_until(
        read,
        lambda s: s.plan is not None and s.plan.revision == revision and s.state == ModelStatus.SERVING,
        timeout_s=max(1.0, 240 - (time.perf_counter() - started)),
        interval_s=0.5,
        what=f"{model_name} serving on plan revision {revision}",
    )


async def test_scheduled_replan_moves_capacity_and_shows_the_plan(
    stack: Settings, stack_config: Path, client: Client, model_name: str
) -> None:
    spec = one_region_spec(model_name)  # traffic from us-east, 50 ms budget: eu-west (40 ms) may serve it
    # A move to other regions or hardware is a new placement revision, rolled out like a new set
    # (the steps themselves are the workflow tests' subject): one step, gated, under the test's load.
    rollout = spec.rollout.model_copy(update={"steps": [100], "min_requests": 10})
    # dense may also run on cpu-highmem, so a price change can move it to other hardware.
    dense = spec.parts["dense"]
    hardware = {**dense.hardware, "cpu-highmem": dense.hardware["cpu-std"]}
    parts = {**spec.parts, "dense": dense.model_copy(update={"hardware": hardware})}
    spec = spec.model_copy(update={"rollout": rollout, "parts": parts})
    await client.publish_model(spec)
    folder, _ = train_version(stack, model_name, "v1")
    published = await client.publish_snapshot(model_name, folder)
    state = await client.wait_until_serving(model_name, published.set_id)
    assert state.serving_apps == {"us-east": f"{model_name}.us-east.s1.r1"}

    temporal = await connect_client(stack)
    queue = stack.temporal.task_queue
    await ensure_replan_schedule(temporal, queue, timedelta(hours=6), FleetReplanInput(time_limit_s=20))
    # Held paused so that only the test's triggers run it: every 6 h is aligned to the epoch, and
    # CI once ran this test across 06:00 UTC, when the schedule's own run made one revision more.
    # A paused schedule still runs when triggered.
    schedule = temporal.get_schedule_handle(REPLAN_SCHEDULE_ID)
    await schedule.pause(note="held by the test: runs only when triggered")
    fleet_file = stack.fleet_file
    original = fleet_file.read_text()
    try:
        # 1. Nothing changed since the model's first placement: the plan keeps it where it is.
        first = await trigger_and_wait(temporal, timeout_s=180)
        assert model_name in first.models and first.revision >= 1
        assert model_name not in first.applied_to, first

        # 2. us-east gets expensive: the next run moves the model to eu-west while it serves.
        fleet = yaml.safe_load(original)
        for pool in fleet["pools"]:
            if pool["region"] == "us-east":
                pool["unit_cost"] *= 10
        fleet_file.write_text(yaml.safe_dump(fleet))
        started = time.perf_counter()
        async with Load(
            stack.serve_url, f"/us-east/models/{model_name}/predict", headers=keyed(stack)
        ) as load:
            second = await trigger_and_wait(temporal, timeout_s=180)
            assert second.revision == first.revision + 1
            assert model_name in second.applied_to, second
            assert any(m.startswith(f"{model_name}/dense: eu-west/cpu-std 0 -> ") for m in second.moves)
            state = await moved(client, model_name, 2, started)  # answering throughout
        assert load.failed() == [], load.failed()[:3]
        answered = len(load.answers)
        print(f"capacity move of {model_name}: {time.perf_counter() - started:.1f}s, {answered} predictions")
        assert state.serving_set == published.set_id
        assert state.serving_apps == {"eu-west": f"{model_name}.eu-west.s1.r2"}
        assert state.rollout is not None and state.rollout.state.value == "completed"
        async with httpx.AsyncClient(base_url=stack.serve_url, headers=keyed(stack), timeout=30) as http:
            for region in ("eu-west", "us-east"):  # the us-east router now hands over to eu-west
                reply = await http.post(
                    f"/{region}/models/{model_name}/predict", json={"inputs": {"user": 3, "items": [1, 2]}}
                )
                assert reply.status_code == 200 and reply.json()["set"] == published.set_id

        shown = ipnext(stack_config, "plan", "show")
        assert shown.returncode == 0, shown.stderr
        assert f"fleet plan revision {second.revision}" in shown.stdout
        assert f"{model_name}/dense: us-east/cpu-std 1 -> 0" in shown.stdout
        # 3. cpu-std gets expensive in eu-west too: dense moves to cpu-highmem in the same region,
        # another hardware class, so another placement revision beside the serving one.
        fleet = yaml.safe_load(fleet_file.read_text())
        for pool in fleet["pools"]:
            if pool["region"] == "eu-west" and pool["hardware"] == "cpu-std":
                pool["unit_cost"] *= 10
        fleet_file.write_text(yaml.safe_dump(fleet))
        started = time.perf_counter()
        async with Load(
            stack.serve_url, f"/us-east/models/{model_name}/predict", headers=keyed(stack)
        ) as load:
            third = await trigger_and_wait(temporal, timeout_s=180)
            assert model_name in third.applied_to, third
            assert any(m.startswith(f"{model_name}/dense: eu-west/cpu-highmem 0 -> ") for m in third.moves)
            state = await moved(client, model_name, 3, started)
        assert load.failed() == [], load.failed()[:3]
        print(
            f"hardware move of {model_name}: {time.perf_counter() - started:.1f}s, "
            f"{len(load.answers)} predictions"
        )
        assert state.serving_apps == {"eu-west": f"{model_name}.eu-west.s1.r3"}
        assert set(state.plan.deployments[f"{model_name}/dense"].replicas["eu-west"]) == {"cpu-highmem"}
        assert f"{model_name}.eu-west.s1.r2" not in serve_apps(stack)
        assert f"{model_name}.eu-west.s1.r3" in serve_apps(stack)

        await schedule.unpause()  # so the CLI's pause below is the one on record
        status = ipnext(stack_config, "plan", "schedule", "--pause", "freeze for the test")
        assert status.returncode == 0 and "paused" in status.stdout
        status = ipnext(stack_config, "plan", "schedule")
        assert "paused (freeze for the test)" in status.stdout and "every 6:00:00" in status.stdout
    finally:
        fleet_file.write_text(original)
        await schedule.delete()
        await client.delete_model(model_name)


DECLARED_QPS = 4.0  # small: 3x it is 12 requests/s through the router, light on 2 cores
DENSE_QPS = 6.0  # what the spec says one dense replica serves: 4 x 1.2 fits one, 3x needs more


NO_ANSWER = 0  # the status `paced` records for a request that got no HTTP answer in time


async def paced(base_url: str, path: str, qps: float, seconds: float, key: dict[str, str]) -> list[int]:
    """Open loop: a request every 1/qps s from us-east for `seconds`, each on its own task, so a
    slow answer never delays the next send. The answers' statuses, NO_ANSWER for a request with no
    answer within 30 s (CI once saw one on a 2-core box with a restart drill beside it)."""
    statuses: list[int] = []
    async with httpx.AsyncClient(
        base_url=base_url, timeout=30, headers={SOURCE_HEADER: "us-east", **key}
    ) as http:

        async def one(i: int) -> None:
            try:
                reply = await http.post(path, json={"inputs": {"user": i % 40, "items": [1, 2, 3]}})
            except httpx.TransportError:
                statuses.append(NO_ANSWER)
            else:
                statuses.append(reply.status_code)

        loop = asyncio.get_running_loop()
        start, tasks = loop.time(), []
        for i in range(int(qps * seconds)):
            await asyncio.sleep(max(0.0, start + i / qps - loop.time()))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return statuses


async def observed(client: Client, model: str) -> ModelDemand:
    """The model's observed demand (no region in `regions` while its metrics actor restarts: the
    router answers 503 and the SDK reads that region as having recorded nothing)."""
    return await client.model_demand(model, DEMAND_SETTINGS["window_seconds"])


def dense_replicas(plan: Plan, model: str) -> int:
    placement = plan.deployments[f"{model}/dense"]
    return sum(n for by_hw in placement.replicas.values() for n in by_hw.values())


async def test_observed_demand_above_the_declared_peak_sizes_the_next_replan(
    stack: Settings, stack_config: Path, client: Client, model_name: str
) -> None:
    spec = one_region_spec(model_name, traffic={"peak_qps": {"us-east": DECLARED_QPS}})
    parts = {
        "dense": spec.parts["dense"].model_copy(
            update={"hardware": {"cpu-std": HardwareOption(units=1, qps=DENSE_QPS)}}
        ),
        "embed": spec.parts["embed"].model_copy(
            update={"hardware": {"cpu-highmem": HardwareOption(units=2, qps=12)}}
        ),
    }
    rollout = spec.rollout.model_copy(update={"steps": [100], "min_requests": 10})
    spec = spec.model_copy(update={"parts": parts, "rollout": rollout})
    await client.publish_model(spec)
    folder, _ = train_version(stack, model_name, "v1")
    published = await client.publish_snapshot(model_name, folder)
    state = await client.wait_until_serving(model_name, published.set_id)
    assert state.plan is not None and dense_replicas(state.plan, model_name) == 1  # sized for 4 qps

    temporal = await connect_client(stack)
    await ensure_replan_schedule(
        temporal, stack.temporal.task_queue, timedelta(hours=6), FleetReplanInput(time_limit_s=20)
    )
    schedule = temporal.get_schedule_handle(REPLAN_SCHEDULE_ID)
    await schedule.pause(note="held by the test: runs only when triggered")
    path = f"/us-east/models/{model_name}/predict"
    try:
        # 1. Three times the declared peak for more than two demand windows (one whole window
        # at least falls inside it, whatever the clock).
        started = time.perf_counter()
        statuses = await paced(
            stack.serve_url, path, 3 * DECLARED_QPS, 2.5 * DEMAND_SETTINGS["window_seconds"], keyed(stack)
        )
        # Every answer is a 200; a request left unanswered by an overloaded box is allowed, up to
        # a tenth (the router still counts it: it arrived), and printed.
        answered = [code for code in statuses if code != NO_ANSWER]
        assert answered and all(code == 200 for code in answered), sorted(set(statuses))
        assert len(answered) >= 0.9 * len(statuses), f"{len(answered)} of {len(statuses)} answered"
        seen = await poll_until(
            lambda: observed(client, model_name),
            lambda d: (
                d is not None
                and d.sources.get("us-east") is not None
                and d.sources["us-east"].requests >= len(answered)
            ),
            timeout_s=30,
            interval_s=0.5,
            what="every request sent in the model's observed demand",
        )
        east = seen.sources["us-east"]
        print(
            f"observed: {east.requests} requests ({len(answered)} of {len(statuses)} answered), "
            f"peak {east.peak_qps:g} qps over "
            f"{seen.window_seconds:g} s windows (declared {DECLARED_QPS:g}), "
            f"{time.perf_counter() - started:.1f}s"
        )

        # 2. The metrics actor restarts (its process dies): its history comes back from its file.
        saved = demand_file(stack.demand_store(), model_name, "us-east")
        await poll_until(
            lambda: asyncio.to_thread(saved.exists), bool, timeout_s=15, interval_s=0.2, what=str(saved)
        )
        connect(stack.ray_address())
        actor = ray.get_actor(metrics_actor_name(model_name, "us-east"), namespace=RAY_NAMESPACE)
        ray.kill(actor, no_restart=False)
        killed = time.perf_counter()
        again = await poll_until(
            lambda: observed(client, model_name),
            lambda d: d.regions == ["us-east"],  # its router's region reports again
            timeout_s=60,
            interval_s=0.5,
            what="the restarted metrics actor's demand history",
        )
        # Nothing lost; the peak may only have grown (the window that was filling has ended).
        assert again.sources["us-east"].requests >= east.requests
        assert again.sources["us-east"].peak_qps >= east.peak_qps
        print(f"metrics actor restarted with its history in {time.perf_counter() - killed:.1f}s")

        # 3. The triggered replan plans the observed peak x (1 + margin), and says so.
        result = await trigger_and_wait(temporal, timeout_s=180)
        sizing = result.demand[model_name]
        planned = sizing.sources["us-east"]
        print(f"replan {result.revision}: {planned}")
        assert sizing.observed and planned.used == "observed" and planned.over_budget
        assert planned.declared_qps == DECLARED_QPS and planned.observed_peak_qps is not None
        assert planned.observed_peak_qps >= max(east.peak_qps, 2 * DECLARED_QPS)  # 3x sent
        assert planned.planned_qps == pytest.approx(
            planned.observed_peak_qps * (1 + DEMAND_SETTINGS["margin"])
        )
        assert model_name in result.applied_to, result
        stored = PlanStore(stack.state_dir).load(result.revision)
        assert stored.demand[model_name] == sizing
        replicas = dense_replicas(stored.as_plan(), model_name)
        assert (
            replicas > 1
            and replicas * DENSE_QPS * (1 - spec.availability.headroom) >= planned.planned_qps - 1e-6
        )
        shown = ipnext(stack_config, "plan", "show")
        assert shown.returncode == 0, shown.stderr
        assert f"{model_name}: observed weighed in" in shown.stdout
        assert (
            f"OVER BUDGET: observed {planned.observed_peak_qps:g} > declared {DECLARED_QPS:g}" in shown.stdout
        )

        # 4. The model serves the new plan (a capacity move, under light traffic for its gates).
        moving = time.perf_counter()
        async with Load(stack.serve_url, path, headers=keyed(stack), workers=1):
            state = await poll_until(
                lambda: client.get_model(model_name),
                lambda s: (
                    s.plan is not None
                    and dense_replicas(s.plan, model_name) == replicas
                    and s.state == ModelStatus.SERVING
                    and s.rollout is not None
                    and s.rollout.state.value == "completed"
                ),
                timeout_s=180,
                interval_s=0.5,
                what=f"{model_name} serving {replicas} dense replicas",
            )
        print(f"{model_name} moved to {replicas} dense replicas in {time.perf_counter() - moving:.1f}s")
        assert state.serving_set == published.set_id
    finally:
        await schedule.delete()
        await client.delete_model(model_name)
    assert not saved.exists()  # a deleted model's demand history goes with it
