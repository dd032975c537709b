"""What Serve's status of an app means for the one who repairs it: Serve will start its replicas
again on its own (a replica crashed or failed its health check: Serve replaces it), or Serve
has given up on the app's current version and will start nothing until a new version is
deployed.

Serve gives up on a deployment's version after `3 x target replicas` start failures in a row
(Serve's `MAX_PER_REPLICA_RETRY_COUNT`), but only while no replica of that version ever
started. A router that ipnext re-applied while its region's node was dead is such a version:
its replicas cannot start until the node comes back, and a start that fails then (scheduled
onto the node in the seconds before Ray declared it dead, or killed by an overloaded node's
first moments) counts. With one router replica, three were enough, and the router stayed
UNHEALTHY after its region returned, with nothing left that would deploy it again. Serve's
status says so: the deployment's trigger is REPLICA_STARTUP_FAILED and none of its replicas
runs. Pure: it reads the status objects Serve's `serve.status()` returns, by attribute."""

from __future__ import annotations

from typing import Any

__all__ = ["given_up", "status_word"]

STARTUP_FAILED = "REPLICA_STARTUP_FAILED"


def status_word(value: Any) -> str:
    """An enum of Serve's status (`ApplicationStatus.RUNNING`, a str enum) as its plain word."""
    word = getattr(value, "value", value)
    return str(word).rsplit(".", 1)[-1]


def given_up(app: Any) -> str | None:
    """Why Serve will start none of `app`'s replicas again until a new version is deployed
    (its deployments that failed to start, with Serve's message), or None when Serve is still
    trying or the app serves."""
    failed = []
    for name, deployment in sorted((getattr(app, "deployments", None) or {}).items()):
        running = sum(
            n for state, n in (deployment.replica_states or {}).items() if status_word(state) == "RUNNING"
        )
        if status_word(deployment.status_trigger) == STARTUP_FAILED and running == 0:
            message = " ".join((deployment.message or "").split())[:300]
            failed.append(f"{name} ({status_word(deployment.status)}: {message})")
    if not failed:
        return None
    return f"Serve gave up starting {'; '.join(failed)}"
