"""A router's view of each set app it routes to (`SetRoute`): the set's DAG, its choice nodes,
and a handle per part deployment weighted by the capacity each runs now."""

from __future__ import annotations

import random

from ray import serve
from ray.serve.handle import DeploymentHandle

from ipnext.policy.admission import QueueDelay
from ipnext.serving.choices import VariantRouter
from ipnext.serving.layout import SetDescription

__all__ = ["MIN_KNOWN_QPS", "SetRoute"]

# Below this a part's capacity is a placeholder (no replica running: its weight is floored at
# 1e-9 so the draw among its deployments stays defined), not a capacity.
MIN_KNOWN_QPS = 1e-6


class SetRoute:
    """A router's view of one set app: its DAG, its choice nodes, a handle per part deployment,
    and the queue its requests wait in (`queue`: what admission by time reads)."""

    def __init__(self, app: str, described: SetDescription, variants: VariantRouter) -> None:
        self.app = app
        self.set_id = described.set_id
        self.variants = variants
        self.shard_groups = described.shard_groups
        self.queue = QueueDelay()
        self.deployments: dict[str, tuple[list[DeploymentHandle], list[float]]] = {}
        for part, capacity in described.deployments.items():
            names = sorted(capacity)
            handles = [serve.get_deployment_handle(n, app_name=app) for n in names]
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
