"""Names and desired state of shared pool apps: one Serve app per (region, hardware class) whose
replicas hold many models' parts, each part an entry of the pool's catalogue.

Pure code (no Ray imports), like `layout.py`. A pool app is one `pool` deployment
(`serving/pool_app.py`); which parts it may serve rides in its `user_config` (`PoolCatalogue`),
so adding or removing a model's set reconfigures the pool's replicas in place instead of
restarting them. A request names its entry with Serve's multiplexed model id
(`handle.options(multiplexed_model_id=pool_entry_id(set_app, part))`), so Serve routes it to a
replica that holds the part when one does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from ipnext.names import Frozen
from ipnext.policy.pool_cache import PartKey
from ipnext.serving.layout import PartHostArgs, SetAppArgs
from ipnext.spec.settings import PartHealthCheckSettings, PoolSettings

__all__ = [
    "POOL_DEPLOYMENT",
    "POOL_IMPORT_PATH",
    "PoolAppArgs",
    "PoolCatalogue",
    "PoolEntry",
    "is_pool_app",
    "pool_app_name",
    "pool_entries",
    "pool_entry_id",
    "render_pool_app",
]

POOL_DEPLOYMENT = "pool"
# The builder Serve imports by path (changing it restarts every pool rendered with it).
POOL_IMPORT_PATH = "ipnext.serving.pool_app:pool_app"
_POOL_PREFIX = "ipnext-pool"
# As layout._REGION_SHARE: a replica lands on its region's node without the region count limiting.
_REGION_SHARE = 0.001


def pool_app_name(region: str, hardware: str) -> str:
    """The pool of `hardware` in `region`. Three dotted fields: never a router app's name
    (`<model>.<region>`, two) nor a set app's (`<model>.<region>.s<n>.r<k>`, four)."""
    return f"{_POOL_PREFIX}.{region}.{hardware}"


def is_pool_app(name: str) -> bool:
    return name.startswith(f"{_POOL_PREFIX}.") and name.count(".") == 2


def pool_entry_id(set_app: str, part: str) -> str:
    """One part of one set app in a pool: the multiplexed model id its requests carry."""
    return f"{set_app}/{part}"


class PoolEntry(Frozen):
    """A part a pool may serve: how to build it (as a dedicated replica would) and the bytes it
    reserves while it loads (its pinned file's size; the pool measures it once loaded)."""

    host: PartHostArgs
    estimate_bytes: int = Field(ge=0)

    @property
    def key(self) -> PartKey:
        """What the pool loads, evicts and quarantines: entries of one snapshot's part (a set
        replanned into a new revision, or a part no rollout changed) share one loaded copy."""
        return PartKey(self.host.model, self.host.part, self.host.snapshot_id)


class PoolCatalogue(Frozen):
    """The pool deployment's `user_config`: every entry its replicas may serve, by entry id
    (`pool_entry_id`). `generation` grows with each change, so a caller can wait until every
    replica applied it."""

    generation: int = Field(default=0, ge=0)
    entries: dict[str, PoolEntry] = Field(default_factory=dict)


class PoolAppArgs(Frozen):
    """Fixed for the life of a pool app: where it runs and how its replicas hold parts."""

    region: str
    hardware: str
    pools: PoolSettings = Field(default_factory=PoolSettings)


def pool_entries(
    set_app: str, args: SetAppArgs, hardware: str, estimate_bytes: Mapping[str, int]
) -> dict[str, PoolEntry]:
    """The entries set app `set_app` puts into the pool of `hardware` in its region: each of its
    parts served on that hardware class, reserving `estimate_bytes[part]` while it loads."""
    served = [part for part, classes in sorted(args.hardware.items()) if hardware in classes]
    missing = [part for part in served if part not in estimate_bytes]
    if missing:
        raise ValueError(f"estimate_bytes: none for part(s) {missing}; give each its pinned file's size")
    return {
        pool_entry_id(set_app, part): PoolEntry(host=args.parts[part], estimate_bytes=estimate_bytes[part])
        for part in served
    }


def render_pool_app(
    args: PoolAppArgs,
    catalogue: PoolCatalogue,
    replicas: int,
    units: int,
    replica_num_cpus: float,
    health_check: PartHealthCheckSettings | None = None,
    shutdown_wait_s: float | None = None,
) -> dict[str, Any]:
    """The pool app's Serve config: `replicas` replicas of the pool deployment, each taking
    `units` of its hardware class, its catalogue as `user_config`. Serve calls
    `PoolHost.check_health`, which checks each loaded part and quarantines a failing one instead
    of failing the replica, so one model's part never restarts its pool-mates."""
    if replicas < 1 or units < 0:
        where = f"pool {args.region}/{args.hardware}"
        raise ValueError(f"{where}: replicas {replicas}, units {units}; give replicas >= 1, units >= 0")
    health_check = health_check or PartHealthCheckSettings()
    deployment: dict[str, Any] = {
        "name": POOL_DEPLOYMENT,
        "num_replicas": replicas,
        "max_ongoing_requests": args.pools.max_ongoing_requests,
        "ray_actor_options": {
            "num_cpus": replica_num_cpus,
            "resources": {f"region:{args.region}": _REGION_SHARE, f"hw:{args.hardware}": units},
        },
        "health_check_period_s": health_check.period_s,
        "health_check_timeout_s": health_check.timeout_s,
        "user_config": catalogue.model_dump(mode="json"),
    }
    if shutdown_wait_s is not None:
        deployment["graceful_shutdown_wait_loop_s"] = shutdown_wait_s
    return {
        "name": pool_app_name(args.region, args.hardware),
        "route_prefix": None,
        "import_path": POOL_IMPORT_PATH,
        "args": args.model_dump(mode="json", exclude_defaults=True),
        "deployments": [deployment],
    }
