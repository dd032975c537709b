"""The routing app (`ipnext.serving.routing_app:routing_app`): answers `GET /models/<name>/routing`
with the model's routing document, so prediction clients find a serving region with no
control-plane call. The documents are its `user_config`, written by the Serve config writer;
a change is applied in place by `reconfigure`.

Its route prefix is `/`: it also answers every path no router claims, which is where the
OpenAI door lives (`/v1/...`, `/<region>/v1/...`; `serving/openai_door.py`), since the door
needs what this app holds: every model's routing document and the API keys file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ipnext.auth import KeyCheck
from ipnext.contracts import Frozen, PollTimeoutError, wait_until
from ipnext.errors import ServingError
from ipnext.routing import RoutingTable, routing_model_of
from ipnext.serving.control import wait_generation
from ipnext.serving.layout import ROUTING_APP, ROUTING_DEPLOYMENT
from ipnext.serving.openai_door import OpenAIDoor, openai_route

__all__ = ["RoutingAppArgs", "RoutingService", "routing_app", "wait_routing_generation"]


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
        self._table = RoutingTable.model_validate(config)

    def generation(self, model: str) -> int:
        """The generation of the model's document here (0: none)."""
        document = self._table.documents.get(model)
        return document.generation if document is not None else 0

    async def __call__(self, request: Request) -> Response:
        openai = openai_route(request.url.path)
        if openai is not None:
            return await self._door.answer(request, openai[0], openai[1], self._table)
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
