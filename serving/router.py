"""The router app Serve builds for one (model, region): its HTTP entry, which picks a set app
per request by weight, admits it or sheds it, runs the DAG against that app (`dag_run`: the
variants, a failed variant's fallback, a typed answer), counts what the set's gates read and
answers. `router_app` is the builder the rendered Serve config imports by path
(`layout.ROUTER_IMPORT_PATH`)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from ipnext.contracts.counters import OutcomeTotals, SetCounters
from ipnext.contracts.http_routes import DEADLINE_HEADER, NO_SET_REASON, router_route
from ipnext.contracts.router import RouterConfig
from ipnext.errors import PartInputError
from ipnext.policy.demand import SOURCE_HEADER, valid_source
from ipnext.serving.answers import (
    NonFiniteOutputsError,
    answer,
    caller_deadline,
    part_cause,
    refusal,
    server_failure,
    set_failure,
    shed_answer,
)
from ipnext.serving.choices import FallbackReason, VariantRouter, variant_label
from ipnext.serving.dag_run import Attempt, DagFailed, run_dag, run_parts
from ipnext.serving.export import CounterPusher, RouterPrometheus
from ipnext.serving.layout import (
    ROUTER_DEPLOYMENT,
    SET_DEPLOYMENT,
    RouterAppArgs,
    SetDescription,
    metrics_actor_name,
)
from ipnext.serving.metrics_hub import find_stores
from ipnext.serving.request_body import BodyError, parse_request_body
from ipnext.serving.router_feedback import stamp_arm, take_feedback
from ipnext.serving.set_routes import DEDICATED, SetAccess, SetRoute
from ipnext.serving.shadow_mirror import ShadowMirror
from ipnext.serving.traffic import PickedApps, all_finite, jsonable, pick_apps, upstream_values
from ipnext.spec.model import DAG_OUTPUT
from ipnext.store.keys import KeyCheck

__all__ = ["Router", "describe_set_app", "router_app"]

logger = logging.getLogger("ray.serve")

# How often a router asks each set's ingress for its capacity, which follows the replicas Serve
# runs: a part on two hardware classes is split by what each deployment runs now. Each ask costs
# the ingress a read of Serve's whole status from the controller: at 2 s the set ingresses and
# the controller's status calls took about a tenth of the test suite's CPU (sampled per process).
# Serve's autoscaler moves replicas on a scale of seconds to minutes, so 5 s follows it.
CAPACITY_REFRESH_S = 5.0
# How long a set app's ingress has to describe itself to a router (it answers in milliseconds
# when it runs; a call to an app that does not exist waits for good).
DESCRIBE_TIMEOUT_S = 10.0


async def describe_set_app(app: str) -> SetDescription | None:
    """What a set app's ingress says of its set, or None when it does not answer within
    DESCRIBE_TIMEOUT_S or fails (going away, restarting, never deployed)."""

    async def ask() -> SetDescription:
        described: SetDescription = await serve.get_deployment_handle(
            SET_DEPLOYMENT, app_name=app
        ).describe.remote()
        return described

    try:
        return await asyncio.wait_for(ask(), DESCRIBE_TIMEOUT_S)
    except Exception:  # TimeoutError included
        return None


class NoPusher:
    """A router whose figures another pushes (a pool router pushes all its models' at once)."""

    def ensure_running(self) -> None:
        pass

    def stop(self) -> None:
        pass


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Router:
    """The (model, region) HTTP entry: picks a set app by weight and runs the DAG against it."""

    def __init__(
        self,
        args: RouterAppArgs,
        access: SetAccess = DEDICATED,
        describe: Callable[[str], Awaitable[SetDescription | None]] | None = None,
        pushes: bool = True,
        prometheus: RouterPrometheus | None = None,
    ) -> None:
        """`access` and `describe`: how this router reaches its set apps and learns what each
        holds; by default its model's own set apps, each asked through its ingress
        (`describe_set_app`). A shared pool's router (serving/pool_router.py) gives its pool's
        instead, pushes every model's figures itself (`pushes` False, `figures`) and shares
        one `prometheus` among them."""
        self._access = access
        self._describe = describe or describe_set_app
        self._model = args.model
        self._region = args.region
        self._limits = args.router  # deadline and request limits: the spec's router section
        self._keys = KeyCheck(Path(args.keys_file)) if args.keys_file is not None else None
        self._config = RouterConfig(generation=0, weights={})
        self._routes: dict[str, SetRoute] = {}
        self._rng = random.Random()
        self._counters: dict[str, SetCounters] = {}
        self._demand: dict[str, int] = {}  # requests admitted, by the caller's source region
        self.replica_key = f"{os.getpid()}-{id(self)}"
        self._pusher: CounterPusher | NoPusher = (
            CounterPusher(
                metrics_actor_name(args.model, args.region),
                self.replica_key,
                lambda: self.figures()[0],
                lambda: self.figures()[1],
                hub_region=access.hub_region,
            )
            if pushes
            else NoPusher()
        )
        # One per process: a pool router's models share it (its series are labelled by model).
        self._prometheus = prometheus or RouterPrometheus()
        self._following: asyncio.Task[None] | None = None
        self._mirror = ShadowMirror(self._count, self._note)

    async def _follow_capacity(self) -> None:
        """Every CAPACITY_REFRESH_S: each routed set app's capacity as its ingress reads it, and
        a route for each app of the config that had none (it did not describe itself in time)."""
        while True:
            await asyncio.sleep(CAPACITY_REFRESH_S)
            for app, route in list(self._routes.items()):
                described = await self._describe(app)
                if described is not None:  # else a set going away, or its ingress restarting
                    route.follow(described)
            for app in sorted(self._config.apps() - set(self._routes)):
                found = await self._describe(app)
                if found is not None and app in self._config.apps() and app not in self._routes:
                    self._routes = {**self._routes, app: self._route(app, found)}
                    logger.info("set app %s described itself: routed to from now on", app)

    async def reconfigure(self, config: dict[str, Any]) -> None:
        """Take a new router config in place. Each set app it names describes itself (its DAG and
        part deployments), all at once, each within DESCRIBE_TIMEOUT_S: an app that does not
        answer (deleted since, or its node not back) keeps the route this replica had for it,
        else is left out of the draw (pick_apps) until `_follow_capacity` finds it. Waiting on it
        instead held this replica in Serve's STARTING for good (a region's router started again
        on a config naming a set app the emergency replan had deleted: the return replan then
        waited 240 s for a router that never started)."""
        new = RouterConfig.model_validate(config)
        apps = sorted(new.apps())
        routes: dict[str, SetRoute] = {}
        for app, described in zip(apps, await asyncio.gather(*map(self._describe, apps)), strict=True):
            if described is not None:
                routes[app] = self._route(app, described)
            elif app in self._routes:
                routes[app] = self._routes[app]
            else:
                logger.warning(
                    "set app %s did not describe itself within %g s: left out of the draw until it does",
                    app,
                    DESCRIBE_TIMEOUT_S,
                )
        self._routes = routes
        self._config = new
        self._pusher.ensure_running()
        if self._following is None or self._following.done():
            self._following = asyncio.create_task(self._follow_capacity())

    def figures(self) -> tuple[dict[str, Any], dict[str, int]]:
        """What this router pushes to its model's metrics store: its cumulative counters per set
        app, and its admitted requests by source (observed demand)."""
        return {a: c.model_dump() for a, c in self._counters.items()}, dict(self._demand)

    def close(self) -> None:
        """Stop this router's background work (a pool router dropped its model)."""
        if self._following is not None:
            self._following.cancel()
        self._pusher.stop()

    def _route(self, app: str, described: SetDescription) -> SetRoute:
        variants = VariantRouter(described.dag, described.order, described.choices, self._observer(app))
        route = SetRoute(app, described, variants, self._access)
        if app in self._routes:  # the same set app: keep its in-flight counts, breakers and queue
            variants.carry_over(self._routes[app].variants)
            route.queue = self._routes[app].queue
        return route

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
        """The HTTP door. Whatever happens inside, the caller gets `{error_id, message}` and a
        status, never a traceback: the details go to this replica's log under the error id."""
        try:
            if self._keys is not None:  # before anything else: no key, no answer, nothing counted
                refused = self._keys.refuse(request.headers.get("authorization"), self._model)
                if refused is not None:
                    return answer(*refusal(*refused))
            route = router_route(request.method, request.url.path, self._model)  # contracts.http_routes
            if route is None:
                return answer(*refusal(404, "use POST .../predict (or .../feedback, GET .../demand)"))
            if route.leaf == "demand":
                return await self._demand_answer(request)
            if route.leaf == "":
                return JSONResponse(self.state())
            if route.leaf == "feedback":
                return answer(*await self.feedback(await self._read_body(request)))
            source = request.headers.get(SOURCE_HEADER) or self._region
            if not valid_source(source):
                return answer(*refusal(400, f"{SOURCE_HEADER}: {source[:80]!r} is not a region name"))
            try:
                body = parse_request_body(await self._read_body(request), self._limits.max_json_depth)
            except BodyError as err:  # the caller's mistake: never counted against a set
                return answer(*refusal(err.status, err.message))
            raw_deadline = request.headers.get(DEADLINE_HEADER)
            deadline_s = caller_deadline(raw_deadline)
            if raw_deadline is not None and deadline_s is None:
                return answer(
                    *refusal(400, f"{DEADLINE_HEADER}: {raw_deadline[:40]!r} is not a positive number of ms")
                )
            self._demand[source] = self._demand.get(source, 0) + 1  # admitted: observed demand
            key, unit = body.get("key"), body.get("unit")
            if body.get("stream"):
                picked = self._pick(key, unit)
                if picked is None:  # as a plain 503, so the caller can go elsewhere
                    return answer(*self._no_set())
                shed = self._shed(picked, deadline_s)  # before the stream starts: a plain 503 too
                if shed is not None:
                    return answer(*shed)
                return StreamingResponse(
                    self._stream_events(body["inputs"], key, unit, deadline_s), media_type="text/event-stream"
                )
            return answer(*await self.predict(body["inputs"], key, unit=unit, deadline_s=deadline_s))
        except Exception as err:  # a bug of the router itself: say so without its insides
            return answer(*server_failure(500, "the router failed", err))

    async def _demand_answer(self, request: Request) -> JSONResponse:
        """GET .../demand[?window_seconds=60]: this region's observed demand by source, from the
        model's metrics actor (`ipnext.policy.demand.DemandReport`)."""
        raw = request.query_params.get("window_seconds", "60")
        try:
            window = float(raw)
        except ValueError:
            window = -1.0
        if not 0 < window <= 86_400:
            return answer(
                *refusal(400, f"window_seconds: {raw[:40]!r} is not a number of seconds in (0, 86400]")
            )
        try:
            stores = await asyncio.to_thread(find_stores, self._model, self._region)
            if not stores:
                raise ValueError(f"no metrics store for {self._model} in {self._region}")
            # The model's own store first: a model moving into a pool has its demand there so far.
            report: dict[str, Any] = await asyncio.wait_for(stores[0].demand.remote(window), timeout=10)
        except (ValueError, TimeoutError, ray.exceptions.RayError) as err:  # no store yet, or it died
            return answer(*server_failure(503, "no demand recorded in this region yet", err))
        return JSONResponse(report)

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with 413 past `max_body_bytes` before it is read whole (a declared
        length over the limit is refused before reading anything)."""
        limit = self._limits.max_body_bytes
        too_big = f"body: larger than {limit} bytes (router.max_body_bytes in the model's spec)"
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BodyError(413, too_big)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyError(413, too_big)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _stream_events(
        self, inputs: Any, key: str | None, unit: str | None, deadline_s: float | None
    ) -> AsyncIterator[str]:
        """Server-sent events: one envelope per piece of the final part's answer (a part
        without `stream` gives one piece); a failure is an event with `error_id`, `message` and
        `status`. If the client goes away, the part's stream is cancelled with this generator."""
        async for envelope in self.stream(inputs, key, unit=unit, deadline_s=deadline_s, admitted=True):
            yield f"data: {json.dumps(envelope)}\n\n"

    def _pick(self, key: str | None, unit: str | None = None) -> PickedApps | None:
        return pick_apps(self._config, set(self._routes), key, self._rng, unit)

    def _stamp_arm(self, picked: PickedApps, unit: str | None) -> dict[str, Any]:
        """What an answer says of the experiment (`router_feedback.stamp_arm`)."""
        return stamp_arm(self._config.experiment, self._keys, picked, unit)

    async def feedback(self, raw: bytes) -> tuple[dict[str, Any], int]:
        """POST .../feedback: outcomes counted once each (`router_feedback.take_feedback`)."""
        return await take_feedback(
            raw, self._model, self._config.experiment, self._keys, self._limits.max_json_depth, self._note
        )

    def _note(self, app: str, outcomes: dict[str, float], bucket: int | None = None) -> None:
        """Outcomes for set app `app` (feedback, a shadow comparison), counted with its other
        counters; feedback's in its unit's `bucket` too."""
        self._pusher.ensure_running()
        counters = self._counters.setdefault(app, SetCounters())
        for outcome, value in outcomes.items():
            counters.outcomes[outcome] = counters.outcomes.get(outcome, OutcomeTotals()).add(value, bucket)

    def _shadow(self, inputs: Any, outputs: Any) -> None:
        """Mirror an answered request to the shadow candidate, if one runs and draws it
        (`ShadowMirror`: after the answer, never part of it)."""
        shadow = self._config.shadow
        if shadow is None or self._rng.random() * 100 >= shadow.percent:
            return
        route = self._routes.get(shadow.app)
        deadline = self._limits.deadline_seconds

        async def run() -> Any:
            assert route is not None
            return (await run_dag(route, {}, inputs, self._rng, deadline)).outputs

        self._mirror.send(shadow, outputs, None if route is None else run, deadline)

    def _no_set(self) -> tuple[dict[str, Any], int]:
        """The 503 of a region with no serving set, marked so callers ask another region."""
        body, status = refusal(503, f"model {self._model} has no serving set in {self._region}")
        return {**body, "reason": NO_SET_REASON}, status

    def _count(self, app: str, latency_ms: float | None) -> None:
        """One request against set app `app`: its latency, or None for a failed one."""
        self._pusher.ensure_running()  # a metrics actor that went away: push to its successor
        counters = self._counters.setdefault(app, SetCounters())
        counters.requests += 1
        if latency_ms is None:
            counters.errors += 1
        else:
            counters.observe("latency_ms", latency_ms)
        self._prometheus.record(self._model, self._region, app, latency_ms)

    def admit(self, source: str | None) -> None:
        """Count a request from another door (the OpenAI door calls `predict` and `stream`
        through a handle) in this region's observed demand, by its source region."""
        if source is not None:
            self._demand[source] = self._demand.get(source, 0) + 1

    async def stream(
        self,
        inputs: Any,
        key: str | None = None,
        source: str | None = None,
        unit: str | None = None,
        deadline_s: float | None = None,
        admitted: bool = False,
    ) -> AsyncIterator[dict[str, Any]]:
        """The streaming `predict`: every part but the DAG's final one runs as usual, then the
        final part streams. Counted as one request (latency: first piece to last). Choice nodes
        pick the variants as for `predict`, but a failed variant is not retried on the fallback
        (pieces may have gone out already). The deadline covers the whole stream. `source`:
        a request from the OpenAI door, counted in observed demand here. Shed as `predict`
        sheds, unless the HTTP door `admitted` it already; its wait is learned from its first
        piece."""
        self.admit(source)
        deadline = asyncio.get_running_loop().time() + self._deadline(deadline_s)
        picked = self._pick(key, unit)
        if picked is None:
            body, status = self._no_set()
            yield {**body, "status": status}
            return
        shed = None if admitted else self._shed(picked, deadline_s)
        if shed is not None:
            yield {**shed[0], "status": shed[1]}
            return
        queue = self._routes[picked.counted].queue
        token: int | None = queue.started(time.monotonic(), self._deadline(deadline_s))
        try:
            async for envelope in self._stream(inputs, picked, unit, deadline):
                if token is not None:
                    queue.finished(token, time.monotonic(), completed="outputs" in envelope)
                    token = None
                yield envelope
        finally:  # a client gone (the generator closed) or a cancelled request too
            if token is not None:
                queue.finished(token, time.monotonic(), completed=False)

    async def _stream(
        self, inputs: Any, picked: PickedApps, unit: str | None, deadline: float
    ) -> AsyncIterator[dict[str, Any]]:
        set_id = self._routes[picked.counted].set_id
        arm = self._stamp_arm(picked, unit)  # one id for the whole stream
        dag = self._routes[picked.base]
        part_routes = {p: self._routes[a] for p, a in picked.part_apps.items()}
        attempt = Attempt(dag.variants.choose(inputs, time.monotonic()))
        plan = dag.variants.plan(attempt.chosen)
        variant = variant_label(attempt.chosen)
        finals = plan.upstream.get(DAG_OUTPUT, [])
        started = time.perf_counter()
        pieces: Any = None
        try:
            if len(finals) != 1:
                raise ValueError(f"streaming needs one part feeding the output, the DAG has {finals}")
            final = finals[0]
            async with asyncio.timeout_at(deadline):
                results = await run_parts(dag, part_routes, inputs, self._rng, attempt, skip=final)
            upstream = upstream_values(plan, final, results, inputs, dag.shard_groups)
            handle = part_routes.get(final, dag).handle(final, self._rng)
            pieces = handle.options(stream=True).stream.remote(upstream)
            while True:
                try:
                    async with asyncio.timeout_at(deadline):  # never around the yield below
                        reply = await anext(pieces)
                except StopAsyncIteration:
                    break
                attempt.stamps[final] = reply["snapshot_id"]
                output = jsonable(reply["output"])
                if not all_finite(output):
                    raise NonFiniteOutputsError()
                yield {
                    "outputs": output,
                    "set": set_id,
                    "parts": dict(attempt.stamps),
                    "variant": variant,
                    **arm,
                }
            pieces = None
        except PartInputError as err:  # the caller's mistake: not counted against the set
            body, status = refusal(400, part_cause(err))
            yield {**body, "status": status, "set": set_id}
            return
        except Exception as err:  # a part failed, or the deadline passed: count it, end the stream
            if attempt.failed_part is None and pieces is not None:
                attempt.failed_part = finals[0]
            self._count(picked.counted, None)
            body, status = self._failure(err, attempt.failed_part)
            yield {**body, "status": status, "set": set_id}
            return
        finally:
            if pieces is not None:  # the client went away, or the deadline passed: stop the part
                pieces.cancel()
            dag.variants.finish(attempt.chosen, attempt.stamps, attempt.failed_part, time.monotonic())
        self._count(picked.counted, (time.perf_counter() - started) * 1000)

    def _deadline(self, deadline_s: float | None) -> float:
        """A request's deadline in seconds: the caller's own when shorter than the model's."""
        return (
            self._limits.deadline_seconds
            if deadline_s is None
            else min(deadline_s, self._limits.deadline_seconds)
        )

    def _shed(self, picked: PickedApps, deadline_s: float | None) -> tuple[dict[str, Any], int] | None:
        """The 503 of a request shed for its expected queue wait in its set's queue
        (`policy.admission`), counted as shed for the set it would have run on; None: admitted."""
        wanted = self._limits.max_queue_wait_ms
        route = self._routes[picked.counted]
        admission = route.queue.admit(
            time.monotonic(),
            None if wanted is None else wanted / 1000,
            self._deadline(deadline_s),
            route.capacity_qps(),
        )
        if not admission.shed:
            return None
        self._pusher.ensure_running()
        self._counters.setdefault(picked.counted, SetCounters()).shed += 1
        self._prometheus.record_shed(self._model, self._region, picked.counted)
        return shed_answer(self._model, self._region, admission, self._limits.retry_after_seconds)

    async def predict(
        self,
        inputs: Any,
        key: str | None = None,
        source: str | None = None,
        unit: str | None = None,
        deadline_s: float | None = None,
    ) -> tuple[dict[str, Any], int]:
        """One request through the DAG, within the deadline (the router's, or the caller's own
        `deadline_s` when shorter). What counts against the set is the table of
        docs/architecture/contracts.md: a caller's mistake (400) does not; a part's failure, a
        part's full queue (503) and a passed deadline (504) do; a request shed at once for its
        expected queue wait (503, `reason: shed`) is counted as shed. `source` as for `stream`."""
        self.admit(source)
        picked = self._pick(key, unit)
        if picked is None:
            return self._no_set()
        shed = self._shed(picked, deadline_s)
        if shed is not None:
            return shed
        queue = self._routes[picked.counted].queue
        token, status = queue.started(time.monotonic(), self._deadline(deadline_s)), 0
        try:
            body, status = await self._predict(inputs, picked, unit, deadline_s)
        finally:  # cancelled too (the client went away): a token left behind would stand as a queue
            queue.finished(token, time.monotonic(), completed=status == 200)
        return body, status

    async def _predict(
        self, inputs: Any, picked: PickedApps, unit: str | None, deadline_s: float | None
    ) -> tuple[dict[str, Any], int]:
        deadline = self._deadline(deadline_s)
        set_id = self._routes[picked.counted].set_id  # the set the answer is counted against and stamped with
        started = time.perf_counter()
        try:
            part_routes = {p: self._routes[a] for p, a in picked.part_apps.items()}
            ran = await run_dag(self._routes[picked.base], part_routes, inputs, self._rng, deadline)
        except PartInputError as err:  # the caller's mistake: 400, not counted against the set
            body, status = refusal(400, part_cause(err))
            return {**body, "set": set_id}, status
        except Exception as err:  # a part failed (a NaN score too), or the deadline passed
            self._count(picked.counted, None)
            failed = err if isinstance(err, DagFailed) else DagFailed(err, None)
            body, status = self._failure(failed.cause, failed.failed_part)
            return {**body, "set": set_id}, status
        # A retry on the fallback saved the caller, but a part of the set failed this request:
        # the gates must see it, or a bad snapshot of a variant would roll out unnoticed.
        self._count(picked.counted, None if ran.retried else (time.perf_counter() - started) * 1000)
        envelope = {"outputs": ran.outputs, "set": set_id, "parts": ran.stamps}
        answer = {**envelope, "variant": ran.variant, **self._stamp_arm(picked, unit)}
        self._shadow(inputs, ran.outputs)  # after the answer is whole and its latency counted
        return answer, 200

    def _failure(self, err: Exception, failed_part: str | None) -> tuple[dict[str, Any], int]:
        return set_failure(err, failed_part, self._limits.deadline_seconds)


def router_app(args: dict[str, Any]) -> serve.Application:
    """Builder Serve imports for a router app. The args are validated here, once."""
    parsed = RouterAppArgs.model_validate(args)
    return Router.options(name=ROUTER_DEPLOYMENT).bind(parsed)  # type: ignore[attr-defined]
