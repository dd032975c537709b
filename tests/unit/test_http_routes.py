"""The route table (`ipnext.contracts.http_routes.ROUTES`) against the real apps that serve it:
every router route reaches its handler in the real `Router`, every routing route in the real
`RoutingService`, and what the table does not list gets each app's 404 (or 405). The docs' HTTP
reference is generated from the same table, so the page, the table and the apps agree."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.requests import Request

from ipnext.contracts.http_routes import ROUTES, HttpRoute, router_leaf, router_route
from ipnext.serving.routing_app import RoutingService

from .test_router_doors import build, reply  # noqa: F401  (the fixture, with fake part handles)

ROUTER_FALLBACK = "use POST .../predict"
ROUTING_FALLBACK = ("use GET /models/<name>/routing", "use GET /models/")
BODIES = {
    "predict": {"inputs": {"user": 1}},
    "feedback": {"request_id": "forged", "outcome": {"click": 1}},
}


def _request(method: str, path: str, body: dict[str, Any] | None = None) -> Request:
    raw = json.dumps(body).encode() if body is not None else b""

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": "",
        "query_string": b"",
        "headers": [],
    }
    return Request(scope, receive)


def _concrete(route: HttpRoute) -> str:
    return route.path.replace("{region}", "us-east").replace("{model}", "m")


def _message(response: Any) -> str:
    try:
        answer = json.loads(bytes(response.body))
    except ValueError:
        return ""
    if isinstance(answer, dict):
        error = answer.get("error")
        return str(answer.get("message") or (error.get("message") if isinstance(error, dict) else "") or "")
    return ""


def test_the_table_is_whole_and_its_paths_unique() -> None:
    assert len({(r.method, r.path) for r in ROUTES}) == len(ROUTES)
    assert {r.app for r in ROUTES} == {"router", "routing", "serve"}
    for route in ROUTES:
        assert route.path.startswith("/") and route.what and route.answers
        assert (route.leaf is not None) == (route.app == "router"), route


@pytest.mark.parametrize(
    "route", [r for r in ROUTES if r.app == "router"], ids=lambda r: f"{r.method} {r.path}"
)
async def test_every_router_route_reaches_its_handler(build: Any, route: HttpRoute) -> None:  # noqa: F811
    router, _, _ = build(reply({"u": 1}), reply([0.5]))

    async def demand_read(request: Request) -> Any:  # its real read asks the metrics actor (Ray)
        from starlette.responses import JSONResponse

        return JSONResponse({"demand": "read"})

    router._demand_answer = demand_read
    path = _concrete(route)
    assert router_route(route.method, path, "m") == route
    assert router_route(route.method, path.removeprefix("/us-east/models/m"), "m") == route  # prefix stripped
    response = await router(_request(route.method, path, BODIES.get(route.leaf or "")))
    assert not _message(response).startswith(ROUTER_FALLBACK), (route, _message(response))
    if route.leaf == "predict":
        assert response.status_code == 200 and json.loads(response.body)["outputs"] == [0.5]
    if route.leaf == "":
        assert json.loads(response.body)["model"] == "m"
    if route.leaf == "demand":
        assert json.loads(response.body) == {"demand": "read"}


@pytest.mark.parametrize(
    ("method", "leaf"),
    [
        ("GET", "predict"),
        ("GET", "feedback"),
        ("POST", "demand"),
        ("POST", ""),
        ("GET", "nope"),
        ("POST", "predict/x"),
    ],
)
async def test_a_route_not_in_the_table_gets_the_routers_404(
    build: Any,  # noqa: F811
    method: str,
    leaf: str,
) -> None:
    router, _, _ = build(reply({"u": 1}), reply([0.5]))
    path = "/us-east/models/m" + (f"/{leaf}" if leaf else "")
    assert router_route(method, path, "m") is None
    response = await router(_request(method, path, {"inputs": {"user": 1}}))
    assert response.status_code == 404 and _message(response).startswith(ROUTER_FALLBACK)


def test_the_leaf_is_what_follows_the_mount() -> None:
    assert router_leaf("/us-east/models/m/predict", "m") == "predict"
    assert router_leaf("/predict", "m") == "predict"
    assert router_leaf("/us-east/models/m/", "m") == ""


@pytest.mark.parametrize(
    "route", [r for r in ROUTES if r.app == "routing"], ids=lambda r: f"{r.method} {r.path}"
)
async def test_every_routing_route_reaches_its_handler(route: HttpRoute) -> None:
    service = RoutingService.func_or_class()  # type: ignore[attr-defined]
    for path in (_concrete(route), *([f"/us-east{route.path}"] if route.path.startswith("/v1/") else [])):
        chat = path.endswith("/chat/completions")
        body = {
            "model": "m",
            **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}),
        }
        response = await service(_request(route.method, path, body if route.method == "POST" else None))
        message = _message(response)
        assert not message.startswith(ROUTING_FALLBACK), (path, message)
        assert response.status_code != 405, (path, message)
        if route.path.startswith("/v1/") and route.method == "POST":
            assert response.status_code == 404 and "m" in message  # no such model: the door's own answer


async def test_what_the_table_does_not_list_gets_the_routing_apps_404_or_405() -> None:
    service = RoutingService.func_or_class()  # type: ignore[attr-defined]
    for method, path in (("GET", "/nothing/here"), ("POST", "/models/m/routing"), ("POST", "/metrics")):
        assert not any(r.method == method and r.path == path.replace("/m/", "/{model}/") for r in ROUTES)
        response = await service(_request(method, path, {}))
        assert response.status_code in (404, 405), (method, path)
