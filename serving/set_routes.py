"""A router's view of each set app it routes to (`SetRoute`): the set's DAG, its choice nodes,
and a handle per part deployment weighted by the capacity each runs now; and how a router
reaches its set apps (`SetAccess`): dedicated set apps on Serve, or entries of shared pools."""

from __future__ import annotations

import random
from typing import Protocol

from ray import serve
from ray.serve.handle import DeploymentHandle

from ipnext.policy.admission import QueueDelay
from ipnext.serving.choices import VariantRouter
from ipnext.serving.layout import SetDescription

__all__ = ["DEDICATED", "MIN_KNOWN_QPS", "DedicatedSets", "SetAccess", "SetRoute"]

# Below this a part's capacity is a placeholder (no replica running: its weight is floored at
# 1e-9 so the draw among its deployments stays defined), not a capacity.
MIN_KNOWN_QPS = 1e-6


class SetAccess(Protocol):
    """How a router reaches a set app's part deployments (`handle`); a router of a shared pool
    also learns its sets from its own config instead of asking each set's ingress."""

    hub_region: str | None  # a pooled model's metrics live in its region's hub (serving.metrics_hub)

    def handle(self, app: str, part: str, deployment: str) -> DeploymentHandle: ...


class DedicatedSets:
    """A model's own set apps on Serve: a deployment per (part, hardware) in each set app."""

    hub_region: str | None = None

    def handle(self, app: str, part: str, deployment: str) -> DeploymentHandle:
        return serve.get_deployment_handle(deployment, app_name=app)


DEDICATED = DedicatedSets()


class SetRoute:
    """A router's view of one set app: its DAG, its choice nodes, a handle per part deployment,
    and the queue its requests wait in (`queue`: what admission by time reads)."""

    def __init__(
        self, app: str, described: SetDescription, variants: VariantRouter, access: SetAccess = DEDICATED
    ) -> None:
        self.app = app
        self.set_id = described.set_id
        self.variants = variants
        self.shard_groups = described.shard_groups
        self.queue = QueueDelay()
        self.deployments: dict[str, tuple[list[DeploymentHandle], list[float]]] = {}
        for part, capacity in described.deployments.items():
            names = sorted(capacity)
            handles = [access.handle(app, part, n) for n in names]
            self.deployments[part] = (handles, [max(capacity[n], 1e-9) for n in names])

    def follow(self, described: SetDescription) -> None:
        """Take the set's capacity per part deployment as its ingress now reads it (the replicas
        Serve runs); the handles stay."""
        for part, (handles, _) in list(self.deployments.items()):
            capacity = described.deployments.get(part, {})
            names = sorted(capacity)
            if len(names) == len(handles):
                self.deployments[part] = (handles, [max(capacity[n], 1e-9) for n in names])

    def capacity_qps(self) -> float | None:
        """What the set serves per second as planned: its slowest part's replicas running now
        times each one's declared qps; None while a part runs none (starting, or coming back
        after Ray was lost: its requests wait for the replicas, and that is not a queue to shed
        on, or every request would be shed until the next capacity refresh)."""
        slowest = min((sum(weights) for _, weights in self.deployments.values()), default=0.0)
        return slowest if slowest >= MIN_KNOWN_QPS else None

    def handle(self, part: str, rng: random.Random) -> DeploymentHandle:
        handles, weights = self.deployments[part]
        return handles[0] if len(handles) == 1 else rng.choices(handles, weights)[0]
