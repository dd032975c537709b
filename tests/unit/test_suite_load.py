"""The suite's load record counts live stack processes by the id in their environment, per
stack, and keeps each peak with the moment it was seen."""

from __future__ import annotations

import os
import subprocess
import sys

from ipnext.client.devstack.stack import STACK_ID_ENV
from tests.suite_load import LoadRecord, UnitTimeline, live_stacks


def test_live_stacks_counts_the_processes_that_carry_a_stack_id() -> None:
    sleeper = [sys.executable, "-c", "import sys; sys.stdin.read()"]
    procs = [
        subprocess.Popen(sleeper, stdin=subprocess.PIPE, env={**os.environ, STACK_ID_ENV: stack})
        for stack in ("suite-load-a", "suite-load-a", "suite-load-b")
    ]
    try:
        counts = live_stacks()
        assert counts.get("suite-load-a") == 2 and counts.get("suite-load-b") == 1, counts
    finally:
        for proc in procs:
            proc.communicate(b"")  # stdin closed: each ends
    after = live_stacks()
    assert "suite-load-a" not in after and "suite-load-b" not in after, after


def test_the_record_keeps_each_peak_and_the_stacks_seen_then() -> None:
    record = LoadRecord()
    record.sample(3.0, {"a": 40})
    record.sample(9.5, {"a": 10, "b": 12})
    record.sample(1.0, {"a": 70})
    assert record.load.value == 9.5 and record.load.detail == "a: 10, b: 12"
    assert record.processes.value == 70 and record.processes.detail == "a: 70"
    assert record.stacks.value == 2
    lines = record.lines()
    assert lines[1].startswith("peak load average (1 min): 9.5") and "peak stacks at once: 2" in lines[3]


def test_the_timeline_puts_each_unit_on_its_worker_and_sums_the_short_ones() -> None:
    timeline = UnitTimeline()
    timeline.add("integration", "gw0", 1000.0, 1010.0, test_done=False)  # a setup
    timeline.add("integration", "gw0", 1010.0, 1600.0, test_done=True)
    timeline.add("tests/unit/test_a.py", "gw1", 1000.0, 1005.0, test_done=True)
    timeline.add("tests/unit/test_b.py", "gw1", 1005.0, 1012.0, test_done=True)
    timeline.add("integration-b", "gw1", 1012.0, 1900.0, test_done=True)
    lines = timeline.lines()
    assert lines[0] == "gw0: ends at 10.0 min, busy 10.0 min in 1 units"
    assert lines[1] == "    0.0- 10.0 min integration (1 tests)"
    assert lines[2].startswith("gw1: ends at 15.0 min, busy 15.0 min in 3 units")
    assert lines[3] == "    0.2- 15.0 min integration-b (1 tests)"
    assert lines[4] == "  and 2 units under 30 s each, 12 s in all"
