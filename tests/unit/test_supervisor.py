"""The dev stack supervisor's rules, on a stand-in stack with real processes: a dead component
is started again, a held one is not, a crash loop is left down once its budget is spent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from ipnext.client.devstack.status_file import read_status
from ipnext.client.devstack.supervisor import RestartBudget, Supervisor


def test_the_budget_counts_restarts_in_a_sliding_window() -> None:
    budget = RestartBudget(limit=2, window_s=10.0)
    assert budget.allows("worker", 0.0)
    budget.spend("worker", 0.0)
    budget.spend("worker", 4.0)
    assert not budget.allows("worker", 9.0)
    assert budget.allows("ray", 9.0)  # per component
    assert budget.allows("worker", 10.5)  # the first restart left the window


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


class _Stack:
    """What the supervisor uses of DevStack: its record, holds, and start."""

    def __init__(self, state_dir: Path, fail: bool = False) -> None:
        self.state_dir = state_dir
        self.fail = fail
        self.holds: set[str] = set()
        self.started: list[str] = []
        self.alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        self.processes: dict[str, dict[str, Any]] = {
            "temporal": {"pid": self.alive.pid, "log": "temporal.log"},
            "worker": {"pid": _dead_pid(), "log": "worker.log"},
        }

    def read_record(self) -> dict[str, Any] | None:
        return {"stack_id": "x", "processes": self.processes}

    def held(self, name: str) -> bool:
        return name in self.holds

    def start(self, name: str) -> None:
        self.started.append(name)
        if self.fail:
            raise RuntimeError(f"{name} exited with code 1 while starting")
        self.processes[name] = {"pid": self.alive.pid, "log": f"{name}.log"}


def test_a_dead_component_is_started_again_and_recorded(tmp_path: Path) -> None:
    stack = _Stack(tmp_path)
    try:
        supervisor = Supervisor(stack, log=lambda _: None)
        assert supervisor.check_once()
        assert stack.started == ["worker"]  # temporal is alive: left alone
        supervisor.check_once()
        assert stack.started == ["worker"]  # back: nothing more to do
    finally:
        stack.alive.kill()
    restarts = read_status(tmp_path)["restarts"]
    assert [(r["component"], r["ok"]) for r in restarts] == [("worker", True)]
    assert "was gone" in restarts[0]["why"] or "exited" in restarts[0]["why"]


def test_a_held_component_stays_down_until_released(tmp_path: Path) -> None:
    stack = _Stack(tmp_path)
    stack.holds.add("worker")
    try:
        supervisor = Supervisor(stack, log=lambda _: None)
        supervisor.check_once()
        assert stack.started == []
        assert read_status(tmp_path)["passes"] == 1  # the pass that left it down is on record
        stack.holds.clear()
        supervisor.check_once()
        assert stack.started == ["worker"]
    finally:
        stack.alive.kill()
    status = read_status(tmp_path)
    assert status["passes"] == 2 and status["passed_at"]


def test_a_crash_loop_is_left_down_once_its_budget_is_spent(tmp_path: Path) -> None:
    stack = _Stack(tmp_path, fail=True)
    try:
        supervisor = Supervisor(stack, log=lambda _: None)
        supervisor.budget = RestartBudget(limit=3, window_s=600.0)
        for _ in range(6):
            supervisor.check_once()
    finally:
        stack.alive.kill()
    assert stack.started == ["worker"] * 3
    status = read_status(tmp_path)
    assert "worker" in status["gave_up"]
    assert [r["ok"] for r in status["restarts"]] == [False] * 3
    assert "exited with code 1" in status["restarts"][0]["error"]


def test_no_record_means_nothing_to_supervise(tmp_path: Path) -> None:
    stack = _Stack(tmp_path)
    stack.alive.kill()
    stack.read_record = lambda: None  # type: ignore[method-assign]
    assert not Supervisor(stack, log=lambda _: None).check_once()


def test_a_regions_node_comes_back_only_while_its_head_is_up(tmp_path: Path) -> None:
    """A per-region stack: a dead node joins the head, so it waits for a dead or held head, and
    a head that comes back brings its nodes with it (they are not started twice)."""
    stack = _Stack(tmp_path)
    dead = _dead_pid()
    stack.processes.update(
        ray={"pid": dead, "log": "ray.log"}, **{"node-us-east": {"pid": dead, "log": "node.log"}}
    )
    stack.processes["worker"] = {"pid": stack.alive.pid, "log": "worker.log"}
    stack.holds.add("ray")
    try:
        supervisor = Supervisor(stack, log=lambda _: None)
        supervisor.check_once()
        assert stack.started == []  # the head is held: its node stays down with it
        stack.holds.clear()
        real_start = stack.start

        def start_with_nodes(name: str) -> None:  # DevStack.start("ray") restarts the nodes
            real_start(name)
            if name == "ray":
                real_start("node-us-east")

        stack.start = start_with_nodes  # type: ignore[method-assign]
        supervisor.check_once()
        assert stack.started == ["ray", "node-us-east"]  # once, with the head
        stack.processes["node-us-east"] = {"pid": _dead_pid(), "log": "node.log"}
        supervisor.check_once()
        assert stack.started == ["ray", "node-us-east", "node-us-east"]  # alone, the head being up
    finally:
        stack.alive.kill()


def test_the_components_run_in_start_order_with_the_regions_nodes_after_the_head() -> None:
    from ipnext.client.devstack.stack import component_names

    record = {"processes": {n: {} for n in ("worker", "node-eu-west", "ray", "temporal", "node-ap-south")}}
    assert component_names(record) == ["temporal", "ray", "node-ap-south", "node-eu-west", "worker"]
    assert component_names(None) == ["temporal", "ray", "worker"]


def test_release_removes_only_a_hold_listed_in_the_holds_folder(tmp_path: Path) -> None:
    """`ipnext dev release NAME` takes a component or a hold's listed name, never a path: `../x`
    and an absolute name are refused and nothing outside the folder is removed."""
    import pytest

    from ipnext.client.devstack.stack import DevStack
    from ipnext.errors import StackError
    from ipnext.spec.settings import Settings

    stack = DevStack(Settings(state_dir=tmp_path / "state"), log=lambda _: None)
    outside = tmp_path / "state" / "dev.json"
    outside.parent.mkdir(parents=True)
    outside.write_text("{}")
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    stack.hold("worker", why="test")
    (stack.holds_dir / "node-gone").write_text("{}")  # left by an earlier stack's node
    for name in ("../dev.json", "../../victim", str(victim), ".", "..", ""):
        with pytest.raises(StackError, match="can be released"):
            stack.release(name)
        assert not stack.held(name)
    assert outside.exists() and victim.read_text() == "keep me"
    stack.release("node-gone")
    stack.release("worker")
    assert stack.holds() == {}
