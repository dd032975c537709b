"""Driving Ray Serve from the worker: the one Serve config writer and health waits.

Serve replaces the whole multi-app config on every apply, so two writers would erase
each other's apps. All changes go through one detached actor, `ipnext-serve-writer`,
whose methods run one at a time; it keeps the desired state of every app, renders
the whole declarative config and applies it.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import ray

from ipnext.errors import ServingError
from ipnext.serving.layout import (
    RAY_NAMESPACE,
    ROUTER_DEPLOYMENT,
    WRITER_ACTOR,
    render_serve_config,
)

__all__ = [
    "ServeConfigWriter",
    "connect",
    "get_writer",
    "wait_apps_gone",
    "wait_apps_running",
    "wait_router_generation",
]


class ServeConfigWriter:
    """Body of the detached writer actor. Sync methods: Ray runs them serially."""

    def __init__(self, host: str, port: int) -> None:
        self._host = host
        self._port = port
        self._apps: dict[str, dict[str, Any]] = {}
        self._applies = 0
        self._adopt_running_apps()

    def _client(self) -> Any:
        from ray import serve
        from ray.serve.context import _get_global_client

        serve.start(
            http_options={"host": self._host, "port": self._port},
            logging_config={"enable_access_log": False},
        )
        return _get_global_client()

    def _adopt_running_apps(self) -> None:
        # A restarted writer must not erase apps it did not know about.
        details = self._client().get_serve_details()
        for name, app in (details.get("applications") or {}).items():
            config = app.get("deployed_app_config")
            if config:
                self._apps[name] = config

    def apply(self, upserts: list[dict[str, Any]], removals: list[str]) -> int:
        from ray.serve.schema import ServeDeploySchema

        desired = copy.deepcopy(self._apps)
        for name in removals:
            desired.pop(name, None)
        for app in upserts:
            desired[app["name"]] = app
        if desired == self._apps and self._applies:
            return self._applies
        config = render_serve_config(desired, self._host, self._port)
        self._client().deploy_apps(ServeDeploySchema.model_validate(config))
        self._apps = desired
        self._applies += 1
        return self._applies

    def app(self, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self._apps.get(name))

    def app_names(self) -> list[str]:
        return sorted(self._apps)

    def export(self) -> dict[str, Any]:
        return render_serve_config(self._apps, self._host, self._port)


def connect(address: str) -> None:
    """Attach this process to the Ray cluster (once)."""
    if not ray.is_initialized():
        ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False)


def get_writer(host: str, port: int) -> Any:
    return (
        ray.remote(ServeConfigWriter)
        .options(
            name=WRITER_ACTOR,
            namespace=RAY_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_restarts=-1,
        )
        .remote(host, port)
    )


def wait_apps_running(
    names: list[str], timeout_s: float, heartbeat: Callable[[str], None] = lambda _: None
) -> None:
    """Block until every named app is RUNNING; a failed deploy raises with Serve's message."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        apps = serve.status().applications
        pending = []
        for name in names:
            app = apps.get(name)
            status = str(app.status) if app else "MISSING"
            if status.endswith("DEPLOY_FAILED") or status.endswith("UNHEALTHY"):
                raise ServingError(f"Serve app {name} is {status}: {app.message if app else ''}")
            if not status.endswith("RUNNING"):
                pending.append(f"{name}={status.rsplit('.', 1)[-1]}")
        if not pending:
            return
        heartbeat(", ".join(pending))
        if time.monotonic() > deadline:
            raise ServingError(f"Serve apps not running after {timeout_s:.0f}s: {', '.join(pending)}")
        time.sleep(0.5)


def wait_apps_gone(names: list[str], timeout_s: float) -> None:
    """Block until Serve no longer lists any of the named apps."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        left = sorted(set(names) & set(serve.status().applications))
        if not left:
            return
        if time.monotonic() > deadline:
            raise ServingError(f"Serve apps still present after {timeout_s:.0f}s: {left}")
        time.sleep(0.5)


def wait_router_generation(app: str, generation: int, timeout_s: float) -> None:
    """Block until the router of `app` has applied `generation` (its reconfigure ran)."""
    from ray import serve

    handle = serve.get_deployment_handle(ROUTER_DEPLOYMENT, app_name=app)
    deadline = time.monotonic() + timeout_s
    while True:
        current = handle.generation.remote().result(timeout_s=timeout_s)
        if current >= generation:
            return
        if time.monotonic() > deadline:
            raise ServingError(f"router {app} still at generation {current} < {generation}")
        time.sleep(0.2)
