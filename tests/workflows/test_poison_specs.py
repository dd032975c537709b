"""Poison specs at the CLI's door: `peak_qps: .inf`, `peak_qps: 1e9` and a unicode version are
each refused at publish with one line naming the field and exit code 2, before any workflow
starts, and the same model name then publishes fine (a real Temporal dev server, the real
workflows, the activities faked at their seam)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import Worker

from ipnext.activities.rollouts import RolloutActivities
from ipnext.client.worker import WORKFLOWS
from ipnext.contracts.model import ValidateSpecInput
from ipnext.names import model_workflow_id
from ipnext.spec.fleet import load_fleet
from ipnext.spec.model import check_against_fleet

from .fakes import SPEC, FakeServing

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
NAME = SPEC.name  # the fakes place this model's part


async def _cli(temporal: Client, queue: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "IPNEXT_TEMPORAL__ADDRESS": temporal.service_client.config.target_host,
        "IPNEXT_TEMPORAL__TASK_QUEUE": queue,
    }
    argv = [sys.executable, "-m", "ipnext.client.cli", *args]
    return await asyncio.to_thread(
        subprocess.run, argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )


def _spec_file(folder: Path, label: str, peak_qps: str) -> Path:
    """SPEC as model.yaml, its us-east traffic written as the YAML literal `peak_qps`."""
    data = SPEC.model_dump(mode="json", exclude={"router"})
    data["traffic"] = {"peak_qps": {"us-east": "PEAK"}}
    path = folder / f"{label}.yaml"
    text = yaml.safe_dump(data)
    assert "us-east: PEAK\n" in text
    path.write_text(text.replace("us-east: PEAK\n", f"us-east: {peak_qps}\n"))
    return path


def _snapshot_folder(folder: Path, version: str) -> Path:
    """A snapshot folder of NAME whose manifest says `version` (the fakes never read the weights)."""
    path = folder / "snapshots" / NAME / f"folder-{uuid.uuid4().hex[:6]}"
    path.mkdir(parents=True)
    manifest = {
        "model": NAME,
        "version": version,
        "created_at": "2024-06-01T00:00:00Z",
        "parts": {"embed": {"file": "embed.safetensors", "sha256": "a" * 64}},
    }
    (path / "manifest.json").write_text(json.dumps(manifest, ensure_ascii=False))
    return path


def _refused(done: subprocess.CompletedProcess[str], field: str, why: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("ipnext: ") and field in lines[0] and why in lines[0], lines[0]


async def _latest_run(temporal: Client) -> tuple[str, WorkflowExecutionStatus | None] | None:
    """The run id and status of `model/<NAME>`'s latest run; None when none was ever started.
    Other workflow tests use the same name (the fakes place its part), and leave closed runs."""
    try:
        described = await temporal.get_workflow_handle(model_workflow_id(NAME)).describe()
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            return None
        raise
    return described.run_id or "", described.status


async def test_poison_specs_are_refused_at_publish_and_the_name_stays_usable(
    temporal: Client, tmp_path: Path
) -> None:
    before = await _latest_run(temporal)
    assert before is None or before[1] != WorkflowExecutionStatus.RUNNING, (
        "another test left this name running"
    )
    queue = f"poison-{uuid.uuid4().hex[:8]}"
    checked: list[str] = []  # every spec the worker was asked to check

    @activity.defn(name="validate_model_spec")
    async def validate_model_spec(input: ValidateSpecInput) -> None:
        checked.append(input.spec.name)
        check_against_fleet(input.spec, load_fleet(REPO / "config" / "fleet.dev.yaml"))

    fake = FakeServing()
    theirs = [a for a in fake.activities() if a != fake.validate_spec]  # this test checks specs itself
    activities = [*theirs, RolloutActivities(temporal).rollout_outcome, validate_model_spec]
    async with Worker(temporal, task_queue=queue, workflows=WORKFLOWS, activities=activities):
        for label, peak, why in (
            ("inf", ".inf", "finite number (got inf)"),
            ("nan", ".nan", "finite number (got nan)"),
            ("huge", "1e9", "1e+09 qps is more than the whole fleet can serve"),
        ):
            done = await _cli(temporal, queue, "model", "publish", str(_spec_file(tmp_path, label, peak)))
            print(f"peak_qps {peak}: exit {done.returncode}: {done.stderr.strip()}")
            _refused(done, "traffic.peak_qps.us-east", why)
            # Refused before any workflow started: not the model's, not even the worker's check.
            assert checked == [] and await _latest_run(temporal) == before

        done = await _cli(temporal, queue, "model", "publish", str(_spec_file(tmp_path, "good", "10")))
        assert done.returncode == 0, done.stderr
        assert f"model {NAME} registered" in done.stdout, done.stdout
        registered = await _latest_run(temporal)
        assert checked == [NAME] and registered is not None and registered != before
        assert registered[1] == WorkflowExecutionStatus.RUNNING

        for version in ("v2\u00e9", "\u0432\u0435\u0440\u0441\u0438\u044f-1"):
            done = await _cli(
                temporal, queue, "snapshot", "publish", NAME, str(_snapshot_folder(tmp_path, version))
            )
            print(f"version {version!r}: exit {done.returncode}: {done.stderr.strip()}")
            _refused(done, "version", f"(got {version!r})")
        done = await _cli(temporal, queue, "snapshot", "publish", NAME, str(_snapshot_folder(tmp_path, "v2")))
        assert done.returncode == 0, done.stderr
        assert f"published {NAME}@1" in done.stdout, done.stdout
