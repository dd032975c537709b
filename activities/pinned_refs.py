"""The pinned store's references and collection, for ModelWorkflow: write (or drop) one model's
references, then collect what no running model needs (ipnext/store/pinned_store.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable
from datetime import UTC, datetime

from pydantic import Field
from temporalio import activity
from temporalio.client import Client

from ipnext.activities import _context
from ipnext.activities.validate import as_application_error
from ipnext.errors import IpnextError
from ipnext.names import Frozen, Workflows, model_name_of
from ipnext.spec.model import SnapshotSet
from ipnext.store.pinned import pinned_files
from ipnext.store.pinned_store import LocalPinnedStore, PinnedFileName, PinnedStore, Reclaimed

__all__ = ["PinnedActivities", "PinnedReferencesInput", "Reclaimed", "running_models", "sync_references"]


class PinnedReferencesInput(Frozen):
    """One model's references: the pinned files its kept sets need (`of_sets`), or, with `drop`,
    none any more (the model is deleted)."""

    model: str = Field(min_length=1)
    files: list[PinnedFileName] = Field(default_factory=list)  # `<sha256><suffix>`, sorted
    drop: bool = False

    @classmethod
    def of_sets(cls, model: str, sets: Iterable[SnapshotSet]) -> PinnedReferencesInput:
        """The files every part of `sets` needs: a checkpoint's list and each of its files."""
        names = {name for s in sets for ref in s.parts.values() for name in pinned_files(ref)}
        return cls(model=model, files=sorted(names))


def sync_references(
    store: PinnedStore,
    input: PinnedReferencesInput,
    running: Collection[str],
    grace_seconds: float,
    collect: bool = True,
) -> Reclaimed:
    """Write or drop `input.model`'s references, then collect: every model in `running` must
    have references (else nothing is deleted), the one dropped aside."""
    if input.drop:
        store.drop_references(input.model)
    else:
        store.set_references(input.model, input.files)
    if not collect:
        usage = store.usage()
        return Reclaimed(
            at=datetime.now(UTC), skipped="pinned.gc_enabled is false", files=usage.files, bytes=usage.bytes
        )
    expected = set(running) - {input.model} if input.drop else set(running) | {input.model}
    return store.collect(grace_seconds, expected_owners=expected)


class PinnedActivities:
    """The references activity, with the worker's Temporal client: a collection must know every
    running model, so that one which has not written its references yet keeps its files."""

    def __init__(self, client: Client) -> None:
        self._client = client

    @activity.defn
    async def sync_pinned_references(self, input: PinnedReferencesInput) -> Reclaimed:
        """Write (or drop) the model's references in the pinned store, then collect."""
        running = await running_models(self._client)
        settings = _context.settings()
        store = LocalPinnedStore(settings.pinned_store())
        try:
            reclaimed = await asyncio.to_thread(
                sync_references,
                store,
                input,
                running,
                settings.pinned.gc_grace_seconds,
                settings.pinned.gc_enabled,
            )
        except IpnextError as err:  # a name the store refuses: another attempt would too
            raise as_application_error(err) from None
        if reclaimed.skipped:
            activity.logger.warning("pinned store: %s", reclaimed.skipped)
        return reclaimed


async def running_models(client: Client) -> set[str]:
    """The names of the models whose workflow runs (visibility: one that just started may be
    missing for a moment, with nothing pinned for long enough to be collected)."""
    query = f"WorkflowType = '{Workflows.MODEL}' AND ExecutionStatus = 'Running'"
    names = set()
    async for execution in client.list_workflows(query):
        try:
            names.add(model_name_of(execution.id))
        except ValueError:
            continue  # not under a model's id: it names no owner in the store
    return names
