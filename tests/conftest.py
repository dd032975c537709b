"""Test-run wiring shared by every folder: `make test` runs two pytest-xdist workers, and each
folder whose tests share a costly session fixture (the dev stack, the Temporal dev server, the
trained LLM) stays on one worker, so that fixture starts once while the other worker runs the
rest. The suite mostly waits on timers and servers, so the second worker costs little."""

from __future__ import annotations

import pytest

_SHARED_SESSIONS = ("integration", "workflows", "llm")
# Integration tests that start a stack of their own (never the session's) form a group of their
# own: whichever worker is free takes it, so they run beside the shared stack's drills instead
# of after them (the other worker's unit tests end long before the shared stack's drills do).
_OWN_STACKS = "own-stacks"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = item.path.parent.name
        if item.get_closest_marker("own_stack") is not None:
            item.add_marker(pytest.mark.xdist_group(_OWN_STACKS))
        elif folder in _SHARED_SESSIONS:
            item.add_marker(pytest.mark.xdist_group(folder))
    # Drills that restart the shared dev stack run after every test that uses it.
    items.sort(key=lambda item: item.get_closest_marker("destructive") is not None)
