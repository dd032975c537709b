"""Group commit: changes asked for by many threads at once, committed together.

The Serve config writer (control.py) turns every change into an apply of the whole config, and
Serve's controller diffs every app of it: one apply per change makes a burst of N changes (two
hundred pooled models published at once) cost N whole-config applies. Here a change waits in a
queue; a caller that finds no commit running commits everything queued so far, its own change
included, and the callers that queued meanwhile are answered by that commit or commit the next
batch themselves. Nothing waits for a timer: a lone change is committed at once, and while one
commit runs (an apply takes most of a second), every change that arrives joins the next one. So
a tick of the control plane is one commit, however many changes it carries.

What a commit does with its batch is the owner's (`commit` below): it answers every change, and
when a batch fails it is the owner's to try its changes one by one, so that a bad change fails
alone. Should `commit` raise, every change of the batch left unanswered gets that error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

__all__ = ["Change", "GroupCommit"]


@dataclass(eq=False)
class Change:
    """One caller's change, and what its commit answered: `answer` or `error`."""

    payload: Any
    answer: Any = None
    error: BaseException | None = None
    done: bool = field(default=False, init=False)

    def finish(self, answer: Any = None) -> None:
        self.answer, self.done = answer, True

    def fail(self, error: BaseException) -> None:
        self.error, self.done = error, True


C = TypeVar("C", bound=Change)


class GroupCommit(Generic[C]):
    """Commits queued changes in batches, one batch at a time (`commit` never runs twice at
    once), each by the first caller of it that found no commit running. `commits` and `changes`
    count what was committed, for the bench and the status of the writer."""

    def __init__(self, commit: Callable[[list[C]], None]) -> None:
        self._commit = commit
        self._cond = threading.Condition()
        self._queue: list[C] = []
        self._running = False
        self.commits = 0
        self.changes = 0
        self.largest = 0

    def submit(self, change: C) -> Any:
        """Queue `change`, wait for the commit that carries it and return its answer (or raise
        its error)."""
        with self._cond:
            self._queue.append(change)
            while not change.done and self._running:
                self._cond.wait()
            if change.done:
                return _outcome(change)
            batch, self._queue, self._running = self._queue, [], True
        try:
            self._commit(batch)
        except BaseException as err:  # handed to every caller left unanswered
            for each in batch:
                if not each.done:
                    each.fail(err)
        finally:
            with self._cond:
                self._running = False
                self.commits += 1
                self.changes += len(batch)
                self.largest = max(self.largest, len(batch))
                for each in batch:
                    if not each.done:  # `commit` forgot it: never leave a caller waiting
                        each.fail(RuntimeError("the commit did not answer this change"))
                self._cond.notify_all()
        return _outcome(change)

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"commits": self.commits, "changes": self.changes, "largest_batch": self.largest}


def _outcome(change: Change) -> Any:
    if change.error is not None:
        raise change.error
    return change.answer
