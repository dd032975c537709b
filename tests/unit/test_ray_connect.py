"""An ipnext process never starts a Ray cluster of its own (serving.control.forbid_implicit_init).

Ray's public calls run `ray.init()` with no address when the process is not connected. In the
worker that happened between `connect`'s shutdown of a lost cluster and its init of the new
one: a Serve handle's metrics thread called `ray.wait`, a local Ray instance started inside the
worker, and every later serving check timed out. Run in a fresh interpreter: the test process's
own Ray state stays out of it."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import ray
from ipnext.serving.control import forbid_implicit_init
forbid_implicit_init()
try:
    ray.wait([], timeout=0)
    print("answered")
except Exception as err:
    print("refused:", type(err).__name__, err)
print("initialized:", ray.is_initialized())
"""


def test_a_ray_call_while_not_connected_fails_instead_of_starting_a_local_cluster() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "refused: RaySystemError" in done.stdout and "not been started" in done.stdout, done.stdout
    assert "initialized: False" in done.stdout, done.stdout
    assert "Started a local Ray instance" not in done.stdout + done.stderr
