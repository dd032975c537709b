"""Every HTTP route ipnext serves on the Serve port: the one table the routers dispatch on, the
docs' HTTP reference is generated from, and the tests drive route by route.

Two kinds of app answer them (`serving/`): a **router** per (model, region), mounted at
`/<region>/models/<model>`, and the one **routing** app (routing documents, the OpenAI door,
the engine metrics). Serve's own `/-/healthz` and `/-/routes` are Serve's, listed for
completeness. Pure data and matching; nothing here imports the serving code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "DEADLINE_HEADER",
    "NO_SET_REASON",
    "ROUTES",
    "SHED_REASON",
    "HttpRoute",
    "router_leaf",
    "router_route",
]

# A router's 503 when its model has no serving set in its region (`{error_id, message, reason}`):
# the region cannot answer yet (a returning region before its set runs there), so a caller with
# other regions asks the next one (`ipnext.client.prediction`), as for a region it cannot reach.
NO_SET_REASON = "no_serving_set"
# A router's 503 for a request shed at once: its expected queue wait is more than it can use
# (`ipnext.policy.admission`); the answer has `retry_after` and a Retry-After header (seconds).
SHED_REASON = "shed"
# The caller's own deadline, in ms from when it sent the request: the router sheds a request that
# would wait past it and answers 504 once it passes (never later than the model's deadline).
DEADLINE_HEADER = "x-ipnext-deadline-ms"

App = Literal["router", "routing", "serve"]


@dataclass(frozen=True)
class HttpRoute:
    """One route: its method and path (`{region}`, `{model}` stand for names), the app that
    answers it, the leaf under a router's mount (routers only), what it does, and what it
    answers."""

    method: Literal["GET", "POST"]
    path: str
    app: App
    what: str
    answers: str
    leaf: str | None = None  # under /<region>/models/<model>: "" for the mount itself


ROUTES: tuple[HttpRoute, ...] = (
    HttpRoute(
        "POST",
        "/{region}/models/{model}/predict",
        "router",
        "a prediction: `{inputs, key?, unit?, stream?}`; the router picks the set and runs the "
        "whole DAG on it",
        "the envelope `{outputs, set, parts, variant, arm}` (`request_id` in an experiment); "
        "with `stream: true`, server-sent events, one envelope per piece",
        leaf="predict",
    ),
    HttpRoute(
        "POST",
        "/{region}/models/{model}/feedback",
        "router",
        "an experiment's outcome for an answer: `{request_id, outcome: {name: number}}`",
        "`{experiment, arm, recorded}`; 410 once the experiment ended, 400 for a forged id",
        leaf="feedback",
    ),
    HttpRoute(
        "GET",
        "/{region}/models/{model}/demand",
        "router",
        "the region's observed demand by source, `?window_seconds=60`",
        "a `DemandReport`: requests, rate over the last ended window, peak, per source",
        leaf="demand",
    ),
    HttpRoute(
        "GET",
        "/{region}/models/{model}",
        "router",
        "the router's state",
        "`{model, region}` and its router config (generation, weights, experiment, shadow); with "
        "choice nodes, `variants`: per set app and choice node, what this replica routed",
        leaf="",
    ),
    HttpRoute(
        "GET",
        "/models/{model}/routing",
        "routing",
        "the model's routing document (what clients cache to pick a region)",
        "`{model, generation, ttl_seconds, routes: {source: {region: fraction}}, plan_revision}`; "
        "404 naming the model when it has none",
    ),
    HttpRoute(
        "GET",
        "/v1/models",
        "routing",
        "the OpenAI door: the generative models this key may call (also `/{region}/v1/models`)",
        "OpenAI's model list",
    ),
    HttpRoute(
        "POST",
        "/v1/completions",
        "routing",
        "the OpenAI door: a completion (also `/{region}/v1/completions`); `stream: true` streams",
        "OpenAI's completion object or its stream; errors in OpenAI's error shape",
    ),
    HttpRoute(
        "POST",
        "/v1/chat/completions",
        "routing",
        "the OpenAI door: a chat completion with the model's chat template "
        "(also `/{region}/v1/chat/completions`)",
        "OpenAI's chat completion object or its stream; `system_fingerprint` is the set",
    ),
    HttpRoute(
        "GET",
        "/metrics",
        "routing",
        "every generative model's engine figures under vLLM's names (an operator's key)",
        "Prometheus' text format",
    ),
    HttpRoute("GET", "/-/healthz", "serve", "Serve's proxy health (no key)", "`success`"),
    HttpRoute("GET", "/-/routes", "serve", "Serve's route table (no key)", "route prefix -> app name"),
)


def router_leaf(path: str, model: str) -> str:
    """The part of a router's request path under its mount, `/<region>/models/<model>`, whether
    Serve hands the router the whole path or only what follows its prefix."""
    mount = f"/models/{model}"
    at = path.rfind(mount)
    rest = path[at + len(mount) :] if at >= 0 else path
    return rest.strip("/")


def router_route(method: str, path: str, model: str) -> HttpRoute | None:
    """The router route a request is for; None when there is none (the router answers 404)."""
    leaf = router_leaf(path, model)
    for route in ROUTES:
        if route.app == "router" and route.method == method and route.leaf == leaf:
            return route
    return None
