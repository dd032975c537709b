"""What crosses a process boundary (the names and ids every tier shares are `ipnext.names`): each
workflow's inputs, record and results (`model`, `rollout`, `experiment`, `fleet`), the router's
config (`router`), freeze windows (`freeze`), request counters (`counters`), placement plans
(`plan`), the routing document (`routing`) and the operator identity header (`identity`).

Frozen pydantic models end to end; contracts import specs and each other, never a policy."""

__all__ = [
    "counters",
    "experiment",
    "fleet",
    "freeze",
    "identity",
    "model",
    "plan",
    "rollout",
    "router",
    "routing",
]
