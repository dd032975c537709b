"""Test-run wiring shared by every folder: `make test` runs two pytest-xdist workers, and each
folder whose tests share a costly session fixture (the dev stack, the Temporal dev server, the
trained LLM) stays on one worker, so that fixture starts once while the other worker runs the
rest. The suite mostly waits on timers and servers, so the second worker costs little."""

from __future__ import annotations

import pytest

_SHARED_SESSIONS = ("integration", "workflows", "llm")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = item.path.parent.name
        if folder in _SHARED_SESSIONS:
            item.add_marker(pytest.mark.xdist_group(folder))
    # Drills that restart the shared dev stack run after every test that uses it.
    items.sort(key=lambda item: item.get_closest_marker("destructive") is not None)
