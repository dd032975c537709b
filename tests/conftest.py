"""Test-run wiring shared by every folder: how `make test` shares its two pytest-xdist workers.

The suite is mostly drills on a real dev stack (Temporal, a Ray cluster with Serve, the worker),
and a stack is the costly thing on a 2-core machine: two stacks side by side, each running a
drill under load, starve each other (CI once failed 9 drills in a 40-minute run that way, gates
judging windows the machine had stalled and a workflow task missing Temporal's 2 s deadlock
limit). So the tests are handed out in work units (`GroupScheduling` below):

- every drill on the shared stack (tests/integration) is one unit, run on one worker, one stack;
- the Temporal test server's tests (tests/workflows) and the trained LLM's (tests/llm) are a unit
  each, so each session fixture starts once;
- every other test module is a unit of its own, handed to whichever worker is free;
- the drills that start a stack of their own (`OWN_STACK_MODULES`) come last, so they overlap
  the shared stack only once the other worker has nothing lighter left.

Drills marked `destructive` restart the shared stack, so they run after every other drill on it.
Units are handed out in collection order, which `pytest_collection_modifyitems` sets."""

from __future__ import annotations

from typing import Any

import pytest

# Modules under tests/integration whose drills start a dev stack of their own.
OWN_STACK_MODULES = ("test_demo.py", "test_config_elsewhere.py", "test_region_nodes.py")
# Folders whose tests share one costly session fixture, so they run as one unit.
SHARED_FIXTURE_FOLDERS = ("integration", "workflows", "llm")


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to, from its node id (`tests/<folder>/<module>::<name>`)."""
    module = nodeid.split("::", 1)[0]
    parts = module.split("/")
    folder = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
    if folder == "integration" and parts[-1] in OWN_STACK_MODULES:
        return f"own-stack:{module}"
    if folder in SHARED_FIXTURE_FOLDERS:
        return folder
    return module


def _rank(item: pytest.Item) -> tuple[int, bool]:
    unit = work_unit(item.nodeid)
    if unit == "integration":
        order = 0
    elif unit in SHARED_FIXTURE_FOLDERS:
        order = 1
    elif unit.startswith("own-stack:"):
        order = 3
    else:
        order = 2
    return order, item.get_closest_marker("destructive") is not None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The shared stack's drills first (the longest unit), then the other shared fixtures, then
    # everything else, the own-stack drills last; destructive drills after the rest of their unit.
    # The sort is stable, so collection order holds inside each rank.
    items.sort(key=_rank)


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
