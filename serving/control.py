"""Driving Ray Serve from the worker: the one Serve config writer and health waits.

Serve replaces the whole multi-app config on every apply, so two writers would erase
each other's apps. All changes go through one detached actor, `ipnext-serve-writer`
(`config_writer.py`), made or found here by `get_writer`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from ipnext.contracts.fleet import region_resource
from ipnext.errors import ServingError
from ipnext.names import PollTimeoutError, wait_until
from ipnext.serving.config_writer import ServeConfigWriter
from ipnext.serving.layout import (
    RAY_NAMESPACE,
    ROUTER_DEPLOYMENT,
    WRITER_ACTOR,
    head_node_options,
    is_set_app_of,
)
from ipnext.serving.pool_layout import pool_router_app_name
from ipnext.spec.settings import Settings
from ipnext.store.ray_token import LOOPBACK_ENV, is_loopback, use_ray_auth

__all__ = [
    "STATUS_TICK_S",
    "ServeConfigWriter",
    "connect",
    "connect_for",
    "existing_writer",
    "forbid_implicit_init",
    "get_writer",
    "live_regions",
    "serve_applications",
    "wait_apps_gone",
    "wait_apps_running",
    "wait_pooled_router_generation",
    "wait_router_generation",
    "wait_served",
    "writer_for",
]


class _StatusReads:
    """`serve.status().applications`, read one call at a time in this process and shared.

    One at a time: with autoscaled deployments Serve's status pickles their policy module by
    value, registering and unregistering it around the call, and two threads in it at once make
    one raise ("is not registered for pickle by value"). Shared: a caller is answered by a read
    that began after it asked, so every thread waiting while one read runs takes the next read,
    not one each; a caller that accepts `max_age_s` takes a read that old. So the serving checks
    and waits of many models in one worker cost one status read per tick, not one per model
    (`reads` counts them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value: dict[str, Any] | None = None
        self._began = float("-inf")  # when the read that gave `_value` began (monotonic)
        self.reads = 0

    def get(self, max_age_s: float) -> dict[str, Any]:
        from ray import serve

        asked = time.monotonic()
        with self._lock:
            if self._value is None or self._began < asked - max(0.0, max_age_s):
                began = time.monotonic()
                self._value = dict(serve.status().applications)
                self._began = began
                self.reads += 1
            return dict(self._value)

    def forget(self) -> None:
        """Drop the shared read (the cluster changed: a read of the old one says nothing)."""
        with self._lock:
            self._value, self._began = None, float("-inf")


STATUS_READS = _StatusReads()
# How old a shared status read the periodic serving checks accept: one read per second serves
# every model's check in the worker (activities/reconcile.py confirms a repair on a fresh read).
STATUS_TICK_S = 1.0


def serve_applications(max_age_s: float = 0.0) -> dict[str, Any]:
    """Serve's applications by name (`serve.status().applications`), from a read that began
    after this call, or at most `max_age_s` before it; every status read of ipnext goes through
    here (`_StatusReads`)."""
    return STATUS_READS.get(max_age_s)


def live_regions() -> set[str]:
    """The regions with at least one live Ray node (by the `region:` resource every node of a
    region carries). Ray lists a dead node without its resources, so only live ones count."""
    prefix = region_resource("")
    return {
        key[len(prefix) :]
        for node in ray.nodes()
        if node.get("Alive")
        for key in (node.get("Resources") or {})
        if key.startswith(prefix)
    }


_connected: str | None = None  # the cluster address this process attached to
_connect_lock = threading.Lock()


def connect(address: str) -> None:
    """Attach this process to the Ray cluster at `address`, once. A process still attached to
    another address (the dev stack's Ray head restarted: it comes back at a new one) detaches
    first, so the worker follows a restarted cluster instead of calling a dead one; Serve's
    cached controller handle is dropped with it. A cluster restarted at the same address is not
    detected here (the calls fail and their activities retry).

    Ray's implicit `ray.init()` is switched off first (`forbid_implicit_init`): between the
    shutdown and the new init, a Serve handle's metrics thread in this process calls `ray.wait`,
    and the implicit init would start a whole local Ray instance inside the worker and leave its
    driver wedged (CI, stop 27: every serving check after a Ray restart timed out)."""
    global _connected
    forbid_implicit_init()
    with _connect_lock:
        if ray.is_initialized():
            if _connected is None or _connected == address:
                return
            ray.shutdown()
            # Serve caches its controller's handle per process, and a new session of the same
            # job id does not invalidate it: forget it, so the next Serve call finds the new one.
            from ray.serve.context import _set_global_client

            _set_global_client(None)
            STATUS_READS.forget()
        keep_loopback(address)  # a loopback cluster's drivers keep 127.0.0.1 (ipnext/store/ray_token.py)
        ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False)
        _connected = address


def keep_loopback(address: str) -> None:
    """In this process, before it connects to the cluster at `address`: keep 127.0.0.1 as the
    node address for a loopback cluster, Ray's own default for any other (a process may attach to
    one cluster, then another). A driver that did not would look for a raylet at the host's
    routable address, which a loopback cluster does not listen on, and hang (ray_token.py says
    why the dev stack's cluster is one). Ray read the variable when it was imported, so its
    constant is set too."""
    from ray._private import ray_constants

    if is_loopback(address):
        os.environ[LOOPBACK_ENV] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False
    else:
        os.environ.pop(LOOPBACK_ENV, None)
        ray_constants.ENABLE_RAY_CLUSTER = not ray_constants.IS_WINDOWS_OR_OSX


def forbid_implicit_init() -> None:
    """Make Ray's public calls (`ray.get`, `ray.wait`, `ray.put`, ...) raise in this process
    while it is not connected, instead of calling `ray.init()` with no address, which starts a
    new local cluster. An ipnext process connects only where its settings say (`connect`); a
    call made while it is not connected fails, and its caller (an activity) retries."""
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = False


def connect_for(settings: Settings) -> None:
    """`connect` to the settings' Ray cluster, with their token authentication in this process's
    environment first (Ray reads the token once per process, at its first connection)."""
    use_ray_auth(settings)
    if not ray.is_initialized():
        # Ray caches its auth mode the first time anything asks for it (an import of Serve may):
        # before connecting, read the environment again, as Ray does when it turns token mode on.
        from ray._raylet import Config  # type: ignore[attr-defined]

        Config.initialize("")
    connect(settings.ray_address())


def writer_for(settings: Settings) -> Any:
    """The one writer, as `get_writer` gives it, with the settings' API keys file on every HTTP
    door: a writer that some earlier caller created with another (or none) switches to it, so
    whoever comes first can never leave the routes open."""
    keys_file = settings.keys_file()
    writer = get_writer(settings.serve.host, settings.serve.port, settings.proxy_location, keys_file)
    ray.get(writer.use_keys_file.remote(str(keys_file) if keys_file is not None else None), timeout=120)
    return writer


# Threads of the writer actor: callers waiting for a commit each hold one (a caller beyond them
# waits in Ray's queue, then joins a later commit).
WRITER_CONCURRENCY = 64


def get_writer(host: str, port: int, proxy_location: str = "HeadOnly", keys_file: Path | None = None) -> Any:
    """The one writer, created if it is not there yet; pinned to the head node, so it outlives
    a lost region (a writer that comes back empty-handed would adopt, not lose, the apps).
    Processes that serve use `writer_for`, which also makes sure of its keys file."""
    return (
        ray.remote(ServeConfigWriter)
        .options(
            name=WRITER_ACTOR,
            namespace=RAY_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=-1,
            max_concurrency=WRITER_CONCURRENCY,
            **head_node_options(),
        )
        .remote(host, port, proxy_location, str(keys_file) if keys_file is not None else None)
    )


def existing_writer() -> Any | None:
    """The one writer if it runs (None: nobody has made it yet, or Ray lost it): for readers that
    must not start Serve by asking (`activities/pool_check.py`)."""
    try:
        return ray.get_actor(WRITER_ACTOR, namespace=RAY_NAMESPACE)
    except ValueError:
        return None


def _wait(check: Callable[[], str | None], timeout_s: float, interval_s: float) -> None:
    """Call `check` until it answers None (done); when it still answers after `timeout_s`,
    raise ServingError with its last answer, which says what is not done yet."""
    try:
        wait_until(check, lambda waiting: waiting is None, timeout_s=timeout_s, interval_s=interval_s)
    except PollTimeoutError as err:
        raise ServingError(str(err.last)) from None


def wait_apps_running(
    names: list[str], timeout_s: float, heartbeat: Callable[[str], None] = lambda _: None
) -> None:
    """Block until every named app is RUNNING; a failed deploy raises with Serve's message."""

    def check() -> str | None:
        apps = serve_applications()
        raise_if_failed(names, apps)
        pending = []
        for name in names:
            app = apps.get(name)
            status = str(app.status) if app else "MISSING"
            if not status.endswith("RUNNING"):
                pending.append(f"{name}={status.rsplit('.', 1)[-1]}")
        if not pending:
            return None
        heartbeat(", ".join(pending))
        return f"Serve apps not running after {timeout_s:.0f}s: {', '.join(pending)}"

    _wait(check, timeout_s, 0.5)


def raise_if_failed(names: list[str], apps: dict[str, Any] | None = None) -> None:
    """Raise ServingError with Serve's message if a named app failed to deploy or is unhealthy."""
    if apps is None:
        apps = serve_applications()
    for name in names:
        app = apps.get(name)
        status = str(app.status) if app else "MISSING"
        if status.endswith("DEPLOY_FAILED") or status.endswith("UNHEALTHY"):
            raise ServingError(f"Serve app {name} is {status}: {app.message if app else ''}")


def wait_generation(app: str, current: Callable[[], int], generation: int, timeout_s: float) -> None:
    """Block until `current()` (what the app's one replica applied) reaches `generation`.

    An app that already runs takes a new generation by `reconfigure`, in place: asking the
    replica is enough, and much quicker than waiting for Serve's status to settle (about 1 s
    a step). Serve's status is still read once a second, only to fail fast with its message
    when the update failed. Apps with several replicas must not use this (one answers)."""
    last_status = time.monotonic()

    def check() -> str | None:
        nonlocal last_status
        if time.monotonic() - last_status >= 1.0:
            raise_if_failed([app])
            last_status = time.monotonic()
        applied = current()
        return f"{app} still at generation {applied} < {generation}" if applied < generation else None

    _wait(check, timeout_s, 0.05)


def wait_served(
    writer: Any, names: list[str], timeout_s: float, heartbeat: Callable[[str], None] = lambda _: None
) -> None:
    """Block until every named app serves: a dedicated app RUNNING in Serve; a pooled model's
    set (a placeholder the writer folds into pools) once its pool router and pools run, the
    pool router holds it and a pool replica's catalogue has each of its parts. The pools'
    replicas all took the new catalogue once their apps are RUNNING again."""
    pooled: dict[str, list[str]] = ray.get(writer.pooled.remote(names), timeout=120)
    dedicated = [name for name in names if name not in pooled]
    serving = sorted({app for apps in pooled.values() for app in apps})
    wait_apps_running(dedicated + serving, timeout_s, heartbeat)
    if not pooled:
        return
    from ray import serve

    by_router: dict[str, list[str]] = {}
    for name, apps in pooled.items():
        if is_set_app_of(name, name.split(".", 1)[0]):  # a router's routing is waited for by generation
            by_router.setdefault(apps[0], []).append(name)

    def check() -> str | None:
        waiting: list[str] = []
        for router, sets in sorted(by_router.items()):
            handle = serve.get_deployment_handle(ROUTER_DEPLOYMENT, app_name=router)
            waiting += handle.pending.remote(sorted(sets)).result(timeout_s=timeout_s)
        if waiting:
            heartbeat("; ".join(waiting))
        return "; ".join(waiting) or None

    _wait(check, timeout_s, 0.2)
    wait_apps_running(serving, timeout_s, heartbeat)


def wait_pooled_router_generation(model: str, region: str, generation: int, timeout_s: float) -> None:
    """Block until every replica of the region's pool router applied `model`'s routing at
    `generation` (as `wait_router_generation` does for a model's own router)."""
    from ray import serve

    app = pool_router_app_name(region)
    handle = serve.get_deployment_handle(ROUTER_DEPLOYMENT, app_name=app)

    def current() -> int:
        applied: int = handle.generation.remote(model).result(timeout_s=timeout_s)
        return applied

    wait_generation(app, current, generation, timeout_s)
    wait_apps_running([app], timeout_s)


def wait_apps_gone(names: list[str], timeout_s: float) -> None:
    """Block until Serve no longer lists any of the named apps."""

    def check() -> str | None:
        left = sorted(set(names) & set(serve_applications()))
        return f"Serve apps still present after {timeout_s:.0f}s: {left}" if left else None

    _wait(check, timeout_s, 0.5)


def wait_router_generation(app: str, generation: int, timeout_s: float) -> None:
    """Block until every replica of the router of `app` has applied `generation`: one replica
    answers it, then the app is RUNNING (a router scales to several replicas, and Serve holds
    the app DEPLOYING until each of them ran the reconfigure that one already ran)."""
    from ray import serve

    handle = serve.get_deployment_handle(ROUTER_DEPLOYMENT, app_name=app)

    def current() -> int:
        applied: int = handle.generation.remote().result(timeout_s=timeout_s)
        return applied

    wait_generation(app, current, generation, timeout_s)
    wait_apps_running([app], timeout_s)
