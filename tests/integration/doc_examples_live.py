"""The sync SDK's example with an explicit URL, `PredictionClient("http://127.0.0.1:8000")`, on the
real stack: it keeps the stack's API key (issue 42: it dropped it, and every call answered 401).

The example is the one `ipnext.client.prediction`'s docstring shows (the SDK reference and
`help()` print it; `ipnext.client.sdk`'s shows the same lines), run as written but for the
stack's address and the model, in a fresh interpreter whose only setting is `IPNEXT_CONFIG`
(IPNEXT_API_KEY unset), as a user's shell runs it: the key must come from the stack's key file.
The README holds no such example since issue 39 (its ten lines use `Client`, and the SDK page's
`PredictionClient.from_settings()`, both run as written by test_cli).

Helpers, not a test module: the CLI drill (test_cli.py), which serves `feed-ranker` already,
runs `predicts_with_the_stacks_key` after the SDK page's examples, so the check costs one
interpreter's start and one request, not a stack or a rollout of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import ipnext.client.prediction as prediction
from ipnext.spec.settings import Settings
from ipnext.store.keys import API_KEY_ENV
from tests.docs_examples import substituted

from .conftest import REPO

# What the example names that a stack of the suite has elsewhere (its own port; a model per test).
PLACEHOLDER_URL = '"http://127.0.0.1:8000"'
PLACEHOLDER_MODEL = '"feed-ranker"'
# The example as a script: the client is the public one, and what it got is printed as JSON.
RUNNER = """\
import json
from ipnext import PredictionClient, PredictionError

try:
{example}
except PredictionError as err:
    print(json.dumps({{"status": err.status_code, "error": str(err)}}))
else:
    print(json.dumps({{"status": 200, "reply": reply.model_dump(mode="json")}}))
"""


def sync_url_example() -> str:
    """The indented `with PredictionClient("http://...") as serving:` example of the prediction
    module's docstring, dedented."""
    lines = (prediction.__doc__ or "").splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("with PredictionClient("))
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and len(lines[end]) - len(lines[end].lstrip()) > indent:
        end += 1
    return textwrap.dedent("\n".join(lines[start:end])) + "\n"


def run_sync_url_example(stack: Settings, stack_config: Path, model: str) -> dict[str, Any]:
    """The example, with the stack's URL and `model` for its placeholders, in a fresh interpreter
    with IPNEXT_CONFIG naming the stack and no IPNEXT_API_KEY: `{"status", "reply" or "error"}`."""
    code = substituted(
        sync_url_example(),
        {PLACEHOLDER_URL: json.dumps(stack.serve_url), PLACEHOLDER_MODEL: json.dumps(model)},
    )
    env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, "TEMPORAL_ADDRESS", "RAY_ADDRESS")}
    env["IPNEXT_CONFIG"] = str(stack_config)
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", RUNNER.format(example=textwrap.indent(code, "    "))],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=45,
    )
    print(f"sync SDK example for {model}: exit {done.returncode} in {time.monotonic() - t0:.1f}s")
    assert done.returncode == 0, f"the example failed:\n{done.stdout}\n{done.stderr}"
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["status"] != 401, f"the example dropped the stack's API key: {answer}"
    return answer


def predicts_with_the_stacks_key(stack: Settings, stack_config: Path, model: str) -> dict[str, Any]:
    """The example on `model`, which serves: it returns a prediction (for a drill that serves one,
    e.g. test_cli's `feed-ranker`, after the SDK page's examples)."""
    answer = run_sync_url_example(stack, stack_config, model)
    assert answer["status"] == 200, answer
    assert answer["reply"]["set"].startswith(f"{model}@") and answer["reply"]["outputs"], answer
    reply: dict[str, Any] = answer["reply"]
    return reply
