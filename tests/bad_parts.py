"""Part factories that misbehave when validation builds them with their weights (or, for
`killed_on_call` and `leaks_on_call`, when the part is called), named by the tests of
activities/spec_check.py, the publish drill and the pool drill; they import cleanly, so a spec
naming them passes the import check and fails only where the part is built or run."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

PAGE_BYTES = 4096
CHUNK_BYTES = 64 * 1024**2
ALLOCATE_BYTES = 2 * 1024**3  # twice the 1 GiB validation limit the tests set


def sleeps_forever(weights: dict[str, Any], config: dict[str, Any]) -> object:
    while True:
        time.sleep(3600)


def exits(weights: dict[str, Any], config: dict[str, Any]) -> object:
    os._exit(7)


def killed(weights: dict[str, Any], config: dict[str, Any]) -> object:
    """Ends as the kernel's out-of-memory killer would end it."""
    os.kill(os.getpid(), signal.SIGKILL)
    return None


class _KillsOnCall:
    def __call__(self, inputs: Any) -> object:
        os.kill(os.getpid(), signal.SIGKILL)
        return None


LEAK_BYTES_PER_CALL = 8 * 1024**2
_LEAKED: list[bytearray] = []  # what leaks_on_call's calls keep, for the life of the process


class _LeaksOnCall:
    def __call__(self, inputs: Any) -> object:
        chunk = bytearray(LEAK_BYTES_PER_CALL)
        for offset in range(0, LEAK_BYTES_PER_CALL, PAGE_BYTES):  # each page really used
            chunk[offset] = 1
        _LEAKED.append(chunk)
        return {"kept": len(_LEAKED)}


def leaks_on_call(weights: dict[str, Any], config: dict[str, Any]) -> object:
    """Builds fine; each call keeps 8 MiB in a global list, as a cache that never forgets would."""
    return _LeaksOnCall()


def killed_on_call(weights: dict[str, Any], config: dict[str, Any]) -> object:
    """Builds fine; its first call ends the process as the out-of-memory killer would."""
    return _KillsOnCall()


def allocates(weights: dict[str, Any], config: dict[str, Any]) -> object:
    """Touch ALLOCATE_BYTES page by page, keeping every chunk, so each page is really used."""
    chunks = []
    for _ in range(ALLOCATE_BYTES // CHUNK_BYTES):
        chunk = bytearray(CHUNK_BYTES)
        for offset in range(0, CHUNK_BYTES, PAGE_BYTES):
            chunk[offset] = 1
        chunks.append(chunk)
    return chunks


def torch_allocates(weights: dict[str, Any], config: dict[str, Any]) -> object:
    """Ask torch for ALLOCATE_BYTES at once: its allocator fails with a RuntimeError, not a MemoryError."""
    import torch

    return torch.ones(ALLOCATE_BYTES // 4, dtype=torch.float32)


def raises(weights: dict[str, Any], config: dict[str, Any]) -> object:
    """A snapshot whose part cannot be built: fails at once, as a missing tensor would."""
    raise RuntimeError("tensor 'mlp.0.weight' is missing from the snapshot")
