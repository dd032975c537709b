"""The operator identity on a rollout's record: pause, resume and abort sent by the SDK and the CLI
carry their `ipnext-identity` header, which the rollout records beside the payload's `who`; the
same signals from the `temporal` CLI or a bare Temporal client (as the Temporal UI sends them)
are recorded as unattributed. Histories with and without the header replay (histories/ holds two
recorded by the workflows before they read identities: test_recorded_histories.py replays them)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid

import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer, Worker

from ipnext.activities.rollouts import RolloutActivities
from ipnext.client.sdk import Client as IpnextClient
from ipnext.client.worker import INTERCEPTORS, WORKFLOWS
from ipnext.contracts.identity import UNATTRIBUTED
from ipnext.contracts.model import ModelWorkflowInput, PublishResult
from ipnext.contracts.rollout import AbortInput
from ipnext.names import RolloutState, model_workflow_id, rollout_workflow_id
from ipnext.spec.settings import Settings, TemporalSettings

from .fakes import SPEC, FakeServing, request, until, until_rollout, with_rollout
from .test_rollout_workflow import signal

pytestmark = pytest.mark.timeout(120)

NAME = SPEC.name


def _replayer() -> Replayer:
    """The worker's workflows and interceptors, replaying a history with no server."""
    return Replayer(workflows=WORKFLOWS, interceptors=INTERCEPTORS, data_converter=pydantic_data_converter)


async def _cli(address: str, *args: str, identity: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("IPNEXT_") and k != "TEMPORAL_ADDRESS"}
    env |= {"IPNEXT_TEMPORAL__ADDRESS": address, "IPNEXT_TEMPORAL__IDENTITY": identity}
    argv = [sys.executable, "-m", "ipnext.client.cli", *args]
    return await asyncio.to_thread(subprocess.run, argv, env=env, capture_output=True, text=True, timeout=90)


async def test_sdk_and_cli_signals_carry_their_identity_and_bare_ones_are_unattributed(
    temporal: Client,
) -> None:
    address = temporal.service_client.config.target_host
    fake = FakeServing()
    queue = f"wf-{uuid.uuid4().hex[:8]}"
    activities = [*fake.activities(), RolloutActivities(temporal).rollout_outcome]
    spec = with_rollout(steps=[30, 100], bake_seconds=60.0)  # a bake that outlasts the test
    async with Worker(
        temporal, task_queue=queue, workflows=WORKFLOWS, activities=activities, interceptors=INTERCEPTORS
    ):
        handle = await temporal.start_workflow(
            "ModelWorkflow", ModelWorkflowInput(spec=spec), id=model_workflow_id(NAME), task_queue=queue
        )
        await handle.execute_update("publish", request("v1"), result_type=PublishResult)
        await until(handle, lambda s: s.serving_set == "wf-model@1")
        await handle.execute_update("publish", request("v2"), result_type=PublishResult)
        await until_rollout(temporal, "wf-model@2", lambda s: "baking" in s.step)

        settings = Settings(temporal=TemporalSettings(address=address, task_queue=queue))
        async with await IpnextClient.connect(settings, identity="sdk-operator") as ipn:
            await ipn.pause_rollout(NAME, "checking a dashboard", who="alice")
        await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.PAUSED)
        # On-call resumes from the `temporal` CLI: no identity header.
        await signal(temporal, "wf-model@2", "resume", '{"who": "bob"}')
        await until_rollout(temporal, "wf-model@2", lambda s: s.state == RolloutState.RUNNING)
        paused = await _cli(
            address, "rollout", "pause", NAME, "--reason", "again", "--who", "carol", identity="cli-operator"
        )
        assert paused.returncode == 0, paused.stderr
        await until_rollout(temporal, "wf-model@2", lambda s: len(s.pauses) == 2)
        status = await _cli(address, "rollout", "status", NAME, identity="cli-operator")
        # A bare Temporal client (the test's own, with no interceptor) aborts.
        await temporal.get_workflow_handle(rollout_workflow_id(NAME, "wf-model@2")).signal(
            "abort", AbortInput(reason="bare client", who="dave")
        )
        ended = await until_rollout(temporal, "wf-model@2", lambda s: s.state.is_terminal)
        history = await temporal.get_workflow_handle(rollout_workflow_id(NAME, "wf-model@2")).fetch_history()
    # A worker that restarts replays the headers from the history: the same record, no nondeterminism.
    replayed = await _replayer().replay_workflow(history, raise_on_replay_failure=False)
    assert replayed.replay_failure is None, replayed.replay_failure
    first, second = ended.pauses
    assert (first.who, first.identity, first.resumed_by, first.resumed_identity) == (
        "alice",
        "sdk-operator",
        "bob",
        UNATTRIBUTED,
    )
    assert (second.who, second.identity) == ("carol", "cli-operator")
    assert (
        ended.state == RolloutState.ABORTED and "aborted by dave [unattributed]: bare client" in ended.detail
    )
    assert status.returncode == 0, status.stderr
    assert (
        "by alice [sent as sdk-operator]: checking a dashboard, resumed by bob [unattributed]"
        in status.stdout
    )
    assert "by carol [sent as cli-operator]: again" in status.stdout, status.stdout
