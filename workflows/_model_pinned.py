"""A model's references in the pinned store, for ModelWorkflow: the pinned files its kept sets
need (`ModelRecord.sets`: serving, queued, held, in a rollout, retired ones kept as rollback
targets; not those trimmed into `older_sets`), written to the store after its set list changes,
and dropped when it is deleted; each write is followed by a collection (activities/pinned_refs.py).
A write that fails is logged and tried again at the next change or idle check: it never fails
the model. Nothing here runs outside a workflow.
"""

from __future__ import annotations

import hashlib

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from ipnext.activities import PINNED_REFS_RETRY, PINNED_REFS_TIMEOUT
    from ipnext.activities.pinned_refs import PinnedActivities, PinnedReferencesInput
    from ipnext.workflows._model_run import ModelRun

__all__ = ["PINNED_REFS_PATCH", "PinnedReferences"]

# Models that ran before the pinned store kept references replay without writing them.
PINNED_REFS_PATCH = "pinned-store-references"


class PinnedReferences:
    """One model run's references in the pinned store: `sync` after the set list changed (one
    write at a time, each of the newest list; none when it is what was written last, as
    `ModelRecord.pinned_refs` says across continue-as-new), `drop` when the model is deleted.
    Each run looks once at its first idle moment (`due` starts true): the run before may have
    failed to write, or may not have known references at all."""

    def __init__(self, model: ModelRun) -> None:
        self.model = model
        self.due = True
        self.writing = False
        self.failed = False  # the last write could not run: the next idle check tries again
        self.dropped = False

    def rewrite(self) -> None:
        """Write the references at the next idle moment even if the list is what was written
        (the store's copy may be gone: a worker started again asks every model for this)."""
        self.model.record.pinned_refs = ""
        self.due, self.failed = True, False

    def wants_write(self) -> bool:
        """A write is due, none is on its way (that one writes the newest list when done), and
        the last one did not fail (the loop's idle check tries again after a failure)."""
        return self.due and not self.writing and not self.failed

    async def sync(self) -> None:
        self.due = True
        if self.writing or self.dropped:
            return
        self.writing = True
        try:
            while self.due and not self.dropped:
                self.due = False
                input = PinnedReferencesInput.of_sets(self.model.spec.name, self.model.record.sets)
                written = _fingerprint(input.files)
                if written == self.model.record.pinned_refs:
                    continue
                if not workflow.patched(PINNED_REFS_PATCH):  # the same answer for the whole run
                    break
                summary = f"pinned files of {len(self.model.record.sets)} sets of {input.model}"
                if not await self._run(input, summary, "not written (tried again later)"):
                    # The loop's next idle check tries again: a handler waiting here (a publish)
                    # must not wait out a store that is down.
                    self.due = True
                    break
                self.model.record.pinned_refs = written
        finally:
            self.writing = False

    async def drop(self) -> None:
        """The model is deleted: its references go (after a write on its way, which would
        otherwise bring them back), then a collection."""
        if not workflow.patched(PINNED_REFS_PATCH):
            return
        self.dropped = True
        if self.writing:
            await workflow.wait_condition(lambda: not self.writing)
        name = self.model.spec.name
        input = PinnedReferencesInput(model=name, drop=True)
        # Not tried again (the model is gone): its files stay until refs/<model>.json is removed.
        failed = f"not dropped: its files are kept until {name}.json is removed from the store's refs/"
        if await self._run(input, f"drop the pinned references of {name}", failed):
            self.model.record.pinned_refs = ""

    async def _run(self, input: PinnedReferencesInput, summary: str, failed: str) -> bool:
        name = self.model.spec.name
        try:
            reclaimed = await workflow.execute_activity_method(
                PinnedActivities.sync_pinned_references,
                input,
                start_to_close_timeout=PINNED_REFS_TIMEOUT,
                retry_policy=PINNED_REFS_RETRY,
                summary=summary,
            )
        except ActivityError as err:
            self.failed = True
            workflow.logger.warning("pinned store references of %s %s: %s", name, failed, err.cause or err)
            return False
        self.failed = False
        if reclaimed.skipped:
            workflow.logger.warning("pinned store not collected: %s", reclaimed.skipped)
        elif reclaimed.removed_files:
            workflow.logger.info(
                "pinned store: %d files (%d bytes) no model needs were deleted",
                reclaimed.removed_files,
                reclaimed.removed_bytes,
            )
        return True


def _fingerprint(files: list[str]) -> str:
    """What the record keeps of a references list written: its sha256."""
    return hashlib.sha256("\n".join(files).encode()).hexdigest()
