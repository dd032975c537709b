"""The pinned store's references and collection: a file some model names is never deleted, one
no model names goes once older than the grace, a fresh one stays, a checkpoint's files and list
go together, an unreadable references file deletes nothing, and a pin racing a collection keeps
its file."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ipnext.activities.pinned_refs import PinnedReferencesInput, sync_references
from ipnext.client.devstack.status_file import format_bytes, pinned_store_lines
from ipnext.errors import SnapshotError
from ipnext.names import SetStatus
from ipnext.spec.model import SnapshotRef, SnapshotSet, checkpoint_digest
from ipnext.store.pinned import pin, pin_checkpoint, pinned_files, pinned_path, store_lock
from ipnext.store.pinned_store import GcReport, LocalPinnedStore, PinnedStore, Reclaimed, read_gc_report

pytestmark = pytest.mark.timeout(30)

GRACE = 3600.0


def _bytes_file(folder: Path, name: str, data: bytes) -> tuple[Path, str]:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest()


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


@pytest.fixture
def store(tmp_path: Path) -> LocalPinnedStore:
    return LocalPinnedStore(tmp_path / "pinned")


def _pinned(store: LocalPinnedStore, tmp_path: Path, data: bytes, old: bool = True) -> Path:
    source, digest = _bytes_file(tmp_path / "training", f"{data.hex()}.safetensors", data)
    path = pin(source, digest, store.root)
    if old:
        _age(path, GRACE + 60)
    return path


def test_the_local_folder_is_a_pinned_store(store: LocalPinnedStore) -> None:
    assert isinstance(store, PinnedStore)


def test_a_referenced_file_survives_an_unreferenced_old_one_goes_a_fresh_one_stays(
    store: LocalPinnedStore, tmp_path: Path
) -> None:
    kept = _pinned(store, tmp_path, b"serving weights")
    gone = _pinned(store, tmp_path, b"trimmed weights")
    fresh = _pinned(store, tmp_path, b"being validated", old=False)
    store.set_references("m", [kept.name])
    reclaimed = store.collect(GRACE, expected_owners={"m"})
    assert kept.is_file() and fresh.is_file() and not gone.exists()
    assert (reclaimed.removed_files, reclaimed.removed_bytes) == (1, len(b"trimmed weights"))
    assert (reclaimed.referenced, reclaimed.kept_fresh, reclaimed.owners, reclaimed.skipped) == (1, 1, 1, "")
    assert (reclaimed.files, reclaimed.bytes) == (2, len(b"serving weights") + len(b"being validated"))
    assert store.usage() == (2, reclaimed.bytes)
    # Once the fresh file is old and still named by nobody, the next run takes it; gc.json adds up.
    _age(fresh, GRACE + 60)
    again = store.collect(GRACE, expected_owners={"m"})
    assert not fresh.exists() and again.removed_files == 1
    report = read_gc_report(store.root)
    assert report is not None and report.last == again
    assert (report.runs, report.removed_files) == (2, 2)
    assert report.removed_bytes == len(b"trimmed weights") + len(b"being validated")


def test_references_are_per_owner_and_a_dropped_owner_keeps_nothing(
    store: LocalPinnedStore, tmp_path: Path
) -> None:
    shared = _pinned(store, tmp_path, b"the same bytes in two models")
    only_a = _pinned(store, tmp_path, b"only model a")
    store.set_references("a", [shared.name, only_a.name])
    store.set_references("b", [shared.name])
    assert store.references() == {"a": sorted([shared.name, only_a.name]), "b": [shared.name]}
    store.drop_references("a")
    store.collect(GRACE)
    assert shared.is_file() and not only_a.exists()
    store.set_references("b", [])  # b's sets were trimmed: nothing named any more
    store.collect(GRACE)
    assert not shared.exists() and store.usage() == (0, 0)


def test_a_checkpoint_is_kept_and_collected_whole(store: LocalPinnedStore, tmp_path: Path) -> None:
    folder = tmp_path / "training" / "ckpt"
    files = dict(
        (name, _bytes_file(folder, name, data)[1])
        for name, data in (
            ("config.json", b'{"hidden": 4}'),
            ("tokenizer.json", b'{"vocab": []}'),
            ("model.safetensors", b"shard bytes"),
        )
    )
    ref = SnapshotRef(
        uri="file:///ckpt", sha256=checkpoint_digest(files), snapshot_id="m/part@1", files=files
    )
    listing = pin_checkpoint(folder, files, ref.sha256, store.root)
    paths = [listing, *(pinned_path(store.root, d, Path(n).suffix) for n, d in files.items())]
    for path in paths:
        _age(path, GRACE + 60)
    names = pinned_files(ref)
    assert sorted(p.name for p in paths) == names and f"{ref.sha256}.json" in names
    store.set_references("m", names)
    assert store.collect(GRACE).referenced == 4 and all(p.is_file() for p in paths)
    store.drop_references("m")
    assert store.collect(GRACE).removed_files == 4 and not any(p.exists() for p in paths)


@pytest.mark.parametrize(
    "corrupt", ["not json", '{"owner": "other", "files": [], "written_at": "2026-01-01T00:00:00Z"}']
)
def test_an_unreadable_references_file_deletes_nothing_and_says_why(
    store: LocalPinnedStore, tmp_path: Path, corrupt: str
) -> None:
    orphan = _pinned(store, tmp_path, b"named by nobody readable")
    store.set_references("good", [])
    (store.root / "refs" / "broken.json").write_text(corrupt)
    reclaimed = store.collect(GRACE)
    assert orphan.is_file() and reclaimed.removed_files == 0
    assert "refs/broken.json" in reclaimed.skipped and "nothing collected" in reclaimed.skipped
    report = read_gc_report(store.root)
    assert report is not None and report.skipped_runs == 1 and report.last.skipped == reclaimed.skipped


def test_a_running_model_without_references_deletes_nothing(store: LocalPinnedStore, tmp_path: Path) -> None:
    """A model whose run predates references (or that has not written them yet) needs its files."""
    theirs = _pinned(store, tmp_path, b"an older model's serving weights")
    store.set_references("new", [])
    reclaimed = store.collect(GRACE, expected_owners={"new", "older"})
    assert theirs.is_file() and "model older runs but has no references file" in reclaimed.skipped


def test_stale_partial_files_go_and_fresh_ones_stay(store: LocalPinnedStore, tmp_path: Path) -> None:
    shard = store.root / "ab"
    shard.mkdir(parents=True)
    stale, writing = shard / f".{'ab' * 32}.safetensors.1.partial", shard / f".{'ab' * 32}.json.2.partial"
    stale.write_bytes(b"x" * 10)
    writing.write_bytes(b"y")
    _age(stale, GRACE + 60)
    not_ours = shard / "notes.txt"
    not_ours.write_text("left alone")
    _age(not_ours, GRACE + 60)
    reclaimed = store.collect(GRACE)
    assert not stale.exists() and writing.exists() and not_ours.exists()
    assert (reclaimed.removed_files, reclaimed.partials_removed, reclaimed.removed_bytes) == (1, 1, 10)


def test_pinning_bytes_already_there_makes_the_file_fresh_again(
    store: LocalPinnedStore, tmp_path: Path
) -> None:
    old = _pinned(store, tmp_path, b"validated again")
    source, digest = _bytes_file(tmp_path / "again", "w.safetensors", b"validated again")
    assert pin(source, digest, store.root) == old
    store.collect(GRACE)
    assert old.is_file()


def test_a_pin_during_a_collection_waits_and_keeps_its_file(store: LocalPinnedStore, tmp_path: Path) -> None:
    """The collection holds the lock while it decides and deletes; a pin finding its bytes waits
    for it, so it never returns a file the collection then deletes."""
    old = _pinned(store, tmp_path, b"old and unreferenced")
    source, digest = _bytes_file(tmp_path / "again", "w.safetensors", b"old and unreferenced")
    pinned: list[Path] = []
    with store_lock(store.root, exclusive=True):
        pinner = threading.Thread(target=lambda: pinned.append(pin(source, digest, store.root)))
        pinner.start()
        pinner.join(0.3)
        assert pinner.is_alive()  # waiting for the collection
        old.unlink()  # what the collection decided for it
    pinner.join(5)
    assert pinned == [old] and old.is_file()
    assert time.time() - old.stat().st_mtime < GRACE  # copied again, fresh
    assert store.collect(GRACE).kept_fresh == 1 and old.is_file()


def test_references_name_only_pinned_files_and_owners_are_names(store: LocalPinnedStore) -> None:
    with pytest.raises(SnapshotError, match="not pinned file names"):
        store.set_references("m", ["../../etc/passwd"])
    with pytest.raises(SnapshotError, match="is not a name"):
        store.set_references("../m", [])


def _set(number: int, parts: dict[str, SnapshotRef]) -> SnapshotSet:
    return SnapshotSet(
        id=f"m@{number}",
        number=number,
        version=f"v{number}",
        parts=parts,
        status=SetStatus.SERVING,
        published_at=datetime(2026, 1, 1, tzinfo=UTC),
    )


def test_a_models_references_name_every_file_of_its_kept_sets() -> None:
    files = {"config.json": "c" * 64, "model.safetensors": "d" * 64}
    ckpt = SnapshotRef(uri="file:///c", sha256=checkpoint_digest(files), snapshot_id="m/llm@1", files=files)
    single = SnapshotRef(uri="file:///w", sha256="a" * 64, snapshot_id="m/embed@1")
    input = PinnedReferencesInput.of_sets(
        "m", [_set(1, {"llm": ckpt, "embed": single}), _set(2, {"embed": single})]
    )
    assert input.files == sorted(
        [f"{'a' * 64}.safetensors", f"{ckpt.sha256}.json", f"{'c' * 64}.json", f"{'d' * 64}.safetensors"]
    )


def test_the_activity_expects_every_running_model_but_the_one_dropped(
    store: LocalPinnedStore, tmp_path: Path
) -> None:
    orphan = _pinned(store, tmp_path, b"a deleted model's weights")
    store.set_references("gone", [orphan.name])
    written = sync_references(store, PinnedReferencesInput(model="kept", files=[]), {"kept", "late"}, GRACE)
    assert "model late runs" in written.skipped and orphan.is_file()
    dropped = sync_references(store, PinnedReferencesInput(model="gone", drop=True), {"kept", "gone"}, GRACE)
    assert dropped.skipped == "" and dropped.removed_files == 1 and not orphan.exists()
    off = sync_references(
        store, PinnedReferencesInput(model="kept", files=[]), {"kept"}, GRACE, collect=False
    )
    assert off.skipped == "pinned.gc_enabled is false"


def test_dev_status_shows_the_store_in_use_and_what_was_reclaimed(tmp_path: Path) -> None:
    last = Reclaimed(
        at=datetime(2026, 12, 8, 10, 30, tzinfo=UTC),
        removed_files=3,
        removed_bytes=3 * 1024**2,
        files=12,
        bytes=int(2.5 * 1024**3),
    )
    report = GcReport(last=last, runs=7, removed_files=40, removed_bytes=10 * 1024**3 + 512 * 1024**2)
    lines = pinned_store_lines(tmp_path, report)
    assert lines == [
        f"pinned store {tmp_path}: 12 files, 2.5 GiB in use (as of 2026-12-08 10:30:00 UTC)",
        "  reclaimed: 3.0 MiB (3 files) by the last collection, "
        "10.5 GiB (40 files) in all over 7 collections",
    ]
    skipped = report.model_copy(
        update={"last": last.model_copy(update={"skipped": "refs/x.json cannot be read"})}
    )
    assert pinned_store_lines(tmp_path, skipped)[-1] == (
        "  the last collection deleted nothing: refs/x.json cannot be read"
    )
    assert "no collection yet" in pinned_store_lines(tmp_path, None)[0]
    assert [format_bytes(n) for n in (0, 1023, 1536, 5 * 1024**4)] == ["0 B", "1023 B", "1.5 KiB", "5.0 TiB"]
