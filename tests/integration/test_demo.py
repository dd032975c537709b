"""`ipnext demo --once` (what `make demo ARGS=--once` runs) from the command line, on a stack of its
own: it exits 0, prints predictions from v1 then v2, and leaves no process behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ipnext.client.devstack.stack import scratch_config
from ipnext.names import wait_until

from .conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(480)]

# How long the demo's processes may take to be gone once it has exited (each was sent its stop
# and waited on; on a loaded machine the kernel may still be tearing the last ones down). One
# left behind never goes, so a longer wait tells the two apart as well.
PROCESSES_GONE_S = 10.0


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_demo_once_end_to_end() -> None:
    config = scratch_config(Path(tempfile.mkdtemp(prefix="ipn-demo-", dir="/tmp")), REPO / "config")
    env = {k: v for k, v in os.environ.items() if k not in ("TEMPORAL_ADDRESS", "RAY_ADDRESS")}
    env["IPNEXT_CONFIG"] = str(config)
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "ipnext.client.cli", "demo", "--once"],
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    elapsed = time.perf_counter() - started
    print(proc.stdout[-4000:], proc.stderr[-2000:], f"demo --once took {elapsed:.1f}s", sep="\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    v1 = [
        i
        for i, line in enumerate(lines)
        if "predict" in line and "(set feed-ranker@" in line and "@v1-" in line
    ]
    v2 = [i for i, line in enumerate(lines) if "predict" in line and "@v2-" in line]
    assert v1 and v2 and max(v1) < min(v2), proc.stdout
    assert "ipnext dev stack stopped" in proc.stdout
    # v2 rolled out step by step under the demo's load, and every request answered 200.
    assert re.search(r"requests during the rollout, by HTTP status: \{200: \d+\}", proc.stdout), proc.stdout
    assert "step 1/3 (10%)" in proc.stdout
    wait_until(
        lambda: _processes_with(f"IPNEXT_CONFIG={config}"),
        lambda left: left == [],
        timeout_s=PROCESSES_GONE_S,
        what="the demo's processes gone (it left some behind)",
    )
