"""Test-run wiring shared by every folder: `make test` runs two pytest-xdist workers and hands
them tests one at a time, in collection order, to whichever is free (`--dist load
--maxschedchunk 1`: the drills take 10 s to several minutes each, so a fixed share per worker
would leave one idle while the other runs the long ones).

Each worker builds its own session fixtures the first time one of its tests needs them: its own
dev stack (tests/integration/conftest.py; two stacks on one machine, on ports and in state
folders of their own), its own Temporal test server, its own trained LLM. Two stacks side by
side cost a stack's start (about 20 s) and its idle CPU, and buy the overlap of one stack's
timers and bakes with the other's. (Earlier this file asked xdist to keep each folder on one
worker with `xdist_group` marks; xdist 3.8 sets that group on a node-id attribute pytest 9 no
longer reads, so the marks never grouped anything, and two stacks is what the suite has always
measured.)"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Drills that restart their worker's dev stack run after every other test: a worker takes
    # them only once nothing else is left to hand out.
    items.sort(key=lambda item: item.get_closest_marker("destructive") is not None)
