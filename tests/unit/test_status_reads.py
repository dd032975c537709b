"""Serve's status is read one call at a time per process and shared (`serving.control._StatusReads`):
threads that ask while a read runs take the next read, not one each; a caller that accepts an
age takes a read that old; no caller is answered by a read that began before it asked, unless it
accepted that age. `serve.status` is replaced by a counting double (the seam)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from ipnext.names import wait_until
from ipnext.serving import control


class SlowStatus:
    """`serve.status()` that holds each read until released, counting them."""

    def __init__(self) -> None:
        self.reads = 0
        self.release = threading.Event()
        self.entered = threading.Event()

    def __call__(self) -> Any:
        self.reads += 1
        self.entered.set()
        assert self.release.wait(30), "the test never released the read"
        return SimpleNamespace(applications={"app": f"read {self.reads}"})


class CountingLock:
    """The reads' lock, counting the threads that came to it (each had asked by then)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._guard = threading.Lock()
        self.arrived = 0

    def __enter__(self) -> None:
        with self._guard:
            self.arrived += 1
        self._lock.acquire()

    def __exit__(self, *_: object) -> None:
        self._lock.release()


@pytest.fixture
def status(monkeypatch: pytest.MonkeyPatch) -> SlowStatus:
    from ray import serve

    double = SlowStatus()
    monkeypatch.setattr(serve, "status", double)
    monkeypatch.setattr(control, "STATUS_READS", control._StatusReads())
    return double


def test_threads_waiting_on_a_read_share_the_next_one(status: SlowStatus) -> None:
    lock = CountingLock()
    control.STATUS_READS._lock = lock  # type: ignore[assignment]
    answers: list[dict[str, Any]] = []
    first = threading.Thread(target=lambda: answers.append(control.serve_applications()))
    first.start()
    assert status.entered.wait(30)
    # Eight threads ask while the first read runs: it began before they asked, so it cannot
    # answer them; one read after it answers all eight.
    waiting = [
        threading.Thread(target=lambda: answers.append(control.serve_applications())) for _ in range(8)
    ]
    for thread in waiting:
        thread.start()
    wait_until(lambda: lock.arrived, lambda n: n == 9, timeout_s=30, interval_s=0.01)
    status.release.set()
    for thread in [first, *waiting]:
        thread.join(30)
    assert answers == [{"app": "read 1"}] + [{"app": "read 2"}] * 8, answers
    assert status.reads == 2 and control.STATUS_READS.reads == 2


def test_an_accepted_age_takes_the_last_read_and_none_is_answered_by_an_older_one(status: SlowStatus) -> None:
    status.release.set()
    assert control.serve_applications() == {"app": "read 1"}
    assert control.serve_applications(max_age_s=60.0) == {"app": "read 1"}
    assert status.reads == 1
    assert control.serve_applications() == {"app": "read 2"}  # no age accepted: a read of its own
    time.sleep(0.05)
    assert control.serve_applications(max_age_s=0.01) == {"app": "read 3"}  # older than accepted
    control.STATUS_READS.forget()  # the cluster changed
    assert control.serve_applications(max_age_s=60.0) == {"app": "read 4"}


def test_a_caller_cannot_change_the_shared_read(status: SlowStatus) -> None:
    status.release.set()
    mine = control.serve_applications()
    mine.pop("app")
    assert control.serve_applications(max_age_s=60.0) == {"app": "read 1"}
