"""The pinned store as the platform uses it: an interface (`PinnedStore`) a remote store such as
object storage can implement, the local folder that implements it (`LocalPinnedStore`), and the
collection of pinned files no model needs any more.

Each model names the pinned files its kept sets need, its references, in `refs/<model>.json`
(written after every change of its set list, dropped when it is deleted). A collection holds
the store's lock exclusively, reads every model's references, and deletes each pinned file no
model names once it is older than the grace period (a set being validated has pinned its files
before its model names them), and `.partial` files older than the grace; what it reclaimed goes
to `gc.json`. It fails closed: a references file that cannot be read, or a running model that
has none, and nothing is deleted (`Reclaimed.skipped` says why).

    <store>/ab/ab12...ef.safetensors   pinned files (ipnext/store/pinned.py)
    <store>/refs/<model>.json          each model's references
    <store>/gc.json                    the last collection and the totals of all (`GcReport`)
    <store>/gc.lock                    the lock (`ipnext.store.pinned.store_lock`)
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections import Counter
from collections.abc import Collection, Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, NamedTuple, Protocol, runtime_checkable

from pydantic import StringConstraints, ValidationError

from ipnext.errors import SnapshotError
from ipnext.names import Frozen
from ipnext.spec.model import SnapshotRef
from ipnext.store.pinned import pin, pin_checkpoint, pinned_path, store_lock, verify_ref, write_atomically

__all__ = [
    "GC_REPORT",
    "REFS_DIR",
    "GcReport",
    "LocalPinnedStore",
    "PinnedFileName",
    "PinnedStore",
    "Reclaimed",
    "StoreUsage",
    "read_gc_report",
]

REFS_DIR = "refs"
GC_REPORT = "gc.json"
PINNED_FILE = r"[0-9a-f]{64}(\.[A-Za-z0-9_-]+)?"
# A pinned file's name in the store: `<sha256><suffix>` (ipnext.store.pinned.pinned_name).
PinnedFileName = Annotated[str, StringConstraints(pattern=rf"^{PINNED_FILE}$")]
_PINNED = re.compile(rf"^{PINNED_FILE}$")
_SHARD = re.compile(r"^[0-9a-f]{2}$")
_OWNER = re.compile(r"^[a-z0-9][a-z0-9._-]{0,199}$")


class StoreUsage(NamedTuple):
    """The pinned files in a store: how many, and their bytes."""

    files: int
    bytes: int


class Reclaimed(Frozen):
    """One collection: what it deleted, what it kept and why, and the store after it."""

    at: datetime
    removed_files: int = 0  # pinned files and stale `.partial` files deleted
    removed_bytes: int = 0
    partials_removed: int = 0  # of `removed_files`
    referenced: int = 0  # pinned files some model names: kept
    kept_fresh: int = 0  # named by no model, younger than the grace: kept
    missing: int = 0  # files some model names that are not in the store
    owners: int = 0  # models whose references were read
    skipped: str = ""  # why nothing was collected (fail closed); empty when it ran
    files: int = 0  # pinned files in the store after it
    bytes: int = 0


class GcReport(Frozen):
    """`<store>/gc.json`: the last collection, and the totals over every one."""

    last: Reclaimed
    runs: int
    skipped_runs: int = 0
    removed_files: int = 0
    removed_bytes: int = 0


class _References(Frozen):
    """`<store>/refs/<owner>.json`: the pinned files one model's kept sets need."""

    owner: str
    files: list[PinnedFileName]
    written_at: datetime


@runtime_checkable
class PinnedStore(Protocol):
    """What the platform needs of a pinned store. `location` is what a replica is handed to load
    from (a path here; a URL for object storage)."""

    def location(self, sha256: str, suffix: str = ".safetensors") -> str: ...

    def pin(self, source: Path, sha256: str, suffix: str = ".safetensors") -> str: ...

    def pin_checkpoint(self, folder: Path, files: dict[str, str], sha256: str) -> str: ...

    def verify_ref(self, ref: SnapshotRef) -> str | None: ...

    def set_references(self, owner: str, files: Iterable[str]) -> None: ...

    def drop_references(self, owner: str) -> None: ...

    def collect(self, grace_seconds: float, expected_owners: Collection[str] = ()) -> Reclaimed: ...

    def usage(self) -> StoreUsage: ...

    def report(self) -> GcReport | None: ...


class LocalPinnedStore:
    """The pinned store in a folder every Ray node reads (ipnext/store/pinned.py has its layout)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    # ---- the files -------------------------------------------------------------------------

    def location(self, sha256: str, suffix: str = ".safetensors") -> str:
        return str(pinned_path(self.root, sha256, suffix))

    def pin(self, source: Path, sha256: str, suffix: str = ".safetensors") -> str:
        return str(pin(source, sha256, self.root, suffix))

    def pin_checkpoint(self, folder: Path, files: dict[str, str], sha256: str) -> str:
        return str(pin_checkpoint(folder, files, sha256, self.root))

    def verify_ref(self, ref: SnapshotRef) -> str | None:
        return verify_ref(self.root, ref)

    # ---- references --------------------------------------------------------------------------

    def set_references(self, owner: str, files: Iterable[str]) -> None:
        """Replace what `owner` references by `files` (pinned file names, `<sha256><suffix>`)."""
        names = sorted(set(files))
        bad = [n for n in names if not _PINNED.match(n)]
        if bad:
            raise SnapshotError(
                f"references of {owner}: {bad[:3]} are not pinned file names (<sha256><suffix>).",
                field="files",
                value=bad[:3],
                fix="name each file as ipnext.store.pinned.pinned_files does",
            )
        doc = _References(owner=_check_owner(owner), files=names, written_at=datetime.now(UTC))
        with store_lock(self.root, exclusive=False):
            write_atomically(self._refs_file(owner), doc.model_dump_json(indent=1).encode(), mode=0o644)

    def drop_references(self, owner: str) -> None:
        with store_lock(self.root, exclusive=False):
            self._refs_file(_check_owner(owner)).unlink(missing_ok=True)

    def references(self) -> dict[str, list[str]]:
        """Every owner's references (a file that cannot be read: SnapshotError naming it)."""
        found, problems = self._read_references(())
        if problems:
            raise SnapshotError(f"pinned store {self.root}: {'; '.join(problems)}", field="refs")
        return {owner: sorted(files) for owner, files in found.items()}

    def _refs_file(self, owner: str) -> Path:
        return self.root / REFS_DIR / f"{owner}.json"

    def _read_references(self, expected: Collection[str]) -> tuple[dict[str, set[str]], list[str]]:
        """Each owner's references, and what keeps them from being trusted: a file that cannot
        be read, or an expected owner without one."""
        found: dict[str, set[str]] = {}
        problems = []
        seen = set()
        folder = self.root / REFS_DIR
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            seen.add(path.stem)
            try:
                doc = _References.model_validate_json(path.read_bytes())
            except (OSError, ValidationError) as err:
                first = str(err).splitlines()[0]
                problems.append(f"{REFS_DIR}/{path.name} cannot be read ({first})")
                continue
            if doc.owner != path.stem:
                problems.append(f"{REFS_DIR}/{path.name} names owner {doc.owner!r}, not {path.stem!r}")
                continue
            found[doc.owner] = set(doc.files)
        for owner in sorted(set(expected) - seen):
            problems.append(f"model {owner} runs but has no references file ({REFS_DIR}/{owner}.json)")
        return found, problems

    # ---- collection ------------------------------------------------------------------------

    def collect(self, grace_seconds: float, expected_owners: Collection[str] = ()) -> Reclaimed:
        """Delete pinned files no owner references that are older than `grace_seconds`, and
        `.partial` files older than it; record the run in gc.json. Nothing is deleted when a
        references file cannot be read or an owner in `expected_owners` (the models running) has
        none: `Reclaimed.skipped` says why."""
        with store_lock(self.root, exclusive=True):
            at, now = datetime.now(UTC), time.time()
            found, problems = self._read_references(expected_owners)
            if problems:
                usage = self.usage()
                reclaimed = Reclaimed(
                    at=at,
                    owners=len(found),
                    skipped="; ".join(problems) + ": nothing collected",
                    files=usage.files,
                    bytes=usage.bytes,
                )
            else:
                reclaimed = self._delete_unreferenced(set().union(*found.values()), now, grace_seconds)
                reclaimed = reclaimed.model_copy(update={"at": at, "owners": len(found)})
            self._record(reclaimed)
        return reclaimed

    def _delete_unreferenced(self, referenced: set[str], now: float, grace: float) -> Reclaimed:
        n: Counter[str] = Counter()  # Reclaimed's counts, by field
        present = set()
        for shard, name, size, mtime in self._entries():
            old = now - mtime > grace
            if name.startswith(".") and name.endswith(".partial"):  # a pin that crashed or was killed
                if old and _unlink(shard / name):
                    n.update(removed_files=1, removed_bytes=size, partials_removed=1)
                continue
            if not _PINNED.match(name) or not name.startswith(shard.name):
                continue  # not a pinned file: not the collection's to delete
            present.add(name)
            if name not in referenced and old and _unlink(shard / name):
                n.update(removed_files=1, removed_bytes=size)
                continue
            n.update({"referenced" if name in referenced else "kept_fresh": 1, "files": 1, "bytes": size})
        return Reclaimed.model_validate({"at": datetime.now(UTC), "missing": len(referenced - present), **n})

    def _entries(self) -> Iterator[tuple[Path, str, int, float]]:
        """(shard folder, name, size, mtime) of every plain file in the store's shard folders."""
        if not self.root.is_dir():
            return
        for shard in sorted(self.root.iterdir()):
            if not _SHARD.match(shard.name) or not shard.is_dir():
                continue
            with os.scandir(shard) as entries:
                for entry in entries:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        yield shard, entry.name, st.st_size, st.st_mtime

    def usage(self) -> StoreUsage:
        files = [size for shard, name, size, _ in self._entries() if _PINNED.match(name)]
        return StoreUsage(files=len(files), bytes=sum(files))

    def report(self) -> GcReport | None:
        return read_gc_report(self.root)

    def _record(self, reclaimed: Reclaimed) -> None:
        before = self.report()
        report = GcReport(
            last=reclaimed,
            runs=(before.runs if before else 0) + 1,
            skipped_runs=(before.skipped_runs if before else 0) + bool(reclaimed.skipped),
            removed_files=(before.removed_files if before else 0) + reclaimed.removed_files,
            removed_bytes=(before.removed_bytes if before else 0) + reclaimed.removed_bytes,
        )
        write_atomically(self.root / GC_REPORT, report.model_dump_json(indent=1).encode(), mode=0o644)


def read_gc_report(store: Path) -> GcReport | None:
    """`<store>/gc.json`, or None when no collection ran (or its file cannot be read)."""
    try:
        return GcReport.model_validate_json((store / GC_REPORT).read_bytes())
    except (OSError, ValidationError):
        return None


def _check_owner(owner: str) -> str:
    if not _OWNER.match(owner):
        raise SnapshotError(
            f"owner {owner!r} of pinned references is not a name (lowercase letters, digits, . _ -).",
            field="owner",
            value=owner,
            fix="give the model's name",
        )
    return owner


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
