"""The README's ten lines of the SDK and the SDK page's examples, run as their pages write them on
the session's stack: each in a fresh interpreter from the repository root, with only
`IPNEXT_CONFIG` naming the stack's config (the examples read their settings as a user's would).
The README's publishes `feed-ranker` from examples/click_ranker/ and trains its v1; the SDK
page's read it back and predict. The model is deleted at the end, whatever happened."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ipnext.client.sdk import Client
from ipnext.errors import ModelNotFoundError
from ipnext.spec.settings import Settings
from tests.docs_examples import example

from .conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]
MODEL = "feed-ranker"  # the name the examples use


def run_as_written(name: str, stack_config: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("TEMPORAL_ADDRESS", "RAY_ADDRESS")}
    env["IPNEXT_CONFIG"] = str(stack_config)
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", example(name)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    print(f"docs example {name}: exit {done.returncode} in {time.monotonic() - t0:.1f}s")
    assert done.returncode == 0, f"example {name} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


async def _delete(client: Client) -> None:
    try:
        await client.delete_model(MODEL, who="docs-examples")
    except ModelNotFoundError:
        pass


async def test_readme_and_sdk_examples_run_as_written(
    stack: Settings, stack_config: Path, client: Client
) -> None:
    await _delete(client)  # a rerun on the same stack starts clean
    try:
        said = run_as_written("readme-sdk", stack_config)
        assert f"set='{MODEL}@1'" in said and "region='us-east'" in said, said

        said = run_as_written("sdk-client", stack_config)
        lines = said.splitlines()
        assert lines[0] == f"serving {MODEL}@1", said
        assert f"{MODEL}@1" in lines[1] and "us-east" in lines[1], said
        assert MODEL in lines[2] and lines[3] == "completed", said

        said = run_as_written("sdk-prediction-client", stack_config)
        lines = said.splitlines()
        assert f"{MODEL}@1" in lines[0], said
        assert "inputs.user" in lines[1] or "user" in lines[1], said  # the part's 400, naming the field
    finally:
        await _delete(client)
