"""The dev stack's supervisor: a process of its own that starts again a component of the stack
(the Temporal dev server, the Ray head, a region's Ray node, the worker) that died.

`ipnext dev up` starts it last and `ipnext dev down` stops it first, so it never fights a
shutdown. Every `CHECK_INTERVAL_S` it looks at the stack's record (`<state>/dev.json`); a
component whose process is gone is started again the way `dev up` started it (a Ray head that
died takes its leftover processes with it first; it comes back at a new address, which the
worker follows; a per-region stack's nodes come back with it, joined to the new head). A region's
node is started again only while the head is up and not held.
What it did is in `<state>/supervisor.json`, which `ipnext dev status` shows.

Bounded: a component that needs more than `RESTART_LIMIT` restarts in `RESTART_WINDOW_S` is
left down and marked `gave_up` (a crash loop is a bug to read in its log, not something to
spin on); after fixing it, `dev up` (which finds the stack not up) starts the whole stack
again, state kept, with a fresh budget. A component can be held
(`ipnext dev hold NAME`, and `DevStack.crash` in drills): a held component is not restarted
until it is released. A hung process (alive, not answering) is not detected here.

Faults: the supervisor dying leaves the stack as it is (unsupervised); `dev up` on a stack that
is up starts a new supervisor. A restart that fails is recorded with its error and counts
against the budget; the next check tries again.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ipnext.client.devstack.status_file import read_status, status_path

__all__ = [
    "CHECK_INTERVAL_S",
    "RESTART_LIMIT",
    "RESTART_WINDOW_S",
    "RestartBudget",
    "read_status",
    "status_path",
]

CHECK_INTERVAL_S = 1.0
RESTART_LIMIT = 5  # restarts of one component within RESTART_WINDOW_S; more: it is left down
RESTART_WINDOW_S = 600.0
RESTARTS_KEPT = 50  # the newest restarts kept in supervisor.json


@dataclass
class RestartBudget:
    """At most `limit` restarts per component in any `window_s`; pure, so it is unit-tested."""

    limit: int = RESTART_LIMIT
    window_s: float = RESTART_WINDOW_S
    _spent: dict[str, list[float]] = field(default_factory=dict)

    def allows(self, name: str, now: float) -> bool:
        recent = [t for t in self._spent.get(name, []) if now - t < self.window_s]
        self._spent[name] = recent
        return len(recent) < self.limit

    def spend(self, name: str, now: float) -> None:
        self._spent.setdefault(name, []).append(now)


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class Supervisor:
    def __init__(self, stack: Any, log: Callable[[str], None] = print) -> None:
        self.stack = stack  # an ipnext.client.devstack.stack.DevStack
        self.log = log
        self.budget = RestartBudget()
        stack_id = (stack.read_record() or {}).get("stack_id")
        earlier = read_status(stack.state_dir)
        same_stack = stack_id is not None and earlier.get("stack_id") == stack_id
        self.status: dict[str, Any] = {
            "pid": os.getpid(),
            "stack_id": stack_id,
            "started_at": _now_iso(),
            # A supervisor started again for the same stack keeps what the last one recorded.
            "restarts": earlier.get("restarts", []) if same_stack else [],
            "gave_up": {},
            # Passes over the stack since this supervisor started, and when the last one ended:
            # `dev status` shows a supervisor that stopped looking, and a caller can wait for
            # passes to learn that a dead component was seen and (held) left down.
            "passes": 0,
            "passed_at": None,
        }
        self.exits: dict[int, int] = {}  # pid of a child it started -> its exit status

    def run(self, stop: threading.Event) -> None:
        self._write()
        self.log(f"supervising the dev stack in {self.stack.state_dir} (pid {os.getpid()})")
        while not stop.is_set():
            if not self.check_once():
                self.log("the stack's record is gone (dev down): nothing left to supervise")
                return
            stop.wait(CHECK_INTERVAL_S)

    def check_once(self) -> bool:
        """One pass over the stack; False once there is no stack to supervise."""
        from ipnext.client.devstack.stack import component_names, process_alive

        self._reap()
        record = self.stack.read_record()
        if record is None:
            return False
        for name in component_names(record):
            record = self.stack.read_record() or record  # a restart of the head restarts the nodes too
            proc = record["processes"].get(name)
            if proc is None or process_alive(proc["pid"]) or self.stack.held(name):
                continue
            head = record["processes"].get("ray")
            if name.startswith("node-") and (
                self.stack.held("ray") or head is None or not process_alive(head["pid"])
            ):
                continue  # a node joins a head: it comes back with (or after) the head
            if name in self.status["gave_up"]:
                continue
            now = time.monotonic()
            if not self.budget.allows(name, now):
                self.status["gave_up"][name] = _now_iso()
                self.log(
                    f"{name} died again: {self.budget.limit} restarts in {self.budget.window_s:.0f}s, "
                    f"leaving it down; see {proc['log']}"
                )
                self._write()
                continue
            self.budget.spend(name, now)
            self._restart(name, proc["pid"], proc["log"])
        self.status["passes"] += 1
        self.status["passed_at"] = _now_iso()
        self._write()
        return True

    def _restart(self, name: str, pid: int, log: str) -> None:
        code = self.exits.pop(pid, None)
        why = f"pid {pid} exited with {code}" if code is not None else f"pid {pid} was gone"
        self.log(f"{name} died ({why}); starting it again")
        started = time.monotonic()
        entry: dict[str, Any] = {"component": name, "at": _now_iso(), "why": why}
        try:
            self.stack.start(name)
            entry.update(ok=True, took_s=round(time.monotonic() - started, 1))
            self.log(f"{name} back in {entry['took_s']}s")
        except Exception as err:  # a failed start is recorded and tried again next check
            entry.update(ok=False, took_s=round(time.monotonic() - started, 1), error=str(err)[:500])
            self.log(f"{name} did not start again: {err}; see {log}")
        self.status["restarts"] = [*self.status["restarts"], entry][-RESTARTS_KEPT:]
        self._write()

    def _reap(self) -> None:
        """Collect the exit status of components this process started (else they stay zombies)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.exits[pid] = os.waitstatus_to_exitcode(status)

    def _write(self) -> None:
        path = status_path(self.stack.state_dir)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.status, indent=2))
        tmp.replace(path)


def main() -> None:
    from ipnext.client.devstack.stack import DevStack

    config = os.environ.get("IPNEXT_CONFIG")
    stack = DevStack(config_path=Path(config) if config else None, log=lambda line: print(line, flush=True))
    # What it restarts gets the same file: DevStack hands IPNEXT_CONFIG on to each start.
    stack.log(f"ipnext supervisor: {stack.settings.describe_source()}")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        Supervisor(stack, log=stack.log).run(stop)


if __name__ == "__main__" and sys.argv[1:] == []:
    main()
