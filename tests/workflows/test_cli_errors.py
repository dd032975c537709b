"""The CLI's errors are one line and exit code 2, never a traceback: a replan schedule that does
not exist yet (on a real Temporal dev server), and a Temporal that does not answer."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from temporalio.client import Client

from ipnext.client.devstack.stack import free_port

pytestmark = pytest.mark.timeout(120)


async def _cli(temporal_address: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "IPNEXT_TEMPORAL__ADDRESS": temporal_address}
    argv = [sys.executable, "-m", "ipnext.client.cli", *args]
    return await asyncio.to_thread(subprocess.run, argv, env=env, capture_output=True, text=True, timeout=90)


async def test_plan_schedule_before_there_is_one_says_how_to_create_it(temporal: Client) -> None:
    for verb in ("--status", "--pause", "--trigger"):
        done = await _cli(temporal.service_client.config.target_host, "plan", "schedule", verb)
        assert done.returncode == 2, (verb, done.stderr)
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "no replan schedule" in done.stderr and "--every 6h" in done.stderr, done.stderr


async def test_a_temporal_that_does_not_answer_is_one_line() -> None:
    done = await _cli(f"127.0.0.1:{free_port()}", "model", "list")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("ipnext: "), done.stderr
