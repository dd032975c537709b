"""Process-wide context of activities: the worker's settings, its Ray connection, and the
heartbeat of activities whose single Ray calls can outlast the heartbeat timeout."""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from temporalio import activity

from ipnext.config import Settings, load_settings

__all__ = ["HEARTBEAT_EVERY_S", "heartbeat_throughout", "settings", "writer"]

# Well inside the workflows' heartbeat timeout (30 s): a beat lost to a busy machine is not a miss.
HEARTBEAT_EVERY_S = 5.0

F = TypeVar("F", bound=Callable[..., Any])


@functools.cache
def settings() -> Settings:
    return load_settings()


def writer() -> object:
    """The Serve config writer actor, connecting this process to Ray on first use."""
    from ipnext.serving.control import connect_for, writer_for

    current = settings()
    connect_for(current)
    return writer_for(current)


def heartbeat_throughout(fn: F) -> F:
    """Heartbeat every HEARTBEAT_EVERY_S from a helper thread while the (sync) activity runs.

    A Serve activity's first call on a Ray cluster just restarted (the writer's `apply`, which
    starts Serve's controller and proxies) blocks longer than the heartbeat timeout on a loaded
    machine, though nothing is wrong: the attempt was timed out and tried again, three times for
    a serving check, which then counted as one that could not run (CI, stop 54). Each of those
    calls has its own timeout (`ray.get(timeout=...)`, `wait_apps_running`'s), so a hung one
    still ends its attempt, and a worker that dies takes this thread with it: the heartbeat
    timeout still finds a lost worker."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        context = contextvars.copy_context()  # the activity's: `activity.heartbeat` reads it
        done = threading.Event()

        def beat() -> None:
            while not done.wait(HEARTBEAT_EVERY_S):
                try:
                    context.run(activity.heartbeat, "working")
                except Exception:  # the worker shutting down: the attempt ends with it
                    return

        beater = threading.Thread(target=beat, name=f"heartbeat-{fn.__name__}", daemon=True)
        beater.start()
        try:
            return fn(*args, **kwargs)
        finally:
            done.set()
            beater.join()

    return run  # type: ignore[return-value]
