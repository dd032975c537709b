"""The routing app (`ipnext.serving.routing_app:routing_app`): answers `GET /models/<name>/routing`
with the model's routing document, so prediction clients find a serving region with no
control-plane call. The documents are its `user_config`, written by the Serve config writer;
a change is applied in place by `reconfigure`.

Its route prefix is `/`: it also answers every path no router claims, which is where the
OpenAI door lives (`/v1/...`, `/<region>/v1/...`; `serving/openai_door.py`) and `GET /metrics`,
the one metrics door (ipnext's `ipnext_*` series and the LLM engines' figures under vLLM's
names, from every model's metrics actors), since both need what this app holds: every model's
routing document and the API keys file.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ipnext.contracts.routing import RoutingTable, routing_model_of
from ipnext.errors import ServingError
from ipnext.names import Frozen, PollTimeoutError, wait_until
from ipnext.serving.config_store import resolve
from ipnext.serving.control import wait_generation
from ipnext.serving.layout import ROUTING_APP, ROUTING_DEPLOYMENT
from ipnext.serving.llm.vllm_metrics import EngineStats, render
from ipnext.serving.metrics_hub import find_stores
from ipnext.serving.openai_door import OpenAIDoor, openai_route
from ipnext.serving.prometheus_text import ActorFigures, SeriesState, gather_figures, render_series
from ipnext.store.keys import KeyCheck

__all__ = [
    "METRICS_PATH",
    "METRICS_WAIT_S",
    "RoutingAppArgs",
    "RoutingService",
    "metrics_exposition",
    "routing_app",
    "wait_routing_generation",
]

METRICS_PATH = "/metrics"
OPERATOR_MODELS = "*"  # a key may read every model's figures when it may call every model
# How long a scrape waits for all the metrics actors together: well inside Prometheus' default
# 10 s scrape_timeout, so a slow actor costs its own series (`ipnext_metrics_actor_up` 0), never
# the whole scrape.
METRICS_WAIT_S = 3.0


class RoutingAppArgs(Frozen):
    """What it serves is `user_config`; fixed for its life is only the API keys file it checks
    requests against (None: open), which the writer sets (`layout.with_keys_file`)."""

    keys_file: str | None = None


@serve.deployment(ray_actor_options={"num_cpus": 0})
class RoutingService:
    def __init__(self, keys_file: str | None = None) -> None:
        self._table = RoutingTable()
        self._keys = KeyCheck(Path(keys_file)) if keys_file is not None else None
        self._door = OpenAIDoor(self._keys)

    def reconfigure(self, config: dict[str, Any]) -> None:
        # Every model's document: the writer keeps the table in Ray's KV store and Serve a
        # reference (config_store.py).
        self._table = RoutingTable.model_validate(resolve(config))

    def generation(self, model: str) -> int:
        """The generation of the model's document here (0: none)."""
        document = self._table.documents.get(model)
        return document.generation if document is not None else 0

    async def __call__(self, request: Request) -> Response:
        openai = openai_route(request.url.path)
        if openai is not None:  # the door asks for the key first, and answers in OpenAI's shape
            return await self._door.answer(request, openai[0], openai[1], self._table)
        if self._keys is not None:  # every other route: no known key, 401 before anything else
            unknown = self._keys.refuse_unknown(request.headers.get("authorization"))
            if unknown is not None:
                return JSONResponse({"message": unknown[1]}, status_code=unknown[0])
        if request.url.path.rstrip("/") == METRICS_PATH:
            return await self._metrics(request)
        model = routing_model_of(request.url.path, request.scope.get("root_path", ""))
        if model is None:
            return JSONResponse(
                {"message": "use GET /models/<name>/routing, /<region>/models/<name>/predict or /v1/..."},
                status_code=404,
            )
        if request.method != "GET":
            return JSONResponse({"message": f"use GET /models/{model}/routing"}, status_code=405)
        if self._keys is not None:  # a model's document names its regions and sets: keys only
            refused = self._keys.refuse(request.headers.get("authorization"), model)
            if refused is not None:
                return JSONResponse({"message": refused[1]}, status_code=refused[0])
        document = self._table.documents.get(model)
        if document is None:
            return JSONResponse(
                {
                    "message": f"model {model!r} has no routing document: it is not registered, "
                    "or serves nowhere yet"
                },
                status_code=404,
            )
        return JSONResponse(document.model_dump(mode="json"))

    async def _metrics(self, request: Request) -> Response:
        """GET /metrics: ipnext's own series (`ipnext_*`) and every generative model's engine
        figures under vLLM's names, from each (model, region) metrics actor of the routing table,
        in Prometheus' text format (`metrics_exposition`). With API keys on, only for an
        operator's key (one whose models are "*")."""
        if request.method != "GET":
            return JSONResponse({"message": "use GET /metrics"}, status_code=405)
        if self._keys is not None:
            refused = self._keys.refuse(request.headers.get("authorization"), OPERATOR_MODELS)
            if refused is not None:
                message = (
                    refused[1]
                    if refused[0] != 403
                    else "GET /metrics needs an operator's key (models: ['*'])"
                )
                return JSONResponse({"message": message}, status_code=refused[0])
        body = await metrics_exposition(self._table, _ask_actor, METRICS_WAIT_S)
        return Response(body, media_type=CONTENT_TYPE_LATEST)


async def metrics_exposition(
    table: RoutingTable,
    ask: Callable[[str, str, bool], Awaitable[ActorFigures | None]],
    wait_s: float,
) -> bytes:
    """The exposition of every model's figures: each region its document routes to has a
    metrics actor, all asked at once within `wait_s` (`gather_figures`).

    An actor that is missing, fails or is slow leaves out its own series (each carries its
    region), says so in `ipnext_metrics_actor_up` and a comment, and leaves out its model's
    vLLM figures too: those are summed over regions under one `model_name`, and a sum short of
    one region would go down, which Prometheus reads as a counter reset. The rest answer."""
    targets = [
        (name, region, document.generative)
        for name, document in sorted(table.documents.items())
        for region in sorted({r for row in document.routes.values() for r in row})
    ]
    answered, missing = await gather_figures(targets, ask, wait_s)
    incomplete = {model for model, _ in missing}
    by_model: dict[str, EngineStats] = {}
    series = SeriesState()
    notes = {target: f"left out: {why}" for target, why in missing.items()}
    for (model, region), figures in sorted(answered.items()):
        if figures.series is not None:
            series = series.plus(figures.series)
        else:
            notes[model, region] = "answered without ipnext series (a metrics actor of an older version)"
        if figures.engine_stats is not None and model not in incomplete:
            stats = EngineStats.model_validate(figures.engine_stats)
            by_model[model] = by_model[model].plus(stats) if model in by_model else stats
    up = {target: True for target in answered} | {target: False for target in missing}
    return render(by_model) + render_series(series, up, notes)


async def _ask_actor(model: str, region: str, generative: bool) -> ActorFigures | None:
    """What the (model, region) metrics actor holds: its series and, for a generative model, its
    engine figures (None: there is no actor). Its errors are the scrape's to report."""
    stores = await asyncio.to_thread(find_stores, model, region)
    if not stores:  # no store: the model never served there
        return None
    actor = stores[0]  # its own actor first; a pooled model's store in its region's hub
    stats = actor.engine_stats.remote() if generative else None
    try:
        series: SeriesState | None = SeriesState.model_validate(await actor.series.remote())
    except AttributeError:  # an actor of an older version, made before series existed
        series = None
    return ActorFigures(series=series, engine_stats=await stats if stats is not None else None)


def routing_app(args: dict[str, Any]) -> serve.Application:
    """Builder Serve imports for the routing app."""
    parsed = RoutingAppArgs.model_validate(args)
    return RoutingService.options(name=ROUTING_DEPLOYMENT).bind(parsed.keys_file)  # type: ignore[attr-defined]


def wait_routing_generation(model: str, generation: int, timeout_s: float) -> None:
    """Block until the routing app serves the model's document at `generation` or later (for
    0: serves none for it)."""
    handle: Any = None

    def current() -> int:
        nonlocal handle
        if handle is None:
            try:
                handle = serve.get_deployment_handle(ROUTING_DEPLOYMENT, app_name=ROUTING_APP)
            except KeyError:  # the app is still being deployed (a concurrent publish created it)
                return -1
        answer: int = handle.generation.remote(model).result(timeout_s=timeout_s)
        return answer

    if generation:
        wait_generation(ROUTING_APP, current, generation, timeout_s)
        return
    try:  # a withdrawn document: its generation goes back to 0
        wait_until(current, lambda g: g == 0, timeout_s=timeout_s, interval_s=0.1)
    except PollTimeoutError as err:
        raise ServingError(f"routing app still at generation {err.last} of {model}, not 0") from None
