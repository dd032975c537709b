"""Ray Serve deployments and the app builders that Serve imports by path.

- `set_app` (`ipnext.serving.apps:set_app`): one PartHost deployment per (part, hardware)
  plus a small `set` ingress that describes the set to routers.
- `router_app` (`ipnext.serving.apps:router_app`): the model's HTTP entry in a region;
  picks a set app per request by weight and runs the DAG against that app only.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import math
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from ipnext.errors import PartInputError
from ipnext.model import DAG_INPUT, DAG_OUTPUT, ChoiceSpec, import_factory
from ipnext.rollout import RouterConfig
from ipnext.serving.choices import FallbackReason, RequestPlan, VariantRouter, variant_label
from ipnext.serving.layout import (
    RAY_NAMESPACE,
    ROUTER_DEPLOYMENT,
    SET_DEPLOYMENT,
    PartHostArgs,
    RouterAppArgs,
    SetAppArgs,
    metrics_actor_name,
)
from ipnext.serving.metrics import MetricsStore, SetCounters
from ipnext.sharding import gather_shards
from ipnext.snapshots import load_weights, resolve_in_roots, sha256_file

__all__ = ["PartHost", "Router", "SetInfo", "all_finite", "pick_apps", "pick_set", "router_app", "set_app"]

METRICS_PUSH_SECONDS = 1.0


@serve.deployment(ray_actor_options={"num_cpus": 0})
class PartHost:
    """Hosts one part of one snapshot set: loads its safetensors weights and stamps its snapshot id."""

    def __init__(self, args: dict[str, Any]) -> None:
        import torch

        torch.set_num_threads(1)  # many replicas share few cores; torch would take them all
        host = PartHostArgs.model_validate(args)
        path = resolve_in_roots(host.uri, [Path(r) for r in host.snapshot_roots])
        digest = sha256_file(path)
        if digest != host.sha256:
            raise ValueError(f"{host.uri}: sha256 {digest} != {host.sha256} that was validated")
        factory = import_factory(host.factory)
        self._part = factory(load_weights(path), dict(host.config))
        self._snapshot_id = host.snapshot_id
        self._host = host
        self._pusher: asyncio.Task[None] | None = None
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

    def _ensure_pusher(self) -> None:
        counters = getattr(self._part, "serving_counters", None)
        if not callable(counters) or not self._host.app or (self._pusher and not self._pusher.done()):
            return
        replica = f"part-{os.getpid()}-{id(self)}"
        actor = metrics_actor_name(self._host.model, self._host.region)
        prometheus = _PartPrometheus(self._host)
        observe_with = getattr(self._part, "observe_with", None)
        if callable(observe_with):
            observe_with(prometheus.observe)
        status = getattr(self._part, "status", None)

        def payload() -> dict[str, Any]:
            if callable(status):
                prometheus.gauges(status())
            return {self._host.app: counters().model_dump()}

        self._pusher = asyncio.get_running_loop().create_task(push_forever(actor, replica, payload))


@serve.deployment(ray_actor_options={"num_cpus": 0})
class SetInfo:
    """The set app's ingress: tells routers the set's DAG, parts and per-deployment capacity."""

    def __init__(self, args: dict[str, Any], parts: dict[str, DeploymentHandle]) -> None:
        self._args = SetAppArgs.model_validate(args)
        self._parts = parts  # bound so Serve deploys them with this app
        self._capacity: dict[str, float] = {}

    def reconfigure(self, config: dict[str, Any]) -> None:
        self._capacity = dict(config.get("capacity", {}))

    def describe(self) -> dict[str, Any]:
        deployments: dict[str, dict[str, float]] = {}
        for part, hardware in self._args.hardware.items():
            deployments[part] = {f"{part}-{hw}": self._capacity.get(f"{part}-{hw}", 1.0) for hw in hardware}
        return {
            "set_id": self._args.set_id,
            "dag": self._args.dag,
            "order": self._args.order,
            "deployments": deployments,
            "choices": {name: choice.model_dump(mode="json") for name, choice in self._args.choices.items()},
            "shard_groups": self._args.shard_groups,
        }

    async def __call__(self, request: Request) -> dict[str, Any]:
        return self.describe()


class _SetRoute:
    """A router's view of one set app: its DAG, its choice nodes and a handle per part deployment."""

    def __init__(self, app: str, info: dict[str, Any], variants: VariantRouter) -> None:
        self.app = app
        self.set_id: str = info["set_id"]
        self.variants = variants
        self.shard_groups: dict[str, list[str]] = info.get("shard_groups", {})
        self.deployments: dict[str, tuple[list[DeploymentHandle], list[float]]] = {}
        for part, capacity in info["deployments"].items():
            names = sorted(capacity)
            handles = [serve.get_deployment_handle(n, app_name=app) for n in names]
            self.deployments[part] = (handles, [max(capacity[n], 1e-9) for n in names])

    def handle(self, part: str, rng: random.Random) -> DeploymentHandle:
        handles, weights = self.deployments[part]
        return handles[0] if len(handles) == 1 else rng.choices(handles, weights)[0]


class NonFiniteOutputsError(ValueError):
    """The parts answered NaN or infinity: a failed request, which the gates must see."""


@dataclass
class _Attempt:
    """One run of a request's DAG: the variant at each choice node, the snapshot id of each part
    that answered, and the part that failed it (not by the caller's mistake), if one did."""

    chosen: dict[str, str]
    stamps: dict[str, str] = field(default_factory=dict)
    failed_part: str | None = None
    retried: bool = False  # this is the retry on a fallback after the first attempt failed


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Router:
    """The (model, region) HTTP entry: picks a set app by weight and runs the DAG against it."""

    def __init__(self, args: dict[str, Any]) -> None:
        router = RouterAppArgs.model_validate(args)
        self._model = router.model
        self._region = router.region
        self._config = RouterConfig(generation=0, weights={})
        self._routes: dict[str, _SetRoute] = {}
        self._rng = random.Random()
        self._counters: dict[str, SetCounters] = {}
        self._replica = f"{os.getpid()}-{id(self)}"
        self._pusher: asyncio.Task[None] | None = None
        self._prometheus = _PrometheusMetrics()

    async def reconfigure(self, config: dict[str, Any]) -> None:
        new = RouterConfig.model_validate(config)
        routes: dict[str, _SetRoute] = {}
        for app in sorted(new.apps()):
            info = await serve.get_deployment_handle(SET_DEPLOYMENT, app_name=app).describe.remote()
            choices = {n: ChoiceSpec.model_validate(c) for n, c in info.get("choices", {}).items()}
            variants = VariantRouter(info["dag"], info["order"], choices, self._observer(app))
            if app in self._routes:  # the same set app: keep its in-flight counts and breakers
                variants.carry_over(self._routes[app].variants)
            routes[app] = _SetRoute(app, info, variants)
        self._routes = routes
        self._config = new
        self._ensure_pusher()

    def generation(self) -> int:
        return self._config.generation

    def state(self) -> dict[str, Any]:
        """The GET answer: model, region, router config, and for set apps with choice nodes what
        this replica routed (`variants`: set app -> choice -> requests, fallbacks, in flight)."""
        answer = {"model": self._model, "region": self._region, **self._config.model_dump()}
        now = time.monotonic()
        variants = {app: r.variants.report(now) for app, r in self._routes.items() if r.variants.choices}
        if variants:
            answer["variants"] = variants
        return answer

    def _observer(self, app: str) -> Callable[[str, str, FallbackReason | None], None]:
        def observe(choice: str, variant: str, reason: FallbackReason | None) -> None:
            self._prometheus.record_variant(self._model, self._region, app, choice, variant, reason)

        return observe

    async def __call__(self, request: Request) -> JSONResponse | StreamingResponse:
        path = request.url.path.rstrip("/")
        if request.method == "GET" and not path.endswith("/predict"):
            return JSONResponse(self.state())
        if request.method != "POST" or not path.endswith("/predict"):
            return JSONResponse({"error": "use POST .../predict"}, status_code=404)
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": "body is not JSON"}, status_code=400)
        if not isinstance(body, dict) or "inputs" not in body:
            return JSONResponse(
                {"error": 'body must be a JSON object {"inputs": ..., "key": optional}'},
                status_code=400,
            )
        if body.get("stream"):
            return StreamingResponse(
                self._stream_events(body["inputs"], body.get("key")), media_type="text/event-stream"
            )
        envelope, status = await self.predict(body["inputs"], body.get("key"))
        return JSONResponse(envelope, status_code=status)

    async def _stream_events(self, inputs: Any, key: str | None) -> AsyncIterator[str]:
        """Server-sent events: one envelope per piece of the final part's answer (a part
        without `stream` gives one piece); a failure is an event with `error`. If the client
        goes away, the part's stream is cancelled with this generator."""
        async for envelope in self.stream(inputs, key):
            yield f"data: {json.dumps(envelope)}\n\n"

    async def stream(self, inputs: Any, key: str | None = None) -> AsyncIterator[dict[str, Any]]:
        """The streaming `predict`: every part but the DAG's final one runs as usual, then the
        final part streams. Counted as one request (latency: first piece to last). Choice nodes
        pick the variants as for `predict`, but a failed variant is not retried on the fallback
        (pieces may have gone out already)."""
        picked = pick_apps(self._config, set(self._routes), key, self._rng)
        if picked is None:
            yield {"error": f"model {self._model} has no serving set in {self._region}"}
            return
        app, base, part_apps = picked
        route = self._routes[app]
        dag = self._routes[base]
        counters = self._counters.setdefault(app, SetCounters())
        part_routes = {p: self._routes[a] for p, a in part_apps.items()}
        attempt = _Attempt(dag.variants.choose(inputs, time.monotonic()))
        plan = dag.variants.plan(attempt.chosen)
        variant = variant_label(attempt.chosen)
        finals = plan.upstream.get(DAG_OUTPUT, [])
        started = time.perf_counter()
        pieces: Any = None
        try:
            if len(finals) != 1:
                raise ValueError(f"streaming needs one part feeding the output, the DAG has {finals}")
            final = finals[0]
            results = await self._run_parts(dag, part_routes, inputs, attempt, skip=final)
            upstream = self._upstream_values(plan, final, results, inputs, dag.shard_groups)
            handle = part_routes.get(final, dag).handle(final, self._rng)
            pieces = handle.options(stream=True).stream.remote(upstream)
            async for reply in pieces:
                attempt.stamps[final] = reply["snapshot_id"]
                output = _jsonable(reply["output"])
                if not all_finite(output):
                    raise ValueError("the model's outputs are not finite (NaN or inf)")
                yield {
                    "outputs": output,
                    "set": route.set_id,
                    "parts": dict(attempt.stamps),
                    "variant": variant,
                }
            pieces = None
        except PartInputError as err:  # the caller's mistake: not counted against the set
            yield {"error": _cause(err), "status": 400, "set": route.set_id}
            return
        except Exception as err:  # a part failed: count it and end the stream with the reason
            if attempt.failed_part is None and pieces is not None:
                attempt.failed_part = finals[0]
            counters.requests += 1
            counters.errors += 1
            self._prometheus.record(self._model, self._region, app, None)
            yield {"error": f"{type(err).__name__}: {err}", "set": route.set_id}
            return
        finally:
            if pieces is not None:  # the client went away mid-stream: stop the part's work
                pieces.cancel()
            dag.variants.finish(attempt.chosen, attempt.stamps, attempt.failed_part, time.monotonic())
        elapsed_ms = (time.perf_counter() - started) * 1000
        counters.requests += 1
        counters.observe("latency_ms", elapsed_ms)
        self._prometheus.record(self._model, self._region, app, elapsed_ms)

    async def predict(self, inputs: Any, key: str | None = None) -> tuple[dict[str, Any], int]:
        picked = pick_apps(self._config, set(self._routes), key, self._rng)
        if picked is None:
            return {"error": f"model {self._model} has no serving set in {self._region}"}, 503
        app, base, part_apps = picked
        route = self._routes[app]  # the set the answer is counted against and stamped with
        counters = self._counters.setdefault(app, SetCounters())
        started = time.perf_counter()
        try:
            part_routes = {p: self._routes[a] for p, a in part_apps.items()}
            outputs, attempt = await self._run_dag(self._routes[base], part_routes, inputs)
        except PartInputError as err:  # the caller's mistake: 400, not counted against the set
            return {"error": _cause(err), "set": route.set_id}, 400
        except Exception as err:  # a part failed (a NaN score too): count it, answer 500 with the reason
            counters.requests += 1
            counters.errors += 1
            self._prometheus.record(self._model, self._region, app, None)
            reason = str(err) if isinstance(err, NonFiniteOutputsError) else f"{type(err).__name__}: {err}"
            return {"error": reason, "set": route.set_id}, 500
        elapsed_ms = (time.perf_counter() - started) * 1000
        counters.requests += 1
        if attempt.retried:
            # The fallback saved the caller, but a part of the set failed this request: the
            # gates must see it, or a bad snapshot of a variant would roll out unnoticed.
            counters.errors += 1
            self._prometheus.record(self._model, self._region, app, None)
        else:
            counters.observe("latency_ms", elapsed_ms)
            self._prometheus.record(self._model, self._region, app, elapsed_ms)
        envelope = {"outputs": outputs, "set": route.set_id, "parts": attempt.stamps}
        return {**envelope, "variant": variant_label(attempt.chosen)}, 200

    async def _run_dag(
        self, route: _SetRoute, part_routes: dict[str, _SetRoute], inputs: Any
    ) -> tuple[Any, _Attempt]:
        """Run `route`'s DAG on the variants its choice nodes pick for the request, calling each
        part in `part_routes` on that route instead. When a part of a chosen variant fails (not
        by the caller's mistake), the request runs once more with that choice on its fallback."""
        attempt = _Attempt(route.variants.choose(inputs, time.monotonic()))
        try:
            return await self._run_attempt(route, part_routes, inputs, attempt), attempt
        except PartInputError:
            raise
        except Exception:
            retry = route.variants.retry_on_fallback(attempt.chosen, attempt.failed_part)
            if retry is None:
                raise
        attempt = _Attempt(retry, retried=True)
        return await self._run_attempt(route, part_routes, inputs, attempt), attempt

    async def _run_attempt(
        self, route: _SetRoute, part_routes: dict[str, _SetRoute], inputs: Any, attempt: _Attempt
    ) -> Any:
        try:
            results = await self._run_parts(route, part_routes, inputs, attempt)
            feeding = route.variants.plan(attempt.chosen).upstream.get(DAG_OUTPUT, [])
            finals = _join_shards({u: results[u] for u in feeding}, route.shard_groups)
            outputs = _jsonable(next(iter(finals.values())) if len(finals) == 1 else finals)
            if not all_finite(outputs):  # a failure of the parts that answered: a variant falls back
                attempt.failed_part = feeding[0]
                raise NonFiniteOutputsError("the model's outputs are not finite (NaN or inf)")
        finally:
            route.variants.finish(attempt.chosen, attempt.stamps, attempt.failed_part, time.monotonic())
        return outputs

    async def _run_parts(
        self,
        route: _SetRoute,
        part_routes: dict[str, _SetRoute],
        inputs: Any,
        attempt: _Attempt,
        skip: str | None = None,
    ) -> dict[str, Any]:
        """Every output of the parts the attempt's variants run (all but `skip`), each part
        started once its upstream is done; snapshot ids and a failing part go into `attempt`."""
        plan = route.variants.plan(attempt.chosen)
        tasks: dict[str, asyncio.Task[Any]] = {}

        async def run(part: str) -> Any:
            ups = [u for u in plan.upstream.get(part, []) if u != DAG_INPUT]
            values = dict(zip(ups, await asyncio.gather(*(tasks[u] for u in ups)), strict=True))
            upstream = self._upstream_values(plan, part, values, inputs, route.shard_groups)
            try:
                reply = await part_routes.get(part, route).handle(part, self._rng).remote(upstream)
            except Exception as err:
                if not isinstance(err, PartInputError) and attempt.failed_part is None:
                    attempt.failed_part = part
                raise
            attempt.stamps[part] = reply["snapshot_id"]
            return reply["output"]

        for part in plan.order:  # topological: upstream tasks exist before their consumers
            if part != skip:
                tasks[part] = asyncio.ensure_future(run(part))
        done = await asyncio.gather(*tasks.values())
        return dict(zip(tasks, done, strict=True))

    @staticmethod
    def _upstream_values(
        plan: RequestPlan,
        part: str,
        results: dict[str, Any],
        inputs: Any,
        shard_groups: dict[str, list[str]] | None = None,
    ) -> dict[str, Any]:
        """A part's `inputs`: each upstream node's output, the request under "input", and the
        answers of a sharded part's shards gathered under the part's own name."""
        ups = plan.upstream.get(part, [])
        values = _join_shards({u: results[u] for u in ups if u != DAG_INPUT}, shard_groups or {})
        if DAG_INPUT in ups:
            values[DAG_INPUT] = inputs
        return values

    def _ensure_pusher(self) -> None:
        if self._pusher is None or self._pusher.done():
            actor = metrics_actor_name(self._model, self._region)
            self._pusher = asyncio.get_running_loop().create_task(
                push_forever(
                    actor, self._replica, lambda: {a: c.model_dump() for a, c in self._counters.items()}
                )
            )


class _PrometheusMetrics:
    """The same request counters, exported through Ray's Prometheus metrics endpoint."""

    def __init__(self) -> None:
        from ray.util import metrics

        tags = ("model", "region", "set_app")
        self._requests = metrics.Counter("ipnext_requests_total", "Requests served", tag_keys=tags)
        self._errors = metrics.Counter("ipnext_errors_total", "Requests failed", tag_keys=tags)
        self._latency = metrics.Histogram(
            "ipnext_latency_ms",
            "Request latency through the router (ms)",
            boundaries=[1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000],
            tag_keys=tags,
        )
        self._variant_requests = metrics.Counter(
            "ipnext_variant_requests_total",
            "Requests sent to a variant of a choice node (a retry on the fallback counts again)",
            tag_keys=(*tags, "choice", "variant"),
        )
        self._fallbacks = metrics.Counter(
            "ipnext_variant_fallbacks_total",
            "Requests a choice node moved to its fallback variant, by reason",
            tag_keys=(*tags, "choice", "reason"),
        )

    def record_variant(
        self, model: str, region: str, app: str, choice: str, variant: str, reason: str | None
    ) -> None:
        tags = {"model": model, "region": region, "set_app": app, "choice": choice}
        self._variant_requests.inc(1, {**tags, "variant": variant})
        if reason is not None:
            self._fallbacks.inc(1, {**tags, "reason": reason})

    def record(self, model: str, region: str, app: str, latency_ms: float | None) -> None:
        tags = {"model": model, "region": region, "set_app": app}
        self._requests.inc(1, tags)
        if latency_ms is None:
            self._errors.inc(1, tags)
        else:
            self._latency.observe(latency_ms, tags)


async def push_forever(actor_name: str, replica: str, payload: Callable[[], dict[str, Any]]) -> None:
    """Push this replica's cumulative counters (set app -> SetCounters) to a model's metrics
    actor every second, until the actor is gone (the model was deleted)."""
    actor = (
        ray.remote(MetricsStore)
        .options(
            name=actor_name, namespace=RAY_NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0
        )
        .remote()
    )
    while True:
        await asyncio.sleep(METRICS_PUSH_SECONDS)
        try:
            await actor.push.remote(replica, payload())  # type: ignore[attr-defined]
        except ray.exceptions.RayActorError:
            return  # the next request or reconfigure starts a new pusher


class _PartPrometheus:
    """A self-measuring part's figures through Ray's Prometheus endpoint: its latency
    observations as histograms (`ipnext_ttft_ms`, `ipnext_itl_ms`, `ipnext_queue_ms`) and the
    numbers of its `status()` as gauges (`ipnext_part_<name>`), tagged by model, region, set
    app and part."""

    _BOUNDARIES: list[float] = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000]

    def __init__(self, host: PartHostArgs) -> None:
        self._tags = {"model": host.model, "region": host.region, "set_app": host.app, "part": host.part}
        self._histograms: dict[str, Any] = {}
        self._gauges: dict[str, Any] = {}

    def observe(self, metric: str, value_ms: float) -> None:
        from ray.util import metrics

        if metric not in self._histograms:
            self._histograms[metric] = metrics.Histogram(
                f"ipnext_{metric}",
                f"{metric} of a generative part",
                self._BOUNDARIES,
                tag_keys=tuple(self._tags),
            )
        self._histograms[metric].observe(value_ms, self._tags)

    def gauges(self, status: dict[str, Any]) -> None:
        from ray.util import metrics

        for name, value in status.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if name not in self._gauges:
                self._gauges[name] = metrics.Gauge(f"ipnext_part_{name}", name, tag_keys=tuple(self._tags))
            self._gauges[name].set(float(value), self._tags)


def pick_set(weights: dict[str, float], key: str | None, rng: random.Random) -> str | None:
    """Choose a set app in proportion to its weight; with a key, the same key always picks the
    same app while the weights stay put (sticky sessions, A/B-stable users)."""
    apps = sorted(a for a, w in weights.items() if w > 0)
    if not apps:
        return None
    total = sum(weights[a] for a in apps)
    if key is None:
        point = rng.random() * total
    else:
        digest = hashlib.sha256(key.encode()).digest()
        point = int.from_bytes(digest[:8], "big") / 2**64 * total
    for app in apps:
        point -= weights[app]
        if point < 0:
            return app
    return apps[-1]


def pick_apps(
    config: RouterConfig, reachable: set[str], key: str | None, rng: random.Random
) -> tuple[str, str, dict[str, str]] | None:
    """(counted, base, part apps) for one request, or None when no app is reachable.

    `base` is drawn from `config.weights` and runs the DAG; each part that rolls on its own
    (`config.parts`) runs on the app drawn from its weights; the request is counted against
    (and stamped with) the gated part's app, else the base app."""
    base = pick_set({a: w for a, w in config.weights.items() if a in reachable}, key, rng)
    part_apps: dict[str, str] = {}
    for part, weights in config.parts.items():
        chosen = pick_set({a: w for a, w in weights.items() if a in reachable}, key, rng)
        if chosen is not None:
            part_apps[part] = chosen
    if base is None:
        return None
    counted = part_apps.get(config.gated_part, base) if config.gated_part else base
    return counted, base, part_apps


def _join_shards(values: dict[str, Any], shard_groups: dict[str, list[str]]) -> dict[str, Any]:
    """`values` with the answers of each sharded part's shards gathered under the part's name."""
    for group, members in shard_groups.items():
        present = [m for m in members if m in values]
        if present and len(present) != len(members):
            raise RuntimeError(f"{group}: only the shards {present} of {members} answered")
        if present:
            values[group] = gather_shards([values.pop(m) for m in members])
    return values


def _cause(err: BaseException) -> str:
    """A part's own words for an error it raised (Ray wraps it with the replica's traceback)."""
    cause = getattr(err, "cause", None)
    return str(cause) if isinstance(cause, BaseException) else str(err).strip().splitlines()[-1]


def all_finite(value: Any) -> bool:
    """No NaN or infinity anywhere in a JSON-like answer."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(all_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(all_finite(v) for v in value)
    return True


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def set_app(args: dict[str, Any]) -> serve.Application:
    """Builder Serve imports for a set app: a PartHost per (part, hardware) behind a `set` ingress."""
    parsed = SetAppArgs.model_validate(args)
    parts = {
        f"{part}-{hw}": PartHost.options(name=f"{part}-{hw}").bind(parsed.parts[part].model_dump(mode="json"))  # type: ignore[attr-defined]
        for part, hardware in parsed.hardware.items()
        for hw in hardware
    }
    return SetInfo.options(name=SET_DEPLOYMENT).bind(parsed.model_dump(mode="json"), parts)  # type: ignore[attr-defined]


def router_app(args: dict[str, Any]) -> serve.Application:
    """Builder Serve imports for a router app."""
    parsed = RouterAppArgs.model_validate(args)
    return Router.options(name=ROUTER_DEPLOYMENT).bind(parsed.model_dump(mode="json"))  # type: ignore[attr-defined]
