"""Waiting for a set to serve tells the truth (on a real Temporal dev server, the activities faked):
`Client.wait_until_serving` and `ipnext snapshot publish --wait` report the rollout's progress,
wait through a pause that ends by itself when asked to, and stop at once, with the outcome or
the reason and how to go on, when it rolls back or a person pauses it."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from temporalio.client import Client as TemporalClient
from temporalio.client import WorkflowHandle
from temporalio.worker import Worker

from ipnext.activities.rollouts import RolloutActivities
from ipnext.client.sdk import Client
from ipnext.client.worker import WORKFLOWS
from ipnext.contracts.model import ModelWorkflowInput, PublishResult
from ipnext.contracts.rollout import RolloutStatus
from ipnext.errors import RolloutPausedError, RolloutStoppedError
from ipnext.names import RolloutState, model_workflow_id, poll_until
from ipnext.spec.settings import Settings

from .fakes import SPEC, FakeServing, request, until, until_rollout

pytestmark = pytest.mark.timeout(120)

NAME = SPEC.name


@pytest_asyncio.fixture(loop_scope="session")
async def serving_v1(temporal: TemporalClient) -> AsyncIterator[tuple[FakeServing, WorkflowHandle[Any, Any]]]:
    """`wf-model` registered under its own workflow id (as the SDK finds models), serving v1,
    with no traffic: a gradual rollout of the next set pauses itself once its bake ends."""
    fake = FakeServing()
    fake.rate = 0
    queue = f"wf-{uuid.uuid4().hex[:8]}"
    activities = [*fake.activities(), RolloutActivities(temporal).rollout_outcome]
    async with Worker(temporal, task_queue=queue, workflows=WORKFLOWS, activities=activities):
        handle = await temporal.start_workflow(
            "ModelWorkflow", ModelWorkflowInput(spec=SPEC), id=model_workflow_id(NAME), task_queue=queue
        )
        await handle.execute_update("publish", request("v1"), result_type=PublishResult)
        await until(handle, lambda s: s.serving_set == "wf-model@1" and s.state == "serving")
        yield fake, handle


@pytest_asyncio.fixture(loop_scope="session")
async def sdk(temporal: TemporalClient) -> AsyncIterator[Client]:
    async with Client(temporal, Settings()) as client:
        yield client


async def test_a_rollout_without_traffic_stops_the_wait_with_its_reason_then_goes_on(
    serving_v1: tuple[FakeServing, WorkflowHandle[Any, Any]], sdk: Client, temporal: TemporalClient
) -> None:
    fake, _ = serving_v1
    published = await sdk.publish_snapshot(NAME, request("v2").request)
    await _rollout_started(temporal, published.set_id)
    seen: list[RolloutStatus] = []
    started = time.monotonic()
    with pytest.raises(RolloutPausedError) as paused:
        await sdk.wait_until_serving(NAME, published.set_id, timeout_s=60, on_progress=seen.append)
    print(f"the wait stopped {time.monotonic() - started:.1f}s after publish: {paused.value}")
    err = paused.value
    assert err.reason == "insufficient_traffic" and err.who == "ipnext", err
    assert "send the model traffic" in str(err) and f"ipnext rollout resume {NAME}" in str(err), err
    assert isinstance(err.status, RolloutStatus) and err.status.state == RolloutState.PAUSED
    # Progress: one call per change, the set's own rollout, ending with the pause.
    assert seen and all(s.set_id == published.set_id for s in seen), seen
    assert seen[-1].state == RolloutState.PAUSED and "step 1/2 (50%)" in seen[-1].step, seen[-1]
    keys = [(s.state, s.step, sorted(s.traffic_percent.items())) for s in seen]
    assert all(a != b for a, b in itertools.pairwise(keys)), keys

    # Traffic comes: ipnext ends its own pause; waiting through pauses, the set serves.
    fake.rate = 100
    seen.clear()
    state = await sdk.wait_until_serving(
        NAME, published.set_id, timeout_s=60, on_progress=seen.append, stop_on_pause=False
    )
    assert state.serving_set == published.set_id
    assert any("step 2/2 (100%)" in s.step for s in seen), [s.step for s in seen]


async def test_a_caller_that_sends_the_traffic_waits_through_the_pause_for_it(
    serving_v1: tuple[FakeServing, WorkflowHandle[Any, Any]], sdk: Client, temporal: TemporalClient
) -> None:
    """`through_traffic_pause`: ipnext's own pause for too little traffic is waited through (the
    caller's traffic ends it, as the demo's callers do); the set serves with no resume."""
    fake, _ = serving_v1
    published = await sdk.publish_snapshot(NAME, request("v2").request)
    await _rollout_started(temporal, published.set_id)
    seen: list[RolloutStatus] = []
    wait = asyncio.create_task(
        sdk.wait_until_serving(
            NAME, published.set_id, timeout_s=60, on_progress=seen.append, through_traffic_pause=True
        )
    )
    paused = await poll_until(
        lambda: _now(seen),
        lambda s: bool(s) and s[-1].state == RolloutState.PAUSED,
        timeout_s=60,
        what="the rollout paused for traffic while the wait goes on",
    )
    assert not wait.done() and paused[-1].pauses[-1].reason == "insufficient_traffic"
    fake.rate = 100  # the traffic comes
    state = await asyncio.wait_for(wait, 60)
    assert state.serving_set == published.set_id
    assert all(s.pauses[-1].resumed_by in (None, "ipnext") for s in seen if s.pauses), seen[-1].pauses


async def test_a_caller_that_sends_the_traffic_still_stops_on_an_on_call_pause(
    serving_v1: tuple[FakeServing, WorkflowHandle[Any, Any]], sdk: Client, temporal: TemporalClient
) -> None:
    fake, _ = serving_v1
    fake.rate = 100
    published = await sdk.publish_snapshot(NAME, request("v2").request)
    await _rollout_started(temporal, published.set_id)
    await _until_rollout(sdk, lambda s: s.set_id == published.set_id and s.state.is_live)
    await sdk.pause_rollout(NAME, reason="looking at a dashboard", who="ann")
    with pytest.raises(RolloutPausedError) as paused:
        await sdk.wait_until_serving(NAME, published.set_id, timeout_s=60, through_traffic_pause=True)
    assert (paused.value.who, paused.value.reason) == ("ann", "looking at a dashboard"), paused.value


@pytest.mark.parametrize("how", ["paused_by_oncall", "rolled_back"])
async def test_the_wait_stops_when_on_call_pauses_or_the_gates_roll_back(
    serving_v1: tuple[FakeServing, WorkflowHandle[Any, Any]], sdk: Client, temporal: TemporalClient, how: str
) -> None:
    fake, _ = serving_v1
    fake.rate = 100
    if how == "rolled_back":
        fake.bad_apps.add("app-2")
    published = await sdk.publish_snapshot(NAME, request("v2").request)
    await _rollout_started(temporal, published.set_id)
    if how == "paused_by_oncall":
        running = await _until_rollout(sdk, lambda s: s.set_id == published.set_id and s.state.is_live)
        await sdk.pause_rollout(NAME, reason="looking at a dashboard", who="ann")
        with pytest.raises(RolloutPausedError) as paused:
            await sdk.wait_until_serving(NAME, published.set_id, timeout_s=60)
        assert (paused.value.who, paused.value.reason) == ("ann", "looking at a dashboard"), paused.value
        assert f"ipnext rollout resume {NAME}" in str(paused.value), paused.value
        assert running.workflow_id in str(paused.value) or published.set_id in str(paused.value)
    else:
        with pytest.raises(RolloutStoppedError) as stopped:
            await sdk.wait_until_serving(NAME, published.set_id, timeout_s=60)
        assert "rolled back" in str(stopped.value) and "error_rate" in str(stopped.value), stopped.value


def _v2_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "v2"
    folder.mkdir()
    (folder / "embed.safetensors").write_bytes(b"not read: the validation is faked")
    manifest = {
        "model": NAME,
        "version": "v2",
        "created_at": datetime.now(UTC).isoformat(),
        "parts": {"embed": {"file": "embed.safetensors", "sha256": "a" * 64}},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


async def _publish_wait(temporal: TemporalClient, folder: Path) -> tuple[asyncio.Task[Any], float]:
    """`ipnext snapshot publish wf-model FOLDER --wait` in a subprocess, as a CI step runs it;
    its output so far is in `wait.out` beside the folder (unbuffered), for a test to wait on a line."""
    env = {
        **os.environ,
        "IPNEXT_TEMPORAL__ADDRESS": temporal.service_client.config.target_host,
        "PYTHONUNBUFFERED": "1",
    }
    argv = [sys.executable, "-m", "ipnext.client.cli", "snapshot", "publish", NAME, str(folder), "--wait"]
    out = folder.parent / "wait.out"

    def run_cli() -> subprocess.CompletedProcess[str]:
        with out.open("w") as stdout:
            done = subprocess.run(argv, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=90)
        return subprocess.CompletedProcess(argv, done.returncode, out.read_text(), done.stderr)

    return asyncio.create_task(asyncio.to_thread(run_cli)), time.monotonic()


async def _printed(folder: Path, text: str) -> None:
    """Until the running `--wait` has printed a line holding `text`."""
    out = folder.parent / "wait.out"
    await poll_until(
        lambda: asyncio.to_thread(lambda: out.read_text() if out.exists() else ""),
        lambda printed: text in printed,
        timeout_s=60,
        interval_s=0.1,
        what=f"`--wait` printing {text!r}",
    )


async def test_publish_wait_waits_through_a_pause_for_traffic_and_exits_0_when_it_serves(
    serving_v1: tuple[FakeServing, WorkflowHandle[Any, Any]], temporal: TemporalClient, tmp_path: Path
) -> None:
    """The CI step's question is "does my set serve?": ipnext's own pause for too little traffic
    ends when traffic comes, so `--wait` waits through it (printing what the window still needs)
    and exits 0 once the set serves. (It exited 2 with `insufficient_traffic` on a rollout that
    went on to complete.)"""
    fake, _ = serving_v1
    folder = _v2_folder(tmp_path)
    run, started = await _publish_wait(temporal, folder)
    await until_rollout(
        temporal, "wf-model@2", lambda s: s.state == RolloutState.PAUSED and s.pauses[-1].who == "ipnext"
    )
    # The wait reads the rollout every so often: the traffic comes only once it has shown the
    # pause (on a loaded box the pause could otherwise begin and end between two of its reads).
    await _printed(folder, "paused: step 1/2 (50%)")
    assert not run.done()  # paused for traffic: still waiting
    fake.rate = 100  # the traffic comes: ipnext ends its own pause
    done = await asyncio.wait_for(run, 90)
    print(f"`snapshot publish --wait` exited {done.returncode} after {time.monotonic() - started:.1f}s")
    print(done.stdout + done.stderr)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("published wf-model@2 ("), lines
    progress = [line for line in lines[1:] if line.lstrip().startswith("+")]
    assert any("paused: step 1/2 (50%)" in line for line in progress), lines
    assert any("more request(s) on the new set (min_requests 5)" in line for line in progress), lines
    assert lines[-1] == "wf-model@2 serves in ['us-east']", lines


async def test_publish_wait_exits_2_with_the_outcome_when_the_gates_roll_back(
    serving_v1: tuple[FakeServing, WorkflowHandle[Any, Any]], temporal: TemporalClient, tmp_path: Path
) -> None:
    fake, _ = serving_v1
    fake.rate = 100
    fake.bad_apps.add("app-2")
    run, started = await _publish_wait(temporal, _v2_folder(tmp_path))
    done = await asyncio.wait_for(run, 90)
    print(f"`snapshot publish --wait` exited {done.returncode} after {time.monotonic() - started:.1f}s")
    print(done.stdout + done.stderr)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    line = done.stderr.strip()
    assert line.startswith("ipnext: wf-model@2 will not serve: rolled back: "), line
    assert "error_rate" in line and "Error:" not in line.split(":")[1], line


async def _rollout_started(temporal: TemporalClient, set_id: str) -> None:
    """Until this test's rollout answers its query. Before its child starts, the rollout's id
    names an earlier test's closed run, whose worker is gone: a query to it waits (the SDK's for
    10 s) for a worker that never comes. Only these tests reuse ids so."""
    await until_rollout(temporal, set_id, lambda s: True)


async def _until_rollout(sdk: Client, check: Any) -> RolloutStatus:
    found = await poll_until(
        lambda: sdk.rollout_status(NAME),
        lambda s: s is not None and check(s),
        timeout_s=30,
        interval_s=0.05,
        what="the rollout's condition",
    )
    assert found is not None
    return found


async def _now(value: list[RolloutStatus]) -> list[RolloutStatus]:
    return list(value)
