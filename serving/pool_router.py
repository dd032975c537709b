"""The pool router app Serve builds for one region: the HTTP entry of every pooled model there.
It holds one `Router` per model, as a dedicated router app would run it (its own routing,
admission, counters, gates' figures, experiments and shadows), but in one process, and each
model's parts are called as entries of the region's pool apps instead of deployments of the
model's own set apps. `pool_router_app` is the builder the rendered Serve config imports by path
(`pool_layout.POOL_ROUTER_IMPORT_PATH`).

One model's failures stay its own: each model's `Router` counts its requests against its own
set apps, so a bad snapshot trips only its model's gates; a part refused by the pool (quarantined)
fails that model's requests, never another's. One model's load stays its own too: each model
holds its router's `max_ongoing_requests` slots per pool router replica and queues at most its
`max_queued_requests` (`model_slots.ModelSlots`); past that its requests are refused with a 503,
and its pool-mates' requests never wait behind them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ipnext.serving.answers import answer, refusal
from ipnext.serving.config_store import resolve
from ipnext.serving.export import METRICS_PUSH_SECONDS, RouterPrometheus, process_series
from ipnext.serving.layout import (
    ROUTER_DEPLOYMENT,
    RouterAppArgs,
    SetDescription,
    metrics_actor_name,
    part_deployment_name,
)
from ipnext.serving.metrics_hub import hub_actor
from ipnext.serving.model_slots import ModelSlots, SlotsFull
from ipnext.serving.pool_layout import (
    POOL_DEPLOYMENT,
    PooledRouter,
    PooledSet,
    PoolRouterArgs,
    PoolRouterConfig,
    pool_app_name,
    pool_entry_id,
    pooled_model,
)
from ipnext.serving.router import Router, describe_set_app
from ipnext.serving.set_routes import DEDICATED

__all__ = ["PoolRouter", "PooledSets", "pool_router_app"]

logger = logging.getLogger("ray.serve")


class PooledSets:
    """How a pooled model's router reaches its sets: each part of a set app is an entry of the
    pool of its hardware class in the region, called with the entry's multiplexed model id; a
    set is described from the pool router's config, not by an ingress of its own. A set app the
    config does not name is a dedicated one, reached as a dedicated router reaches it (a model
    whose spec moved it into the pool routes to its old, dedicated set during the rollout)."""

    def __init__(self, region: str) -> None:
        self.region = region
        self.hub_region: str | None = region
        self.config = PoolRouterConfig()
        self._pools: dict[str, DeploymentHandle] = {}

    def handle(self, app: str, part: str, deployment: str) -> DeploymentHandle:
        pooled = self.config.sets.get(app)
        if pooled is None:  # a dedicated set app (a model moving into the pool still serves one)
            return DEDICATED.handle(app, part, deployment)
        [hardware] = [hw for hw in pooled.args.hardware[part] if part_deployment_name(part, hw) == deployment]
        name = pool_app_name(self.region, hardware)
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = serve.get_deployment_handle(POOL_DEPLOYMENT, app_name=name)
        return pool.options(multiplexed_model_id=pool_entry_id(app, part))

    async def describe(self, app: str) -> SetDescription | None:
        """The set as the config holds it; a set app it does not name is a dedicated one,
        which describes itself (None: it does not answer: removed, or not up yet)."""
        pooled = self.config.sets.get(app)
        return pooled.describe() if pooled is not None else await describe_set_app(app)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class PoolRouter:
    """Every pooled model of one region: a `Router` each, reconfigured from one config."""

    def __init__(self, args: PoolRouterArgs) -> None:
        self._args = args
        self._sets = PooledSets(args.region)
        self._routers: dict[str, Router] = {}
        self._specs: dict[str, RouterAppArgs] = {}
        self._slots: dict[str, ModelSlots] = {}  # each model's caps in this replica
        self._pushing: asyncio.Task[None] | None = None
        self._prometheus = RouterPrometheus()  # shared by every model's router here
        # Each model's routing and sets as its router last applied them.
        self._applied: dict[str, tuple[PooledRouter, dict[str, PooledSet | None]]] = {}

    async def reconfigure(self, config: dict[str, Any]) -> None:
        """Each model's router takes its routing in place (a model new here gets a router, a
        model whose router section changed a new one, a model gone is closed). The sets are
        replaced first, so every router finds the sets its new routing names."""
        # The writer keeps the config in Ray's KV store and Serve a reference (config_store.py).
        parsed = PoolRouterConfig.model_validate(await asyncio.to_thread(resolve, config))
        self._sets.config = parsed
        for model in sorted(set(self._routers) - set(parsed.routers)):
            self._routers.pop(model).close()
            self._specs.pop(model)
            self._slots.pop(model, None)
        for model, pooled in sorted(parsed.routers.items()):
            spec = RouterAppArgs(
                model=model, region=self._args.region, router=pooled.router, keys_file=self._args.keys_file
            )
            if self._specs.get(model) != spec:
                if model in self._routers:
                    self._routers.pop(model).close()
                router_class: Any = Router.func_or_class  # type: ignore[attr-defined]
                self._routers[model] = router_class(
                    spec, self._sets, self._sets.describe, pushes=False, prometheus=self._prometheus
                )
                self._specs[model] = spec
                # Requests holding the old slots finish on them; new ones take the new caps.
                self._slots[model] = ModelSlots(
                    pooled.router.max_ongoing_requests, pooled.router.max_queued_requests
                )
                self._applied.pop(model, None)  # a new router: it takes its routing whatever it was
        # Only the routers whose routing or sets changed: a pool router of hundreds of models is
        # reconfigured at every model's deploy, and each of those changes one model.
        changed = [
            model
            for model, pooled in parsed.routers.items()
            if self._applied.get(model) != (pooled, self._sets_of(pooled, parsed))
        ]
        await asyncio.gather(
            *(self._routers[m].reconfigure(parsed.routers[m].config.model_dump(mode="json")) for m in changed)
        )
        self._applied = {m: (p, self._sets_of(p, parsed)) for m, p in parsed.routers.items()}
        if self._pushing is None or self._pushing.done():
            self._pushing = asyncio.create_task(self._push_forever())

    @staticmethod
    def _sets_of(pooled: PooledRouter, config: PoolRouterConfig) -> dict[str, PooledSet | None]:
        return {app: config.sets.get(app) for app in sorted(pooled.config.apps())}

    async def _push_forever(self) -> None:
        """Every METRICS_PUSH_SECONDS, every model's counters, demand and series in one call to
        the region's metrics hub (`MetricsHub.push_many`), where each model's router of its own
        would make three calls to an actor of its own. A hub that died is made again (Ray
        restarts it empty; each push carries the cumulative figures, so the next refills it)."""
        region = self._args.region
        series = process_series()
        hub: Any = None
        while True:
            await asyncio.sleep(METRICS_PUSH_SECONDS)
            pushes = {}
            for model, router in list(self._routers.items()):
                store = metrics_actor_name(model, region)
                counters, demand = router.figures()
                tally = series.get(store)
                pushes[store] = {
                    "replica": router.replica_key,
                    "counters": counters,
                    "demand": demand,
                    "series": tally.state().model_dump() if tally is not None else None,
                }
            if not pushes:
                continue
            try:
                hub = hub if hub is not None else hub_actor(region)
                await hub.push_many.remote(series.key, pushes)
            except ray.exceptions.RayError as err:
                logger.warning(
                    "pool router %s: metrics hub unreachable (%r); next push tries again", region, err
                )
                hub = None

    async def generation(self, model: str) -> int:
        """The routing generation `model`'s router applied (0: no router here for it)."""
        router = self._routers.get(model)
        return router.generation() if router is not None else 0

    async def __call__(self, request: Request) -> Response:
        model = pooled_model(request.url.path, self._args.region)
        router = self._routers.get(model or "")
        if router is None:
            return answer(*refusal(404, f"no pooled model {model!r} in {self._args.region}"))
        try:
            release = await self._slots[model or ""].take()
        except SlotsFull as full:
            return answer(*self._full(model or "", full))
        try:
            response = await router(request)
        except BaseException:
            release()
            raise
        if isinstance(response, StreamingResponse):  # the slot is held until the stream ends
            response.body_iterator = _released_after(response.body_iterator, release)
        else:
            release()
        return response

    async def predict(self, model: str, inputs: Any, **options: Any) -> tuple[dict[str, Any], int]:
        """`Router.predict` of `model` (the OpenAI door and tests call it over a handle)."""
        router = self._routers.get(model)
        if router is None:
            return refusal(404, f"no pooled model {model!r} in {self._args.region}")
        try:
            async with self._slots[model].slot():
                return await router.predict(inputs, **options)
        except SlotsFull as full:
            return self._full(model, full)

    def _full(self, model: str, full: SlotsFull) -> tuple[dict[str, Any], int]:
        """A request over its model's caps: refused at once, told when to come back."""
        body, status = refusal(503, f"model {model!r}: {full}; try again later")
        body["retry_after"] = self._specs[model].router.retry_after_seconds
        return body, status

    async def pending(self, set_apps: list[str]) -> list[str]:
        """What keeps the named sets from serving here, one line each (none: they serve): a set
        not in this replica's config yet, or a pool whose replica lacks one of its parts."""
        waiting = []
        for app in set_apps:
            pooled = self._sets.config.sets.get(app)
            if pooled is None:
                waiting.append(f"{app}: not in the pool router's config yet")
                continue
            by_pool: dict[str, list[str]] = {}
            for part, by_hw in pooled.replicas.items():
                for hw in by_hw:
                    by_pool.setdefault(pool_app_name(self._args.region, hw), []).append(
                        pool_entry_id(app, part)
                    )
            for pool, entries in sorted(by_pool.items()):
                handle = serve.get_deployment_handle(POOL_DEPLOYMENT, app_name=pool)
                missing: list[str] = await handle.missing.remote(entries)
                if missing:
                    waiting.append(f"{pool}: no entry yet for {', '.join(missing)}")
        return waiting

    async def state(self, model: str) -> dict[str, Any]:
        router = self._routers.get(model)
        return router.state() if router is not None else {}


async def _released_after(pieces: AsyncIterable[Any], release: Callable[[], None]) -> AsyncIterator[Any]:
    """A stream's pieces; `release` once it ends, fails, or its caller goes away."""
    try:
        async for piece in pieces:
            yield piece
    finally:
        release()


def pool_router_app(args: dict[str, Any]) -> serve.Application:
    """Builder Serve imports for a pool router app. The args are validated here, once."""
    parsed = PoolRouterArgs.model_validate(args)
    return PoolRouter.options(name=ROUTER_DEPLOYMENT).bind(parsed)  # type: ignore[attr-defined]
