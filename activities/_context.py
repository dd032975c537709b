"""Process-wide context of activities: the worker's settings, its Ray connection, and the
heartbeat of activities whose single Ray calls can outlast the heartbeat timeout."""

from __future__ import annotations

import contextvars
import functools
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from temporalio import activity

from ipnext.spec.settings import Settings, load_settings

__all__ = [
    "HEARTBEAT_EVERY_S",
    "HEARTBEAT_LIMIT_S",
    "cluster_address",
    "heartbeat_throughout",
    "settings",
    "writer",
]

# Well inside the workflows' heartbeat timeout (30 s): a beat lost to a busy machine is not a miss.
HEARTBEAT_EVERY_S = 5.0
# How long the helper heartbeats for one attempt at most: past the longest single bounded Ray call
# (`ray.get(timeout=120)`) with room. A call blocked longer is hung, not slow; with the beats
# stopped, the heartbeat timeout ends the attempt and Temporal tries again (a call that reports
# its own progress, as `wait_apps_running` does, goes on beating from the activity's thread).
HEARTBEAT_LIMIT_S = 180.0

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
    calls has its own timeout (`ray.get(timeout=...)`, `wait_apps_running`'s), and a worker that
    dies takes this thread with it: the heartbeat timeout still finds a lost worker.

    Not every Ray call is bounded: one made while the cluster went away (`serve.status()`, a GCS
    call) waits for the GCS as long as the process's reconnect patience. So the beats stop, and
    the heartbeat timeout ends the attempt, when the Ray cluster the attempt began on is no longer
    the stack's (its address changed: the head was started again; the retry connects to the new
    one), or after HEARTBEAT_LIMIT_S in any case. Beating on regardless held a serving check on a
    dead cluster to its 5-minute start-to-close timeout (a fresh clone's restart drill)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        context = contextvars.copy_context()  # the activity's: `activity.heartbeat` reads it
        done = threading.Event()
        began_on = cluster_address()

        def beat() -> None:
            began = time.monotonic()
            while not done.wait(HEARTBEAT_EVERY_S):
                now_on = cluster_address()
                if began_on is not None and now_on is not None and now_on != began_on:
                    why = f"the Ray cluster moved from {began_on} to {now_on} during it"
                elif time.monotonic() - began > HEARTBEAT_LIMIT_S:
                    why = f"it has blocked for over {HEARTBEAT_LIMIT_S:.0f}s"
                else:
                    why = ""
                if why:
                    context.run(
                        activity.logger.warning,
                        "%s: no more heartbeats, %s: the attempt times out and is tried again",
                        fn.__name__,
                        why,
                    )
                    return
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


def cluster_address() -> str | None:
    """The Ray cluster this worker's settings name now (the dev stack's address file is rewritten
    when its head starts again); None while there is none."""
    try:
        return settings().ray_address()
    except Exception:  # no stack, or its file mid-rewrite: no evidence of a move
        return None
