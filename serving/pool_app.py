"""The shared pool app Serve builds for one (region, hardware class): `PoolHost` replicas that
each hold many models' parts within a byte budget (`pool_parts.PoolParts` around
`policy.pool_cache.PoolCache`), serving whichever catalogue entry a request names.
`pool_app` is the builder the rendered Serve config imports by path
(`pool_layout.POOL_IMPORT_PATH`).

Ray Serve's model multiplexing is used where it serves, and replaced where it does not:

- Routing: a caller names the entry with `handle.options(multiplexed_model_id=...)`, the
  replica reads it with `serve.get_multiplexed_model_id()`, and Serve's router sends the
  request to a replica that reported the id (else to one holding fewest). Kept.
- Holding: `@serve.multiplexed` counts models, not bytes, loads one model at a time per replica
  under one lock (a hanging load stops every other), and has no quarantine. Replaced by
  `PoolParts`, which reports what it holds to Serve's controller itself
  (`_report_held`: the call `@serve.multiplexed` makes, a private one of Serve; if a Serve
  release drops it, requests still reach some replica, which loads the part: slower, never wrong).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ray import serve

from ipnext.policy.pool_cache import PoolCache
from ipnext.serving.config_store import resolve
from ipnext.serving.pool_layout import POOL_DEPLOYMENT, PoolAppArgs, PoolCatalogue, PoolEntry, pool_app_name
from ipnext.serving.pool_ledger import LedgerClient
from ipnext.serving.pool_parts import PartRefusedError, PoolParts
from ipnext.serving.set_app import build_part
from ipnext.store.pinned import pinned_size

__all__ = ["PoolHost", "held_bytes", "load_entry", "pool_app"]

logger = logging.getLogger("ray.serve")

# How soon a change of the parts held reaches Serve's routing (one controller call at most this
# often, as `@serve.multiplexed` pushes).
REPORT_INTERVAL_S = 0.2


def held_bytes(part: Any) -> int:
    """The bytes of the tensors a part object holds in its torch modules and tensor attributes
    (each storage once): what a pool counts it at, beside the weights it was given."""
    import torch

    storages: dict[int, int] = {}

    def add(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()

    for value in vars(part).values() if hasattr(part, "__dict__") else ():
        if isinstance(value, torch.nn.Module):
            for tensor in value.state_dict(keep_vars=True).values():
                add(tensor)
        elif isinstance(value, torch.Tensor):
            add(value)
    return sum(storages.values())


def resident_bytes() -> int:
    """This process's resident memory (RSS) in bytes, from /proc/self/statm (0 where there is
    none: no growth is ever seen, so no part is found leaking)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return 0


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def load_entry(entry: PoolEntry) -> tuple[Any, int]:
    """Build one entry's part from its pinned snapshot (in a worker thread): the part and the
    bytes it holds, the larger of its weights and what its modules keep."""
    part, weights = build_part(entry.host)
    return part, max(weights, held_bytes(part))


@serve.deployment(ray_actor_options={"num_cpus": 0})
class PoolHost:
    """One pool replica: serves every entry of its catalogue, holding the parts recently used."""

    def __init__(self, args: PoolAppArgs) -> None:
        import torch

        torch.set_num_threads(1)  # many replicas share few cores; torch would take them all
        pools = args.pools
        cache = PoolCache(
            pools.budget_bytes,
            max_load_failures=pools.max_load_failures,
            quarantine_s=pools.quarantine_s,
            max_quarantine_s=pools.max_quarantine_s,
        )
        self._args = args
        self._catalogue = PoolCatalogue()
        self._sizes: dict[str, int] = {}  # entry id -> its pinned file's size, read once
        # The pool's ledger across its replicas: a part whose loads kill replicas is quarantined.
        ledger = LedgerClient(args.region, pool_app_name(args.region, args.hardware), pools)
        self._parts = PoolParts(
            cache,
            load_entry,
            pools.load_timeout_s,
            on_change=self._held_changed,
            gate=ledger,
            probation_calls=pools.probation_calls,
            rss=resident_bytes,
            leak_bytes=pools.leak_bytes,
        )
        self._report_due = asyncio.Event()
        self._reporter: asyncio.Task[None] | None = None

    async def reconfigure(self, config: dict[str, Any]) -> None:
        """A new catalogue, in place (async: on the replica's event loop, where requests change
        the pool too): entries added are served from now on; the parts no entry
        names any more are unloaded once idle."""
        # The writer keeps the catalogue in Ray's KV store and Serve a reference (config_store.py).
        catalogue = PoolCatalogue.model_validate(await asyncio.to_thread(resolve, config))
        # Each entry's load reservation filled in here, once per entry, not on every request.
        self._catalogue = catalogue.model_copy(
            update={"entries": {i: self._estimated(i, e) for i, e in catalogue.entries.items()}}
        )
        self._sizes = {i: size for i, size in self._sizes.items() if i in catalogue.entries}
        self._parts.retire({entry.key for entry in self._catalogue.entries.values()})
        self._held_changed()

    async def missing(self, entry_ids: list[str]) -> list[str]:
        """The named entries this replica's catalogue lacks (none: it applied a catalogue that
        serves them all), for a deploy to wait on."""
        return [entry_id for entry_id in entry_ids if entry_id not in self._catalogue.entries]

    async def __call__(self, inputs: Any) -> dict[str, Any]:
        entry = self._entry()
        output = await self._parts.call(entry, inputs)
        return {"output": output, "snapshot_id": entry.host.snapshot_id}

    async def stream(self, inputs: Any) -> AsyncIterator[dict[str, Any]]:
        entry = self._entry()
        async for piece in self._parts.stream(entry, inputs):
            yield {"output": piece, "snapshot_id": entry.host.snapshot_id}

    async def check_health(self) -> None:
        """Serve's health check: each loaded part's own check; a failing part is quarantined,
        never the replica (its pool-mates serve on). Async, so a blocked event loop still fails."""
        await self._parts.check_health()

    async def describe(self) -> dict[str, Any]:
        """The replica's pool for checks and dashboards: its catalogue generation, the parts it
        holds, and its cache's figures (bytes, hits, misses, evictions, quarantines)."""
        stats = self._parts.stats()
        return {
            "replica": f"{os.getpid()}",
            "entries": len(self._catalogue.entries),
            "held": sorted(str(key) for key in self._parts.held()),
            "grown_bytes": {str(key): n for key, n in self._parts.grown().items()},
            "stats": {
                **{k: v for k, v in vars(stats).items() if k != "quarantined"},
                "quarantined": [
                    {"part": str(q.key), "reason": q.reason, "repeats": q.repeats} for q in stats.quarantined
                ],
            },
        }

    def _entry(self) -> PoolEntry:
        entry_id = serve.get_multiplexed_model_id()
        entry = self._catalogue.entries.get(entry_id)
        if entry is None:
            raise PartRefusedError(
                f"pool {self._args.region}/{self._args.hardware}: no entry {entry_id!r} in its catalogue "
                "(its set is not deployed here, or was removed)"
            )
        return entry

    def _estimated(self, entry_id: str, entry: PoolEntry) -> PoolEntry:
        """The entry with its load reservation: its own, else its pinned file's size."""
        if entry.estimate_bytes:
            return entry
        size = self._sizes.get(entry_id)
        if size is None:
            size = self._sizes[entry_id] = self._file_size(entry)
        return entry.model_copy(update={"estimate_bytes": size})

    def _file_size(self, entry: PoolEntry) -> int:
        host = entry.host
        return pinned_size(Path(host.pinned_store), host.sha256, host.checkpoint)

    def _held_changed(self) -> None:
        self._report_due.set()
        if self._reporter is None or self._reporter.done():
            try:
                self._reporter = asyncio.get_running_loop().create_task(self._report_held())
            except RuntimeError:  # no loop yet (the constructor): the first request starts it
                pass

    async def _report_held(self) -> None:
        """Tell Serve's controller which entry ids this replica holds (loaded or loading), at
        most every REPORT_INTERVAL_S, so its router prefers this replica for them."""
        from ray.serve._private.common import RequestRoutingInfo
        from ray.serve.context import _get_global_client

        context = serve.get_replica_context()
        while True:
            await self._report_due.wait()
            self._report_due.clear()
            held = self._parts.held()
            ids = sorted(entry_id for entry_id, entry in self._catalogue.entries.items() if entry.key in held)
            try:
                client = _get_global_client()
                if client is None:
                    raise RuntimeError("no Serve controller client in this replica")
                client.record_request_routing_info(
                    RequestRoutingInfo(replica_id=context.replica_id, multiplexed_model_ids=ids)
                )
            except Exception as err:  # routing falls back to any replica: slower, never wrong
                logger.warning("pool: could not report held parts to Serve: %r", err)
            await asyncio.sleep(REPORT_INTERVAL_S)


def pool_app(args: dict[str, Any]) -> serve.Application:
    """Builder Serve imports for a pool app: its one `pool` deployment."""
    parsed = PoolAppArgs.model_validate(args)
    return PoolHost.options(name=POOL_DEPLOYMENT).bind(parsed)  # type: ignore[attr-defined]
