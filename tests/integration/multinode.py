"""A dev stack of real nodes for region drills: a Ray head and one Ray node per region of the
3-region fleet in examples/planning/fleet-3-regions.yaml (`ipnext dev up --nodes per-region`), on
ports and in a state folder of its own, beside the session's single-node stack.
Test modules import the fixture
`per_region_stack` (module-scoped: one stack per module that uses it) and the helpers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from ipnext.client.devstack.stack import WORKER_GCS_PATIENCE_S, DevStack, scratch_config, stack_processes
from ipnext.spec.settings import Settings, load_settings
from ipnext.store.ray_token import LOOPBACK_ENV, loopback_env, ray_auth_env

from .conftest import RECONCILE_SECONDS, REPO

THREE_REGIONS = REPO / "examples" / "planning" / "fleet-3-regions.yaml"
REGIONS = ("us-east", "eu-west", "ap-south")  # the regions of that fleet
HEAD = "head"


@dataclass
class PerRegionStack:
    settings: Settings
    dev: DevStack
    config: Path


@pytest.fixture(scope="module")
def per_region_stack() -> Iterator[PerRegionStack]:
    for var in ("TEMPORAL_ADDRESS", "RAY_ADDRESS", "IPNEXT_CONFIG"):
        os.environ.pop(var, None)
    os.environ["RAY_gcs_rpc_server_reconnect_timeout_s"] = str(WORKER_GCS_PATIENCE_S)
    # Short path: Ray's unix sockets live under the state folder and must stay under 107 bytes.
    base = Path(tempfile.mkdtemp(prefix="ipn-nodes-", dir="/tmp"))
    path = scratch_config(base, REPO / "config")
    shutil.copyfile(THREE_REGIONS, base / "fleet.yaml")
    config = yaml.safe_load(path.read_text())
    config["serve"]["reconcile_seconds"] = RECONCILE_SECONDS
    config["ray"] = {"nodes": "per-region"}
    path.write_text(yaml.safe_dump(config))
    dev = DevStack(config_path=path)
    record = dev.up()
    try:
        yield PerRegionStack(settings=load_settings(path), dev=dev, config=path)
    finally:
        dev.down()
        assert stack_processes(record["stack_id"]) == [], "dev down left processes behind"


# Run in a process of its own: the test process may be attached to the session's stack's Ray.
_WHERE = """
import json, sys
import ray
from ray._private import state
from ray import serve
from ray.serve.context import _get_global_client

ray.init(address=sys.argv[1], namespace="ipnext", log_to_driver=False)
label = {}
for node in ray.nodes():
    if node["Alive"]:
        regions = [k.split(":", 1)[1] for k in node["Resources"] if k.startswith("region:")]
        head = "node:__internal_head__" in node["Resources"]
        label[node["NodeID"]] = "head" if head else ",".join(regions)
actors = {
    info["Name"]: label.get(info["Address"]["NodeID"], "?")
    for info in state.actors().values()
    if info["Name"] and info["State"] == "ALIVE"
}
details = _get_global_client().get_serve_details()
proxies = sorted(label.get(node_id, "?") for node_id in (details.get("proxies") or {}))
word = lambda status: str(getattr(status, "value", status)).rsplit(".", 1)[-1]
apps = {
    name: {"status": word(app.status), **{d: word(s.status) for d, s in app.deployments.items()}}
    for name, app in serve.status().applications.items()
}
print(json.dumps({"nodes": sorted(label.values()), "actors": actors, "proxies": proxies, "apps": apps}))
"""


def driver_env(settings: Settings) -> dict[str, str]:
    """The environment of a raw Ray driver of the stack: its token, and 127.0.0.1 kept as the
    node address only for a loopback cluster (this process may have set it for another stack)."""
    address = settings.ray_address()
    env = {k: v for k, v in os.environ.items() if k != LOOPBACK_ENV}
    return env | ray_auth_env(settings) | loopback_env(address)


def where_things_run(settings: Settings) -> dict[str, Any]:
    """The live nodes (`head` or their region), where each named Ray actor runs, the nodes with
    a Serve proxy, and each Serve app's status with its deployments' (`apps`: app -> {"status":
    app status, deployment: its status}), as Ray and Serve report them."""
    done = subprocess.run(
        [sys.executable, "-c", _WHERE, settings.ray_address()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=driver_env(settings),
    )
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found
