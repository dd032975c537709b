"""The `ipnext` CLI against the session's stack: the same verbs as the SDK, errors with exit code 2,
and a delete that tears serving down (apps, route, routing document)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from ipnext.names import wait_until
from ipnext.spec.settings import Settings

from .conftest import EXAMPLE_MODEL, keyed, train_version

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
WITHDRAWN_S = 30.0  # a deleted model's routing document is gone from the routing app within this


def ipnext(stack_config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TEMPORAL_ADDRESS", "RAY_ADDRESS")}
    env["IPNEXT_CONFIG"] = str(stack_config)
    return subprocess.run(
        [sys.executable, "-m", "ipnext.client.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_cli_verbs(stack: Settings, stack_config: Path, tmp_path: Path, model_name: str) -> None:
    spec = yaml.safe_load(EXAMPLE_MODEL.read_text())
    # A 20 ms budget keeps eu-west traffic in eu-west (us-east is 40 ms away, and cheaper).
    spec.update(name=model_name, traffic={"peak_qps": {"eu-west": 20}}, latency_budget_ms=20)
    spec_file = tmp_path / "model.yaml"
    spec_file.write_text(yaml.safe_dump(spec))

    out = ipnext(stack_config, "model", "publish", str(spec_file))
    assert out.returncode == 0, out.stderr
    assert f"model {model_name} registered" in out.stdout
    again = ipnext(stack_config, "model", "publish", str(spec_file))
    assert again.returncode == 2 and "ModelExistsError" in again.stderr and "already exists" in again.stderr

    folder, _ = train_version(stack, model_name, "v1")
    out = ipnext(stack_config, "snapshot", "publish", model_name, str(folder), "--wait")
    assert out.returncode == 0, out.stderr
    assert f"published {model_name}@1" in out.stdout and "serves in ['eu-west']" in out.stdout

    # --source picks the serving region from the plan's routing fractions.
    out = ipnext(
        stack_config, "predict", model_name, "--inputs", '{"user": 1, "items": [1, 2]}', "--source", "eu-west"
    )
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["set"] == f"{model_name}@1" and reply["region"] == "eu-west" and len(reply["outputs"]) == 2

    got = json.loads(ipnext(stack_config, "model", "get", model_name).stdout)
    assert got["serving_set"] == f"{model_name}@1" and got["state"] == "serving"

    wait_until(  # visibility lags writes
        lambda: ipnext(stack_config, "model", "list").stdout,
        lambda listed: model_name in listed,
        timeout_s=30,
        interval_s=1,
        what=f"{model_name} listed",
    )

    exported = tmp_path / "serve.yaml"
    out = ipnext(stack_config, "serve", "export", "-o", str(exported))
    assert out.returncode == 0, out.stderr
    config = ServeDeploySchema.model_validate(yaml.safe_load(exported.read_text()))
    names = {app.name for app in config.applications}
    assert {f"{model_name}.eu-west", f"{model_name}.eu-west.s1.r1"} <= names

    bad = ipnext(stack_config, "snapshot", "publish", model_name, str(tmp_path))
    assert bad.returncode == 2 and "no manifest.json" in bad.stderr
    bad_json = ipnext(stack_config, "predict", model_name, "--inputs", "{nope")
    assert bad_json.returncode == 2 and "--inputs is not JSON" in bad_json.stderr

    # Delete tears serving down: its apps out of Serve's config, its route 404, its routing
    # document withdrawn, and the model unknown.
    out = ipnext(stack_config, "model", "delete", model_name)
    assert out.returncode == 0, out.stderr
    removed = sorted([f"{model_name}.eu-west", f"{model_name}.eu-west.s1.r1"])
    assert f"model {model_name} deleted; removed apps" in out.stdout, out.stdout
    assert all(name in out.stdout for name in removed), out.stdout
    out = ipnext(stack_config, "serve", "export", "-o", str(exported))
    assert out.returncode == 0, out.stderr
    left = ServeDeploySchema.model_validate(yaml.safe_load(exported.read_text()))
    assert not [app.name for app in left.applications if app.name.startswith(f"{model_name}.")]
    with httpx.Client(base_url=stack.serve_url, headers=keyed(stack), timeout=30) as http:
        predict = http.post(
            f"/eu-west/models/{model_name}/predict", json={"inputs": {"user": 1, "items": [4]}}
        )
        assert predict.status_code == 404, predict.text
        wait_until(
            lambda: http.get(f"/models/{model_name}/routing").status_code,
            lambda status: status == 404,
            timeout_s=WITHDRAWN_S,
            interval_s=0.2,
            what="the routing document withdrawn",
        )
    gone = ipnext(stack_config, "model", "get", model_name)
    assert gone.returncode == 2 and "ModelNotFoundError" in gone.stderr
