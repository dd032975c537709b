"""ModelWorkflow names its kept sets' pinned files to the pinned store's collection: after a
publish (before its answer), after a rollout trimmed its sets, again when asked by a starting
worker, and drops them when it is deleted; a store that cannot be written never fails the model."""

from __future__ import annotations

import pytest
from temporalio.client import Client

from ipnext.activities.pinned_refs import PinnedReferencesInput, running_models
from ipnext.contracts.model import DeleteInput, DeleteResult, PublishInput, PublishResult
from ipnext.names import model_name_of, poll_until
from ipnext.spec.model import SnapshotRef, SnapshotSetRequest, checkpoint_digest
from ipnext.store.pinned import pinned_files

from .fakes import FakeServing, start, until

pytestmark = pytest.mark.timeout(120)

CKPT_FILES = {"config.json": "c" * 64, "model.safetensors": "d" * 64}
REFS = {
    "v1": SnapshotRef(
        uri="file:///snap/v1",
        sha256=checkpoint_digest(CKPT_FILES),
        snapshot_id="wf-model/embed@v1",
        files=CKPT_FILES,
    ),
    "v2": SnapshotRef(uri="file:///snap/v2", sha256="b" * 64, snapshot_id="wf-model/embed@v2"),
    "v3": SnapshotRef(uri="file:///snap/v3", sha256="e" * 64, snapshot_id="wf-model/embed@v3"),
}


def publish(version: str, hold: bool = False) -> PublishInput:
    request = SnapshotSetRequest(model="wf-model", version=version, parts={"embed": REFS[version]})
    return PublishInput(request=request, who="test", hold=hold)


def files_of(*versions: str) -> list[str]:
    return sorted({name for v in versions for name in pinned_files(REFS[v])})


async def test_the_model_names_its_kept_sets_pinned_files_and_drops_them_when_deleted(
    temporal: Client,
) -> None:
    fake = FakeServing()
    fake.pinned_error = "the pinned store is unreachable"
    worker, handle = await start(temporal, fake, sets_kept=2)
    async with worker:

        async def written() -> list[PinnedReferencesInput]:
            return list(fake.pinned_refs)

        async def until_written(expected: PinnedReferencesInput) -> None:
            await poll_until(
                written, lambda seen: expected in seen, timeout_s=30, interval_s=0.05, what=str(expected)
            )

        # A store that cannot be written: logged, the model publishes and serves all the same.
        await handle.execute_update("publish", publish("v1"), result_type=PublishResult)
        await until(handle, lambda s: s.serving_set == "wf-model@1")
        assert fake.pinned_refs == []
        fake.pinned_error = None
        # A checkpoint's list and files, and the held set's file, named once the store is back.
        await handle.execute_update("publish", publish("v2", hold=True), result_type=PublishResult)
        await until_written(PinnedReferencesInput(model="wf-model", files=files_of("v1", "v2")))
        # (spelled out: the checkpoint's own list, each of its files with its suffix)
        assert files_of("v1") == sorted(
            [f"{REFS['v1'].sha256}.json", f"{'c' * 64}.json", f"{'d' * 64}.safetensors"]
        )
        # v3 serves: v1, retired, is trimmed (2 sets kept, the held one among them) and no longer named.
        await handle.execute_update("publish", publish("v3"), result_type=PublishResult)
        await until_written(PinnedReferencesInput(model="wf-model", files=files_of("v1", "v2", "v3")))
        state = await until(handle, lambda s: s.serving_set == "wf-model@3")
        assert [s.id for s in state.sets] == ["wf-model@2", "wf-model@3"]
        await until_written(PinnedReferencesInput(model="wf-model", files=files_of("v2", "v3")))
        # A worker that starts asks every model to check its serving: the references are written
        # again, the same list (the store's copy may have been lost meanwhile).
        before = len(fake.pinned_refs)
        await handle.signal("reconcile")
        await poll_until(
            written, lambda seen: len(seen) > before, timeout_s=30, interval_s=0.05, what="again"
        )
        assert fake.pinned_refs[before:] == [
            PinnedReferencesInput(model="wf-model", files=files_of("v2", "v3"))
        ]
        deleted = await handle.execute_update("delete", DeleteInput(who="test"), result_type=DeleteResult)
        await handle.result()
    assert deleted.model == "wf-model"
    assert fake.pinned_refs[-1] == PinnedReferencesInput(model="wf-model", drop=True)


async def test_a_collection_knows_every_running_model_by_name(temporal: Client) -> None:
    """What the activity asks Temporal: each running model, so one without references keeps its files."""
    worker, handle = await start(temporal, FakeServing())
    async with worker:
        name = model_name_of(handle.id)
        await poll_until(
            lambda: running_models(temporal), lambda names: name in names, timeout_s=30, what=name
        )
        await handle.terminate("test over")
        await poll_until(
            lambda: running_models(temporal), lambda names: name not in names, timeout_s=30, what=name
        )
