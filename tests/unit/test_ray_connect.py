"""An ipnext process never starts a Ray cluster of its own (serving.control.forbid_implicit_init).

Ray's public calls run `ray.init()` with no address when the process is not connected. In the
worker that happened between `connect`'s shutdown of a lost cluster and its init of the new
one: a Serve handle's metrics thread called `ray.wait`, a local Ray instance started inside the
worker, and every later serving check timed out. Run in a fresh interpreter: the test process's
own Ray state stays out of it.

Following a cluster that came back at a new address, `connect` also stops the Serve handles the
process held on the old one (seam tests: Ray replaced, the order of the calls checked)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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


def test_following_a_restarted_cluster_stops_the_handles_held_on_the_old_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`connect` to a new address stops this process's cached Serve handles before it leaves the
    old cluster (their routers' metrics pushes failed there forever, a traceback each), then
    forgets Serve's client; at the same address it leaves everything alone. Ray itself is
    replaced at its seam: what is checked is the order of the calls."""
    from ray.serve import context

    from ipnext.serving import control

    calls: list[str] = []

    class Client:
        def shutdown_cached_handles(self) -> None:
            calls.append("stop handles")

    monkeypatch.setattr(control, "forbid_implicit_init", lambda: None)
    monkeypatch.setattr(control.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(control.ray, "shutdown", lambda: calls.append("ray shutdown"))
    monkeypatch.setattr(control.ray, "init", lambda address, **_: calls.append(f"ray init {address}"))
    monkeypatch.setattr(context, "_global_client", Client())
    monkeypatch.setattr(control, "_connected", "10.0.0.1:6379")

    control.connect("10.0.0.1:6379")
    assert calls == []  # the same cluster: nothing to follow
    control.connect("10.0.0.2:6379")
    assert calls == ["stop handles", "ray shutdown", "ray init 10.0.0.2:6379"], calls
    assert context._global_client is None and control._connected == "10.0.0.2:6379"


def test_a_handle_that_cannot_be_stopped_does_not_keep_the_worker_on_the_old_cluster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ray.serve import context

    from ipnext.serving import control

    class Client:
        def shutdown_cached_handles(self) -> None:
            raise RuntimeError("the router's loop is gone")

    inits: list[str] = []
    monkeypatch.setattr(control, "forbid_implicit_init", lambda: None)
    monkeypatch.setattr(control.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(control.ray, "shutdown", lambda: None)
    monkeypatch.setattr(control.ray, "init", lambda address, **_: inits.append(address))
    monkeypatch.setattr(context, "_global_client", Client())
    monkeypatch.setattr(control, "_connected", "10.0.0.1:6379")
    control.connect("10.0.0.3:6379")
    assert inits == ["10.0.0.3:6379"] and control._connected == "10.0.0.3:6379"


def test_a_handle_stop_that_hangs_is_left_behind_after_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from ray.serve import context

    from ipnext.serving import control

    release = threading.Event()

    class Client:
        def shutdown_cached_handles(self) -> None:
            release.wait(60)  # the routers' loop stuck

    inits: list[str] = []
    monkeypatch.setattr(control, "HANDLES_STOP_TIMEOUT_S", 0.05)
    monkeypatch.setattr(control, "forbid_implicit_init", lambda: None)
    monkeypatch.setattr(control.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(control.ray, "shutdown", lambda: None)
    monkeypatch.setattr(control.ray, "init", lambda address, **_: inits.append(address))
    monkeypatch.setattr(context, "_global_client", Client())
    monkeypatch.setattr(control, "_connected", "10.0.0.1:6379")
    try:
        control.connect("10.0.0.4:6379")  # returns though the stop never does
        assert inits == ["10.0.0.4:6379"]
    finally:
        release.set()
