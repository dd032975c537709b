"""TEMPORAL_ADDRESS and RAY_ADDRESS make `dev up` use existing clusters: it then starts only the
worker, and models publish and serve through them. A second `up` sees the stack already up."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

import pytest
import yaml

from ipnext.client.devstack.stack import DevStack, stack_processes
from ipnext.client.sdk import Client
from ipnext.spec.settings import Settings, load_settings

from .conftest import one_region_spec, train_version

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


async def test_dev_up_uses_existing_clusters(
    stack: Settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    base = Path(tempfile.mkdtemp(prefix="ipn-ext-", dir="/tmp"))
    config = {
        "fleet_file": str(stack.fleet_file),
        "snapshot_roots": [str(r) for r in stack.snapshot_roots],
        "state_dir": str(base / "state"),
        "temporal": {"task_queue": f"ipnext-ext-{uuid.uuid4().hex[:6]}"},
        "serve": stack.serve.model_dump(),
        # Every worker of one Ray cluster names the same keys file: the Serve writer checks the
        # doors against the one its latest caller names.
        "auth": {"keys_file": str(stack.keys_file()), "api_key_file": str(stack.api_key_file())},
    }
    path = base / "ipnext.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setenv("TEMPORAL_ADDRESS", stack.temporal_address)
    monkeypatch.setenv("RAY_ADDRESS", stack.ray_address())
    settings = load_settings(path)
    dev = DevStack(settings, config_path=path)
    record = dev.up()
    try:
        assert list(record["processes"]) == ["worker", "supervisor"]  # only what it must start
        out = capsys.readouterr().out
        assert f"using the Temporal cluster at {stack.temporal_address}" in out
        assert f"using the Ray cluster at {stack.ray_address()}" in out
        again = dev.up()
        assert "already up" in capsys.readouterr().out
        assert again["processes"]["worker"]["pid"] == record["processes"]["worker"]["pid"]

        name = f"x{uuid.uuid4().hex[:6]}"
        async with await Client.connect(settings) as ipn:
            await ipn.publish_model(one_region_spec(name))
            folder, _ = train_version(stack, name, "v1")
            published = await ipn.publish_snapshot(name, folder)
            await ipn.wait_until_serving(name, published.set_id)
            reply = await ipn.predict(name, {"user": 5, "items": [6]})
            assert reply.set == published.set_id
            await ipn.delete_model(name, who="test")
    finally:
        dev.down()
    assert stack_processes(record["stack_id"]) == []
