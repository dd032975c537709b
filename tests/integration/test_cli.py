"""The README's ten lines of the SDK and the SDK page's examples, run as their pages write them,
then the `ipnext` CLI on the model they served: the same verbs as the SDK, errors with exit code
2, and a delete that tears serving down (apps, route, routing document).

The examples run each in a fresh interpreter from the repository root with only `IPNEXT_CONFIG`
naming the stack's config (they read their settings as a user's would): the README's publishes
`feed-ranker` from examples/click_ranker/ and trains its v1, the SDK page's read it back and
predict. The CLI then works on that model, so the suite pays for one first rollout, not two."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from ipnext.client.sdk import Client
from ipnext.errors import ModelNotFoundError
from ipnext.names import wait_until
from ipnext.spec.settings import Settings
from tests.docs_examples import example

from .conftest import EXAMPLE_MODEL, REPO, keyed, train_version
from .doc_examples_live import predicts_with_the_stacks_key

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]
WITHDRAWN_S = 30.0  # a deleted model's routing document is gone from the routing app within this
MODEL = "feed-ranker"  # the name the examples use


def _environment(stack_config: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TEMPORAL_ADDRESS", "RAY_ADDRESS")}
    env["IPNEXT_CONFIG"] = str(stack_config)
    return env


def ipnext(stack_config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ipnext.client.cli", *args],
        env=_environment(stack_config),
        capture_output=True,
        text=True,
        timeout=240,
    )


def run_as_written(name: str, stack_config: Path) -> str:
    """The docs example `name`, exactly as its page writes it, in a fresh interpreter."""
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", example(name)],
        cwd=REPO,
        env=_environment(stack_config),
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(f"docs example {name}: exit {done.returncode} in {time.monotonic() - t0:.1f}s")
    assert done.returncode == 0, f"example {name} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


async def _delete(client: Client) -> None:
    try:
        await client.delete_model(MODEL, who="test")
    except ModelNotFoundError:
        pass


async def test_docs_examples_then_cli_verbs(
    stack: Settings, stack_config: Path, tmp_path: Path, client: Client
) -> None:
    await _delete(client)  # a rerun on the same stack starts clean
    try:
        await asyncio.to_thread(_examples_then_verbs, stack, stack_config, tmp_path)
    finally:
        await _delete(client)


def _examples_then_verbs(stack: Settings, stack_config: Path, tmp_path: Path) -> None:
    said = run_as_written("readme-sdk", stack_config)
    assert f"set='{MODEL}@1'" in said and "region='us-east'" in said, said
    said = run_as_written("sdk-client", stack_config)
    lines = said.splitlines()
    assert lines[0] == f"serving {MODEL}@1", said
    assert f"{MODEL}@1" in lines[1] and "us-east" in lines[1], said
    assert MODEL in lines[2] and lines[3] == "completed", said
    said = run_as_written("sdk-prediction-client", stack_config)
    lines = said.splitlines()
    assert f"{MODEL}@1" in lines[0] and "inputs.user: 9999" in lines[1], said
    # The SDK module's own example, PredictionClient(url): the stack's key goes with any URL.
    reply = predicts_with_the_stacks_key(stack, stack_config, MODEL)
    assert reply["set"] == f"{MODEL}@1", reply

    model_name = MODEL
    again = ipnext(stack_config, "model", "publish", str(EXAMPLE_MODEL))
    assert again.returncode == 2 and again.stderr.startswith("ipnext: ") and "already exists" in again.stderr
    # A held set: validated through the CLI, kept, never rolled out by itself.
    folder, _ = train_version(stack, model_name, "v2", seed=2)
    out = ipnext(stack_config, "snapshot", "publish", model_name, str(folder), "--hold")
    assert out.returncode == 0 and f"published {model_name}@2 (held)" in out.stdout, out.stdout + out.stderr
    refused = ipnext(stack_config, "snapshot", "publish", model_name, str(folder), "--hold", "--wait")
    assert refused.returncode == 2 and "takes neither --wait" in refused.stderr, refused.stderr

    # --source picks the serving region from the plan's routing fractions.
    out = ipnext(
        stack_config, "predict", model_name, "--inputs", '{"user": 1, "items": [1, 2]}', "--source", "us-east"
    )
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["set"] == f"{model_name}@1" and reply["region"] == "us-east" and len(reply["outputs"]) == 2

    got = json.loads(ipnext(stack_config, "model", "get", model_name).stdout)
    assert got["serving_set"] == f"{model_name}@1" and got["state"] == "serving"
    assert [s["status"] for s in got["sets"]] == ["serving", "held"], got["sets"]

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
    assert {f"{model_name}.us-east", f"{model_name}.us-east.s1.r1"} <= names

    bad = ipnext(stack_config, "snapshot", "publish", model_name, str(tmp_path))
    assert bad.returncode == 2 and "no manifest.json" in bad.stderr
    bad_json = ipnext(stack_config, "predict", model_name, "--inputs", "{nope")
    assert bad_json.returncode == 2 and "--inputs is not JSON" in bad_json.stderr

    # Delete tears serving down: its apps out of Serve's config, its route 404, its routing
    # document withdrawn, and the model unknown.
    out = ipnext(stack_config, "model", "delete", model_name)
    assert out.returncode == 0, out.stderr
    removed = sorted([f"{model_name}.us-east", f"{model_name}.us-east.s1.r1"])
    assert f"model {model_name} deleted; removed apps" in out.stdout, out.stdout
    assert all(name in out.stdout for name in removed), out.stdout
    out = ipnext(stack_config, "serve", "export", "-o", str(exported))
    assert out.returncode == 0, out.stderr
    left = ServeDeploySchema.model_validate(yaml.safe_load(exported.read_text()))
    assert not [app.name for app in left.applications if app.name.startswith(f"{model_name}.")]
    with httpx.Client(base_url=stack.serve_url, headers=keyed(stack), timeout=30) as http:
        predict = http.post(
            f"/us-east/models/{model_name}/predict", json={"inputs": {"user": 1, "items": [4]}}
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
    assert gone.returncode == 2 and "is not registered" in gone.stderr
