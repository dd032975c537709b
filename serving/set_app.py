"""The set app Serve builds for one snapshot set in one region: a PartHost deployment per
(part, hardware) and the `set` ingress that describes the set to routers. `set_app` is the
builder the rendered Serve config imports by path (`layout.SET_IMPORT_PATH`)."""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request

from ipnext.serving.control import serve_applications
from ipnext.serving.export import CounterPusher, PartPrometheus
from ipnext.serving.layout import (
    SET_DEPLOYMENT,
    PartHostArgs,
    SetAppArgs,
    SetDescription,
    SetIngressConfig,
    metrics_actor_name,
    part_deployment_name,
    running_replicas,
)
from ipnext.spec.model import import_factory
from ipnext.store.pinned import load_verified, load_verified_checkpoint, pinned_path

__all__ = ["PartHost", "SetInfo", "build_part", "set_app"]

# How long the ingress reuses Serve's status for the running replicas (one controller call).
_STATUS_TTL_S = 1.0


def build_part(host: PartHostArgs) -> tuple[Any, int]:
    """One part built from its pinned snapshot, as a dedicated replica and a pool build it, and
    the bytes of the weights it was given (a checkpoint's files, or its tensors' `nbytes`)."""
    # The allow-list again, before the import (which runs the module's code) and before any
    # weights are read: this replica's config may not have come from the worker.
    factory = import_factory(host.factory, host.factory_prefixes)
    # The pinned copy made at validation, checked against its sha256 on the bytes it loads:
    # the training job's own file may have moved or changed since (ipnext/store/pinned.py).
    store = Path(host.pinned_store)
    weights: Any
    if host.checkpoint:
        weights = load_verified_checkpoint(pinned_path(store, host.sha256, ".json"), host.sha256)
        size = sum(len(data) for data in weights.values())
    else:
        weights = load_verified(pinned_path(store, host.sha256), host.sha256)
        size = sum(tensor.nbytes for tensor in weights.values())
    return factory(weights, dict(host.config)), size


@serve.deployment(ray_actor_options={"num_cpus": 0})
class PartHost:
    """Hosts one part of one snapshot set: loads its safetensors weights and stamps its snapshot id."""

    def __init__(self, host: PartHostArgs) -> None:
        import torch

        torch.set_num_threads(1)  # many replicas share few cores; torch would take them all
        self._part, _ = build_part(host)
        self._snapshot_id = host.snapshot_id
        self._host = host
        self._pusher = self._counter_pusher()
        self._batches = 0
        self._batched_calls = 0
        if host.batching is not None:
            if not callable(getattr(self._part, "batch", None)):
                raise ValueError(f"part {host.part}: `batching` is set but the part has no `batch` method")
            self._batched.set_max_batch_size(host.batching.max_batch_size)  # type: ignore[attr-defined]
            self._batched.set_batch_wait_timeout_s(host.batching.wait_ms / 1000)  # type: ignore[attr-defined]

    async def __call__(self, inputs: dict[str, Any]) -> dict[str, Any]:
        self._ensure_pusher()
        if self._host.batching is not None:
            result = await self._batched(inputs)
            if isinstance(result, Exception):  # one request's own failure; the batch went on
                raise result
        else:
            result = self._part(inputs)
            if inspect.isawaitable(result):
                result = await result
        return {"output": result, "snapshot_id": self._snapshot_id}

    @serve.batch(max_batch_size=1, batch_wait_timeout_s=0.0)
    async def _batched(self, batch: list[dict[str, Any]]) -> list[Any]:
        """Concurrent calls gathered by Serve (sizes set from the part's `batching`), answered by
        the part's `batch`, which returns one result or exception per input, in order."""
        self._batches += 1
        self._batched_calls += len(batch)
        results = await self._part.batch(batch)
        if len(results) != len(batch):
            raise RuntimeError(
                f"part {self._host.part}: batch answered {len(results)} of {len(batch)} inputs"
            )
        return list(results)

    async def stream(self, inputs: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The part's answer piece by piece (a part without `stream` answers in one piece).
        When the caller goes away, Serve cancels this generator and the part's own `stream`
        is closed with it (a generative part then frees what the request held)."""
        self._ensure_pusher()
        if not hasattr(self._part, "stream"):
            yield await self(inputs)
            return
        pieces = self._part.stream(inputs)
        try:
            async for piece in pieces:
                yield {"output": piece, "snapshot_id": self._snapshot_id}
        finally:
            await pieces.aclose()

    async def check_health(self) -> None:
        """Serve's health check of this replica (every `health_check_period_s`; Serve replaces the
        replica after 3 failures in a row). It asks the part's own `check_health`, where a part has
        one: a generative part fails it when its engine's driver died or stalls, which a check
        that merely answers would miss. Async, so a blocked event loop also fails it (timeout)."""
        check = getattr(self._part, "check_health", None)
        if callable(check):
            result = check()
            if inspect.isawaitable(result):
                await result

    def describe(self) -> dict[str, Any]:
        """What the part reports of itself (`status()`, if it has one) and, for a batched part,
        how many batches it ran for how many calls: for checks and dashboards."""
        status = getattr(self._part, "status", None)
        described: dict[str, Any] = {
            "snapshot_id": self._snapshot_id,
            "status": status() if callable(status) else None,
        }
        if self._host.batching is not None:
            described["batching"] = {"batches": self._batches, "calls": self._batched_calls}
        return described

    def _counter_pusher(self) -> CounterPusher | None:
        """For a part that measures itself (`serving_counters`), the pusher of its counters to
        the model's metrics actor, with its observations and status also sent to Prometheus."""
        counters = getattr(self._part, "serving_counters", None)
        if not callable(counters) or not self._host.app:
            return None
        host = self._host
        prometheus = PartPrometheus(host.model, host.region, host.app, host.part)
        observe_with = getattr(self._part, "observe_with", None)
        if callable(observe_with):
            observe_with(prometheus.observe)
        status = getattr(self._part, "status", None)

        def payload() -> dict[str, Any]:
            if callable(status):
                prometheus.gauges(status())
            return {host.app: counters().model_dump()}

        replica = f"part-{os.getpid()}-{id(self)}"
        engine_stats = getattr(self._part, "engine_stats", None)
        return CounterPusher(
            metrics_actor_name(host.model, host.region),
            replica,
            payload,
            engine_stats=engine_stats if callable(engine_stats) else None,
        )

    def _ensure_pusher(self) -> None:
        if self._pusher is not None:
            self._pusher.ensure_running()


@serve.deployment(ray_actor_options={"num_cpus": 0})
class SetInfo:
    """The set app's ingress: tells routers the set's DAG, parts and per-deployment capacity,
    which follows the replicas Serve runs (autoscaled between replans), not the plan's."""

    def __init__(self, args: SetAppArgs, parts: dict[str, DeploymentHandle]) -> None:
        self._args = args
        self._app = serve.get_replica_context().app_name
        self._parts = parts  # bound so Serve deploys them with this app
        self._config = SetIngressConfig()
        self._running: dict[str, int] = {}
        self._read_at = -_STATUS_TTL_S
        self._reading = asyncio.Lock()  # one read at a time; the others wait and reuse it

    def reconfigure(self, config: dict[str, Any]) -> None:
        self._config = SetIngressConfig.model_validate(config)

    async def describe(self) -> SetDescription:
        async with self._reading:
            if time.monotonic() - self._read_at >= _STATUS_TTL_S:
                self._read_at = time.monotonic()
                try:
                    self._running = await asyncio.to_thread(self._read_running)
                except Exception:  # the controller is away: the last counts (or the plan's) hold
                    pass
        return self._args.describe(self._config.running_capacity(self._running))

    def _read_running(self) -> dict[str, int]:
        app = serve_applications().get(self._app)
        if app is None:
            return {}
        return running_replicas(
            {
                name: {str(getattr(state, "value", state)): n for state, n in d.replica_states.items()}
                for name, d in app.deployments.items()
            }
        )

    async def __call__(self, request: Request) -> dict[str, Any]:
        return (await self.describe()).model_dump(mode="json")


def set_app(args: dict[str, Any]) -> serve.Application:
    """Builder Serve imports for a set app: a PartHost per (part, hardware) behind a `set` ingress.
    The args are validated here, once; the deployments receive the parsed models."""
    parsed = SetAppArgs.model_validate(args)
    parts = {
        name: PartHost.options(name=name).bind(parsed.parts[part])  # type: ignore[attr-defined]
        for part, hardware in parsed.hardware.items()
        for name in (part_deployment_name(part, hw) for hw in hardware)
    }
    return SetInfo.options(name=SET_DEPLOYMENT).bind(parsed, parts)  # type: ignore[attr-defined]
