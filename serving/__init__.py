"""Serving on Ray Serve: a router app per (model, region), a set app per snapshot set, one
writer that owns the whole declarative Serve config, and a metrics actor per (model, region).

Ray Serve imports the app builders by the paths `ipnext.serving.layout` renders
(`set_app:set_app`, `router:router_app`); the router's pure decisions are in `traffic`,
its figures go out through `export`; the worker drives everything through
`ipnext.serving.control`.
"""

__all__ = [
    "app_health",
    "apps",
    "choices",
    "control",
    "export",
    "layout",
    "llm",
    "metrics",
    "openai_api",
    "openai_door",
    "request_body",
    "router",
    "routing_app",
    "set_app",
    "shadow_mirror",
    "traffic",
]
