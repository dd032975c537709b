"""The ledger of shared pools' loads and first calls across their replicas: one detached
head-node actor per region (`ledger_actor_name`) holding a `policy.load_ledger.LoadLedger` per
pool app, so a part whose load, or whose call in its probation after a load, kills its replica is
quarantined for the whole pool after `max_load_failures` such deaths, though no replica lives to
report them.

A replica asks `begin` before each load and each probation call, and reports `end` after it
(`PoolHost` through `LedgerClient`). At each `begin`, what has been under way for over
`SWEEP_AFTER_S` is checked: what a replica whose actor is dead had under way failed. The ledger
fails open: a replica that cannot reach it goes on anyway (its own `PoolCache` still
quarantines what fails in it), and Ray restarts a ledger that died, empty.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from ipnext.policy.load_ledger import LoadLedger
from ipnext.policy.pool_cache import PartKey
from ipnext.serving.layout import RAY_NAMESPACE, head_node_options
from ipnext.spec.settings import PoolSettings

__all__ = ["LedgerClient", "PoolLedger", "ledger_actor_name"]

logger = logging.getLogger("ray.serve")

# A load under way this long is old enough to ask whether its replica still lives.
SWEEP_AFTER_S = 1.0
# How long a liveness question or a replica's call to the ledger may take.
ASK_TIMEOUT_S = 5.0


def ledger_actor_name(region: str) -> str:
    return f"ipnext-pool-ledger/{region}"


class PoolLedger:
    """Body of the detached actor `ledger_actor_name(region)` (wrapped by ray.remote): a
    `LoadLedger` per pool app of the region, made on its first load."""

    def __init__(self, pools: dict[str, Any]) -> None:
        self._settings = PoolSettings.model_validate(pools)
        self._ledgers: dict[str, LoadLedger] = {}
        self._replicas: dict[str, Any] = {}  # replica id -> its actor handle

    def begin(
        self, pool: str, key: tuple[str, str, str], replica: str, handle: Any, kind: str = "load"
    ) -> tuple[bool, str]:
        """May `replica` of `pool` load `key` (or run it: `kind` "call") now? (allowed, why not)."""
        self._replicas[replica] = handle
        ledger = self._ledger(pool)
        self._sweep(ledger, time.monotonic())
        answer = ledger.begin(PartKey(*key), replica, time.monotonic(), kind)
        return answer.allowed, answer.reason

    def end(
        self, pool: str, key: tuple[str, str, str], replica: str, error: str | None, kind: str = "load"
    ) -> None:
        self._ledger(pool).end(PartKey(*key), replica, error, time.monotonic(), kind)

    def quarantine(self, pool: str, key: tuple[str, str, str], reason: str) -> None:
        """A replica of `pool` found `key` leaking: every replica refuses it from now on."""
        self._ledger(pool).quarantine(PartKey(*key), reason, time.monotonic())
        logger.warning("pool ledger: %s quarantined in %s: %s", PartKey(*key), pool, reason)

    def forget(self, pool: str) -> bool:
        """The pool is gone (its last pooled model left): its loads and quarantines with it."""
        return self._ledgers.pop(pool, None) is not None

    def quarantined(self, pool: str) -> dict[str, str]:
        """Each part quarantined for the pool now: its reason."""
        found = self._ledger(pool).quarantined(time.monotonic())
        return {str(key): reason for key, (reason, _) in found.items()}

    def _ledger(self, pool: str) -> LoadLedger:
        ledger = self._ledgers.get(pool)
        if ledger is None:
            pools = self._settings
            ledger = LoadLedger(pools.max_load_failures, pools.quarantine_s, pools.max_quarantine_s)
            self._ledgers[pool] = ledger
        return ledger

    def _sweep(self, ledger: LoadLedger, now: float) -> None:
        """Loads and calls under way past SWEEP_AFTER_S whose replica is dead: failed."""
        old = {r for r, since in ledger.replicas_under_way().items() if now - since > SWEEP_AFTER_S}
        for replica in sorted(old):
            handle = self._replicas.get(replica)
            if handle is None or _alive(handle):
                continue
            lost = ledger.replica_gone(replica, time.monotonic())
            self._replicas.pop(replica, None)
            logger.warning("pool ledger: replica %s died running %s", replica, ", ".join(map(str, lost)))


def _alive(handle: Any) -> bool:
    """Whether the actor answers (a busy one answers: its loads run in threads)."""
    try:
        ray.get(handle.__ray_ready__.remote(), timeout=ASK_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        return True  # slow, not dead
    except ray.exceptions.RayActorError:
        return False
    return True


class LedgerClient:
    """A pool replica's side of its pool's ledger (`PoolParts`' load gate): `begin` before a
    load or probation call, `end` after it; unreachable, it lets it go (fail open) and says so
    once."""

    def __init__(self, region: str, pool_app: str, pools: PoolSettings) -> None:
        self._name = ledger_actor_name(region)
        self._pool = pool_app
        self._pools = pools
        self._actor: Any = None
        self._replica = ray.get_runtime_context().get_actor_id() or "driver"
        self._handle = ray.get_runtime_context().current_actor
        self._warned = False

    async def begin(self, key: PartKey, kind: str = "load") -> str | None:
        """None: load (or run) it; else why the pool refuses it (quarantined across its replicas)."""
        try:
            allowed, reason = await self._ledger().begin.remote(
                self._pool, (key.model, key.part, key.snapshot_id), self._replica, self._handle, kind
            )
        except ray.exceptions.RayError as err:
            self._unreachable(err)
            return None
        return None if allowed else reason

    async def end(self, key: PartKey, error: str | None, kind: str = "load") -> None:
        try:
            await self._ledger().end.remote(
                self._pool, (key.model, key.part, key.snapshot_id), self._replica, error, kind
            )
        except ray.exceptions.RayError as err:
            self._unreachable(err)

    async def quarantine(self, key: PartKey, reason: str) -> None:
        try:
            await self._ledger().quarantine.remote(self._pool, (key.model, key.part, key.snapshot_id), reason)
        except ray.exceptions.RayError as err:  # this replica refuses it still
            self._unreachable(err)

    def _ledger(self) -> Any:
        if self._actor is None:
            self._actor = (
                ray.remote(PoolLedger)
                .options(
                    name=self._name,
                    namespace=RAY_NAMESPACE,
                    lifetime="detached",
                    get_if_exists=True,
                    max_restarts=-1,
                    **head_node_options(),
                )
                .remote(self._pools.model_dump(mode="json"))
            )
        return self._actor

    def _unreachable(self, err: Exception) -> None:
        self._actor = None  # made again at the next load
        if not self._warned:
            logger.warning("pool ledger %s unreachable (%r): loading without it", self._name, err)
            self._warned = True
