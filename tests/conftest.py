"""Test-run wiring shared by every folder: how `make test` shares its two pytest-xdist workers.

The suite is mostly drills on a real dev stack (Temporal, a Ray cluster with Serve, the worker),
and a stack is the costly thing on a 2-core machine: each worker that runs a drill starts a stack
of its own (tests/integration/conftest.py), and two stacks each under a drill's load slow each
other down. So the tests are handed out in work units (`GroupScheduling` below), in this order:

1. the shared stack's first half of the drills (`integration`), one unit: the worker that takes
   it first starts its stack at once and keeps it busy to the end; its destructive drills
   (`destructive`: they restart the stack) run after the rest of the unit;
2. the Temporal test server's tests (tests/workflows) and the trained LLM's (tests/llm), a unit
   each so each session fixture starts once;
3. every other test module, a unit of its own, handed to whichever worker is free;
4. the second half of the drills (`integration-b`, `SECOND_STACK_MODULES`), one unit: the other
   worker runs it on a stack of its own once the light tests are done;
5. the drills that start a stack of their own (`OWN_STACK_MODULES`), a unit each, the longest
   first: whichever worker is free first takes the 4-node region drill (CI run 15 handed it out
   last, and it ran its last 337 s alone on one worker while the other had nothing left).

A worker stops its stack as soon as its unit is done (tests/integration/conftest.py), so the
own-stack drills at the end run beside at most one other stack. (Handing the own-stack drills
out before the second half, so that they ran beside the first half's stack from the start,
overloaded this machine: CI run 16 had three failures in its first ten minutes.)

The halves are balanced by the drills' measured durations (a CI run's --durations), so the two
workers end at about the same time."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ipnext.spec.settings import Settings
from ipnext.store.ray_token import ensure_ray_token, use_ray_auth

from .suite_load import LoadSampler, UnitTimeline

# Ray's token authentication for every stack of the run (each makes its own cluster): one token
# file, because Ray reads the token once per process and a test process reaches several stacks.
# Set here, before any test module imports Ray; every process the tests start inherits it, and
# the stacks' settings read it (IPNEXT_RAY__TOKEN_FILE wins over their config files).
RAY_TOKEN_FILE = Path(__file__).resolve().parents[1] / ".ipnext" / "test-ray-token"
os.environ["IPNEXT_RAY__TOKEN_FILE"] = str(RAY_TOKEN_FILE)
ensure_ray_token(Settings())
use_ray_auth(Settings())

# Modules under tests/integration whose drills start a dev stack of their own.
OWN_STACK_MODULES = ("test_region_nodes.py", "test_demo.py", "test_config_elsewhere.py")  # longest first
# Modules under tests/integration that run on the second worker's stack.
SECOND_STACK_MODULES = (
    "test_replan.py",
    "test_variants.py",
    "test_llm.py",
    "test_load_step.py",
    "test_ranking.py",
    "test_experiments.py",
)
# The units that run on a shared dev stack (tests/integration/conftest.py `stack`): a worker
# stops its stack as soon as the unit is done.
STACK_UNITS = ("integration", "integration-b")
# Folders whose tests share one costly session fixture, so they run as one unit.
SHARED_FIXTURE_FOLDERS = ("integration", "workflows", "llm")


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to, from its node id (`tests/<folder>/<module>::<name>`)."""
    module = nodeid.split("::", 1)[0]
    parts = module.split("/")
    folder = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
    if folder == "integration" and parts[-1] in OWN_STACK_MODULES:
        return f"own-stack:{module}"
    if folder == "integration" and parts[-1] in SECOND_STACK_MODULES:
        return "integration-b"
    if folder in SHARED_FIXTURE_FOLDERS:
        return folder
    return module


def unit_order(unit: str) -> tuple[int, int]:
    """Where a unit stands in the hand-out order of the module's docstring (1 to 5), and among
    the own-stack drills, the place of its module in `OWN_STACK_MODULES`."""
    if unit == "integration":
        return 1, 0
    if unit in SHARED_FIXTURE_FOLDERS:
        return 2, 0
    if unit == "integration-b":
        return 4, 0
    if unit.startswith("own-stack:"):
        return 5, OWN_STACK_MODULES.index(unit.rsplit("/", 1)[-1])
    return 3, 0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Units in the docstring's order, destructive drills after the rest of their unit; the sort is
    # stable, so collection order holds inside each.
    items.sort(
        key=lambda item: (
            unit_order(work_unit(item.nodeid)),
            item.get_closest_marker("destructive") is not None,
        )
    )


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """xdist's scope scheduling with `work_unit` as the scope, handed out in collection
        order. (xdist's own `--dist loadgroup` does not group on pytest 9: it writes the group
        into a node-id attribute pytest no longer reads.)"""

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False
    return GroupScheduling(config, log)


_SAMPLER_KEY = pytest.StashKey[LoadSampler]()
_TIMELINE_KEY = pytest.StashKey[UnitTimeline]()


def pytest_configure(config: pytest.Config) -> None:
    # Only the process that runs the session samples: xdist's workers carry `workerinput`.
    if not hasattr(config, "workerinput"):
        config.stash[_SAMPLER_KEY] = LoadSampler().start()
        config.stash[_TIMELINE_KEY] = UnitTimeline()
        config.pluginmanager.register(_TimelinePlugin(config.stash[_TIMELINE_KEY]), "ipnext-unit-timeline")


class _TimelinePlugin:
    """Feeds the controller's test reports (each names the xdist worker that ran it) into the
    timeline printed at the end."""

    def __init__(self, timeline: UnitTimeline) -> None:
        self.timeline = timeline

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        node = getattr(report, "node", None)  # xdist's worker controller; absent without -n
        worker = node.gateway.id if node is not None else "main"
        self.timeline.add(work_unit(report.nodeid), worker, report.start, report.stop, report.when == "call")


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    sampler = config.stash.get(_SAMPLER_KEY, None)
    if sampler is None:
        return
    terminalreporter.section("machine load during the run")
    for line in sampler.stop().lines():
        terminalreporter.write_line(line)
    terminalreporter.section("work units by worker")
    for line in config.stash[_TIMELINE_KEY].lines():
        terminalreporter.write_line(line)
