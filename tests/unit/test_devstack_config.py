"""`--config` reaches every process the dev stack starts: the file a command read (given as a
relative path, from any folder) is handed on absolute as IPNEXT_CONFIG, whatever the command's
own environment said, and each component's log starts by naming it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from ipnext.client.devstack.stack import RAY_START_ATTEMPTS, DevStack, process_alive
from ipnext.errors import StackError
from ipnext.spec.settings import load_settings


@pytest.fixture
def elsewhere(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No IPNEXT_* or address variables; the current folder is an empty one, not the repo."""
    for name in list(os.environ):
        if name.startswith("IPNEXT_") or name in ("TEMPORAL_ADDRESS", "RAY_ADDRESS"):
            monkeypatch.delenv(name, raising=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def _config(folder: Path) -> Path:
    folder.mkdir(parents=True)
    path = folder / "ipnext.yaml"
    path.write_text(yaml.safe_dump({"state_dir": "state", "serve": {"port": 8123}}))
    return path


def test_a_relative_config_is_handed_on_absolute_with_its_state_beside_it(
    elsewhere: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _config(tmp_path / "conf")
    relative = Path("../conf/ipnext.yaml")
    # A command's own environment naming another file does not leak into what it starts.
    monkeypatch.setenv("IPNEXT_CONFIG", str(tmp_path / "other.yaml"))
    for stack in (DevStack(config_path=relative), DevStack(load_settings(relative))):
        assert stack.config_path == path.resolve()
        assert stack._env("id")["IPNEXT_CONFIG"] == str(path.resolve())
        assert stack.state_dir == (tmp_path / "conf" / "state").resolve()  # beside the file, not cwd
        assert f"config {path.resolve()}" in stack.settings.describe_source()


def test_settings_from_no_file_hand_on_no_file(elsewhere: Path) -> None:
    stack = DevStack(load_settings())
    assert stack.config_path is None and "IPNEXT_CONFIG" not in stack._env("id")
    assert "no config file" in stack.settings.describe_source()


def test_each_component_log_starts_with_the_config_it_was_started_with(
    elsewhere: Path, tmp_path: Path
) -> None:
    path = _config(tmp_path / "conf")
    stack = DevStack(config_path=Path("../conf/ipnext.yaml"))
    (stack.state_dir / "logs").mkdir(parents=True)
    record: dict[str, object] = {"stack_id": "id", "processes": {}}
    argv = [sys.executable, "-c", "import os; print('child reads', os.environ['IPNEXT_CONFIG'])"]
    proc = stack._spawn("worker", argv, stack._env("id"), record)
    proc.wait(timeout=30)
    assert not process_alive(proc.pid)
    first, second = (stack.state_dir / "logs" / "worker.log").read_text().splitlines()[:2]
    assert first.startswith("--- ") and f"starts worker with config {path.resolve()}:" in first, first
    assert second == f"child reads {path.resolve()}", second


def test_the_node_layout_reaches_every_process_and_per_region_needs_a_cluster_of_its_own(
    elsewhere: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--nodes per-region` is handed on (IPNEXT_RAY__NODES: the head starts no region, the
    writer puts a proxy on every node); it refuses an existing cluster before starting anything."""
    path = _config(tmp_path / "conf")
    stack = DevStack(config_path=path)
    assert stack.settings.proxy_location == "HeadOnly"
    env = stack._env("s1", "per-region")
    monkeypatch.setenv("IPNEXT_RAY__NODES", env["IPNEXT_RAY__NODES"])
    assert load_settings(env["IPNEXT_CONFIG"]).proxy_location == "EveryNode"
    monkeypatch.delenv("IPNEXT_RAY__NODES")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with pytest.raises(StackError, match="per-region starts a Ray cluster of its own") as raised:
        DevStack(config_path=path).up(nodes="per-region")
    assert raised.value.field == "nodes"
    assert not (tmp_path / "conf" / "state" / "dev.json").exists()
    with pytest.raises(StackError, match="not a layout"):
        DevStack(config_path=path).up(nodes="per-zone")


def test_free_port_never_hands_the_same_port_twice_in_a_process() -> None:
    """A region node's port flags are drawn before any is bound: two draws must differ, or Ray
    refuses the node ("trying to use a port number ... used by other components")."""
    from ipnext.client.devstack.stack import free_port

    ports = [free_port() for _ in range(400)]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= p < 32000 for p in ports)


@pytest.mark.parametrize("failure", ["startup timed out", "another failure"])
def test_rays_head_starts_again_only_when_rays_own_startup_timed_out(
    elsewhere: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """Ray's raylet gets a fixed 30 s to register; on a busy machine ray.init gives up: the head
    is started again (what the attempt left killed first), up to RAY_START_ATTEMPTS in all. Any
    other failure is raised at once."""
    stack = DevStack(config_path=_config(tmp_path / "conf"))
    spawned, cleaned = [], []
    head = type("Head", (), {"pid": 4242})()
    monkeypatch.setattr(stack, "_spawn", lambda name, argv, env, record: spawned.append(name) or head)
    monkeypatch.setattr(stack, "_kill_ray_leftovers", lambda record: cleaned.append(True))
    said = (
        "Exception: The current node timed out during startup." if failure == "startup timed out" else "boom"
    )

    def wait(name: str, proc: object, ready: object, record: object) -> None:
        if len(spawned) < RAY_START_ATTEMPTS:
            raise StackError(f"ray exited with code 1 while starting. Log tail:\n{said}")
        stack.settings.ray_address_file.parent.mkdir(parents=True, exist_ok=True)
        stack.settings.ray_address_file.write_text("127.0.0.1:1")  # what a head that came up writes

    monkeypatch.setattr(stack, "_wait", wait)
    record = {"stack_id": "id", "processes": {}}
    if failure == "startup timed out":
        stack._start_ray({}, record)
        assert spawned == ["ray"] * RAY_START_ATTEMPTS and len(cleaned) == RAY_START_ATTEMPTS - 1
    else:
        with pytest.raises(StackError, match="boom"):
            stack._start_ray({}, record)
        assert spawned == ["ray"] and cleaned == []
