"""Which part of a shared pool replica leaks its memory (pure; `serving/pool_parts.py` feeds it).

A pool replica counts the bytes of the parts it holds (`PoolCache`), but a part's calls can
grow the process without bound: a cache that never forgets, tensors kept in a global list. The
pool's budget never sees that memory, and the replica dies of it with every pool-mate's part.
So the replica reads its resident memory (RSS) before and after each call and charges the net
change to the part called, but only for a call that ran alone: no other call and no load in
flight when it began, and none begun (nor any part loaded or unloaded) before it ended. A part
whose net growth over its measured calls since its load passes `leak_bytes` leaks.

Net growth, not the sum of rises: the allocator returns memory in steps, so a healthy part's
calls go up and down around a level. Its first `warm_calls` calls after each load are not
charged, since first calls fill caches and thread pools once. Calls that overlap are never
charged, so a part that only ever runs beside others (a busy replica, a batched part under
load) is measured only when traffic thins; a leak shows when it does.

Bad input raises `ValueError` naming the field and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from ipnext.policy.pool_cache import PartKey

__all__ = ["LeakWatch", "WatchedCall"]

MIB = 1024 * 1024


@dataclass(frozen=True)
class WatchedCall:
    """One call under way, as `LeakWatch.begin` saw it start."""

    key: PartKey
    epoch: int
    rss: int
    alone: bool


class LeakWatch:
    """The net memory growth each part's lone calls caused, since its last load."""

    def __init__(self, leak_bytes: int, warm_calls: int = 3) -> None:
        if type(leak_bytes) is not int or leak_bytes < 0:
            raise ValueError(f"leak_bytes: {leak_bytes!r}; give an int >= 0 (0: no leak watch)")
        if type(warm_calls) is not int or warm_calls < 0:
            raise ValueError(f"warm_calls: {warm_calls!r}; give an int >= 0")
        self.leak_bytes = leak_bytes
        self.warm_calls = warm_calls
        self._epoch = 0  # moves at every call's start and every load or unload
        self._running = 0  # calls under way
        self._busy = 0  # loads under way
        self._calls: dict[PartKey, int] = {}  # calls ended since the part's load
        self._measured: dict[PartKey, int] = {}  # of which charged
        self._grown: dict[PartKey, int] = {}  # net bytes charged

    @property
    def on(self) -> bool:
        return self.leak_bytes > 0

    def begin(self, key: PartKey, rss: int) -> WatchedCall:
        """A call of `key` starts, the process at `rss` bytes."""
        self._epoch += 1
        call = WatchedCall(key, self._epoch, rss, alone=self._running == 0 and self._busy == 0)
        self._running += 1
        return call

    def end(self, call: WatchedCall, rss: int) -> str | None:
        """The call ended, the process at `rss` bytes: why its part leaks, or None."""
        self._running -= 1
        key = call.key
        calls = self._calls[key] = self._calls.get(key, 0) + 1
        if not call.alone or call.epoch != self._epoch or calls <= self.warm_calls:
            return None
        grown = self._grown[key] = self._grown.get(key, 0) + rss - call.rss
        measured = self._measured[key] = self._measured.get(key, 0) + 1
        if not self.on or grown <= self.leak_bytes:
            return None
        return (
            f"its calls grew the replica's memory by {grown / MIB:.0f} MiB over {measured} lone calls "
            f"(serve.pools.leak_bytes is {self.leak_bytes / MIB:.0f} MiB)"
        )

    def load_began(self) -> None:
        self._epoch += 1
        self._busy += 1

    def load_ended(self, key: PartKey) -> None:
        """A load ended (loaded or failed): the part starts afresh."""
        self._epoch += 1
        self._busy -= 1
        self.forget(key)

    def unloaded(self, key: PartKey) -> None:
        self._epoch += 1
        self.forget(key)

    def forget(self, key: PartKey) -> None:
        for books in (self._calls, self._measured, self._grown):
            books.pop(key, None)

    def grown(self) -> dict[PartKey, int]:
        """Each part's net growth charged so far (for `describe`)."""
        return dict(self._grown)
