"""The pinned store: validated snapshot files, copied out of the training job's reach.

A training job owns its snapshot folders: it may move, delete or rewrite a version's files
at any time, also while that version serves or is the target of a rollback. So when a set is
validated, each part's file is copied into the store, a read-only, content-addressed folder
(by default `<state>/pinned/`), and from then on only the copy is used:

    <store>/ab/ab12...ef.safetensors     (the file's sha256; mode 0444)

- The copy is what validation checks: its bytes are hashed as they are written, and a copy
  whose hash is not the manifest's is thrown away (the training file changed, or is still
  being written). Once named by its hash, a copy never changes; pinning the same bytes again
  finds it and copies nothing.
- It is a copy (a reflink where the filesystem can share blocks copy-on-write, else bytes),
  never a hard link: a hard link shares the inode, so a training job rewriting its file in
  place would rewrite the pinned bytes too.
- A replica loads its weights with `load_verified`: one read of the pinned file, hashed, and
  the tensors parsed from those same bytes, so what it serves is what was validated.

A checkpoint snapshot (a Hugging Face folder: configs, tokenizer, safetensors shards) is pinned
file by file, each under its own sha256 with its suffix (`<sha256>.json`, `.jinja`,
`.safetensors`), plus the checkpoint's file list itself, whose sha256 is the snapshot's
(`ipnext.spec.model.checkpoint_digest`): `<store>/cd/cd34...90.json`. `load_verified_checkpoint`
checks the list and every file against their hashes and hands the part `CheckpointFiles`.

Faults: a copy is written under a temporary name and renamed into place only when complete
and hashed, so a crash leaves no half-written file under a hash name (at worst a `.partial`
file, which nothing reads, and which a collection deletes once older than its grace). Two pins
of the same bytes at once both copy, and the second rename replaces the first with identical
bytes. The store must be on a filesystem every Ray node reads (one machine in the dev stack;
shared storage on a cluster).

Collection (ipnext/store/pinned_store.py) deletes pinned files no model names that are older
than a grace period, holding the store's lock (`store_lock`) exclusively. A pin that finds its
bytes already there freshens the file's mtime under the same lock, shared: so a file is never
deleted between a pin finding it and its model naming it, as long as that takes less than the
grace.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ipnext.errors import SnapshotError
from ipnext.spec.model import SnapshotRef, checkpoint_digest, checkpoint_tree
from ipnext.store.snapshots import parse_safetensors_header

if TYPE_CHECKING:
    import torch

__all__ = [
    "CheckpointFiles",
    "load_verified",
    "load_verified_checkpoint",
    "pin",
    "pin_checkpoint",
    "pinned_files",
    "pinned_name",
    "pinned_path",
    "pinned_size",
    "store_lock",
    "verify",
    "verify_ref",
    "write_atomically",
]

_CHUNK = 1 << 20
_FICLONE = 0x40049409  # Linux ioctl: share the source's blocks copy-on-write (btrfs, xfs)
LOCK_FILE = "gc.lock"  # in the store's folder: `store_lock`


def pinned_name(sha256: str, suffix: str = ".safetensors") -> str:
    """The name of the file with this sha256 in the store: `<sha256><suffix>`."""
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise SnapshotError(
            f"sha256 {sha256!r} is not 64 lowercase hex digits.",
            field="sha256",
            value=sha256,
            fix="give the file's sha256 as hashlib's hexdigest() writes it",
        )
    return f"{sha256}{suffix}"


def pinned_path(store: Path, sha256: str, suffix: str = ".safetensors") -> Path:
    """Where the file with this sha256 lives in the store (whether it is there or not)."""
    return store / sha256[:2] / pinned_name(sha256, suffix)


def pinned_size(store: Path, sha256: str, checkpoint: bool = False) -> int:
    """The size of a part's pinned file (a checkpoint's manifest, else its safetensors file),
    what a pool replica reserves for it while it loads; 0 when it cannot be read (its load will
    say what is wrong with it)."""
    try:
        return pinned_path(store, sha256, ".json" if checkpoint else ".safetensors").stat().st_size
    except OSError:
        return 0


def pinned_files(ref: SnapshotRef) -> list[str]:
    """The names of every pinned file a part's snapshot needs: its safetensors file, or a
    checkpoint's file list (`<sha256>.json`) and each of its files with its suffix."""
    if ref.files is None:
        return [pinned_name(ref.sha256)]
    names = {pinned_name(ref.sha256, ".json")}
    names |= {pinned_name(digest, _suffix(name)) for name, digest in ref.files.items()}
    return sorted(names)


@contextlib.contextmanager
def store_lock(store: Path, *, exclusive: bool) -> Iterator[None]:
    """The store's lock (`<store>/gc.lock`, fcntl.flock): a collection holds it exclusively while
    it reads the references and deletes; a pin holds it shared while it finds and freshens a file
    already there, and a model while it writes its references."""
    store.mkdir(parents=True, exist_ok=True)
    fd = os.open(store / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _freshen(store: Path, target: Path) -> bool:
    """Whether `target` is in the store, its mtime set to now if so: a pinned file found again is
    as fresh as one just copied, so a collection within the grace keeps it until its model names
    it (under the lock, so a collection deciding to delete it has done so, or waits)."""
    if not target.is_file():
        return False  # nothing a collection could delete under the pin: no lock needed
    with store_lock(store, exclusive=False):
        try:
            os.utime(target)
        except FileNotFoundError:
            return False
    return True


def pin(source: Path, sha256: str, store: Path, suffix: str = ".safetensors") -> Path:
    """Copy `source` into the store under its sha256 and return the copy's path; raise
    SnapshotError (and keep nothing) if the bytes copied do not hash to `sha256`."""
    target = pinned_path(store, sha256, suffix)
    if _freshen(store, target):
        return target  # the same bytes, pinned before
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        digest = _copy(source, partial)
        if digest != sha256:
            raise SnapshotError(
                f"checksum mismatch: the file's sha256 is {digest}, the manifest says {sha256}.",
                field="sha256",
                value=sha256,
                fix="the file changed or is corrupt: write the snapshot again",
            )
        partial.chmod(0o444)
        # Atomic: the hash name only ever names complete bytes. No lock: the copy's mtime is its
        # last write, just now, so a collection running meanwhile finds it fresh.
        os.replace(partial, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
    _fsync_dir(target.parent)
    return target


def _suffix(name: str) -> str:
    return Path(name).suffix


def pin_checkpoint(folder: Path, files: dict[str, str], sha256: str, store: Path) -> Path:
    """Pin each file of a checkpoint folder, then its file list (named by `sha256`, the
    checkpoint's digest); return the list's path. Raise SnapshotError naming the file that is
    missing, not a plain file in the folder, or not what its sha256 says; a list whose digest is
    not `sha256` pins nothing."""
    if checkpoint_digest(files) != sha256:
        raise SnapshotError(
            f"sha256 {sha256} is not the digest of the checkpoint's file list ({checkpoint_digest(files)}).",
            field="sha256",
            value=sha256,
            fix="write the manifest again (ipnext snapshot import-hf)",
        )
    for i, (name, digest) in enumerate(sorted(files.items()), 1):
        source = folder / name
        if source.is_symlink() or not source.is_file():
            raise SnapshotError(
                f"{name}: not a plain file in {folder.name}/ (file {i} of {len(files)} the manifest lists).",
                field=f"files.{name}",
                value=str(source),
                fix="check that the download or training job finished writing the checkpoint",
            )
        try:
            pin(source, digest, store, _suffix(name))
        except SnapshotError as err:
            raise SnapshotError(f"{name}: {err}", field=f"files.{name}", value=digest) from None
    target = pinned_path(store, sha256, ".json")
    if not _freshen(store, target):
        write_atomically(target, checkpoint_tree(files))
    return target


def write_atomically(target: Path, data: bytes, mode: int = 0o444) -> None:
    """`data` at `target`, complete or not at all: written under a name of this process and
    thread, synced, then renamed into place (and the folder synced)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.partial")
    try:
        with open(partial, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        partial.chmod(mode)
        os.replace(partial, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
    _fsync_dir(target.parent)


def verify_ref(store: Path, ref: SnapshotRef) -> str | None:
    """`verify` for a part's snapshot of either kind: a checkpoint's list and every file of it."""
    if ref.files is None:
        return verify(store, ref.sha256)
    why = verify(store, ref.sha256, ".json")
    if why is not None:
        return f"the checkpoint's file list: {why}"
    for name, digest in sorted(ref.files.items()):
        why = verify(store, digest, _suffix(name))
        if why is not None:
            return f"{name}: {why}"
    return None


def verify(store: Path, sha256: str, suffix: str = ".safetensors") -> str | None:
    """Why the pinned copy of `sha256` cannot be served (missing, or its bytes changed), or
    None when it is whole. Reads the whole file: call it where a set is about to be relied on
    (a rollback target), not per request."""
    path = pinned_path(store, sha256, suffix)
    digest = hashlib.sha256()
    try:
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    except FileNotFoundError:
        return f"{path.name} is missing from the pinned store"
    except OSError as err:
        return f"{path.name} cannot be read: {err}"
    if digest.hexdigest() != sha256:
        return f"{path.name} hashes to {digest.hexdigest()}: its bytes changed"
    return None


def load_verified(path: Path, sha256: str) -> dict[str, torch.Tensor]:
    """The tensors of a pinned file, parsed from the very bytes that were hashed: raise
    SnapshotError if they are not the bytes validated (`sha256`)."""
    from safetensors.torch import load

    data = _read_verified(
        path,
        sha256,
        "sha256",
        f"{path}: sha256 {{digest}} is not {sha256}, the sha256 validated: the pinned copy was changed.",
    )
    parse_safetensors_header(data, path)  # refuses anything but safetensors before parsing it
    tensors: dict[str, torch.Tensor] = load(data)
    return tensors


class CheckpointFiles(Mapping[str, bytes]):
    """A checkpoint snapshot as a part receives it: file name -> the pinned bytes, each checked
    against its sha256 (safetensors files also parsed as safetensors headers, never unpickled).
    A part factory that serves checkpoints takes this in place of the tensor dict."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self._files = files

    def __getitem__(self, name: str) -> bytes:
        return self._files[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def json(self, name: str) -> dict[str, object]:
        """A JSON file of the checkpoint, as an object; SnapshotError naming it otherwise."""
        try:
            value = json.loads(self._files[name])
        except KeyError:
            raise SnapshotError(f"the checkpoint has no {name}", field=f"files.{name}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise SnapshotError(f"{name}: not JSON ({err})", field=f"files.{name}") from None
        if not isinstance(value, dict):
            raise SnapshotError(f"{name}: not a JSON object", field=f"files.{name}")
        return value

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        loaded: dict[str, torch.Tensor] = load(self._files[name])
        return loaded


def load_verified_checkpoint(path: Path, sha256: str) -> CheckpointFiles:
    """The files of the checkpoint whose pinned file list is at `path`: the list and each file
    checked against their sha256 on the bytes read; SnapshotError naming what changed."""
    store = path.parent.parent
    listing = _read_verified(
        path,
        sha256,
        "sha256",
        f"{path}: sha256 {{digest}} is not {sha256}: the pinned file list was changed.",
    )
    files: dict[str, str] = json.loads(listing)["files"]
    out: dict[str, bytes] = {}
    for name, file_sha in sorted(files.items()):
        file_path = pinned_path(store, file_sha, _suffix(name))
        data = _read_verified(
            file_path,
            file_sha,
            f"files.{name}",
            f"{name} ({file_path}): its pinned bytes changed since validation.",
        )
        if name.endswith(".safetensors"):
            parse_safetensors_header(data, Path(name))
        out[name] = data
    return CheckpointFiles(out)


def _read_verified(path: Path, sha256: str, field: str, changed: str) -> bytes:
    """A pinned file's bytes, read once and hashed; SnapshotError (`changed`, its `{digest}`
    filled in) when they are not the bytes validated."""
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise SnapshotError(
            changed.replace("{digest}", digest),
            field=field,
            value=sha256,
            fix="publish the snapshot again, so it is validated and pinned again",
        )
    return data


def _copy(source: Path, target: Path) -> str:
    """Copy `source` to a new file `target`; return the sha256 of the bytes in `target`."""
    digest = hashlib.sha256()
    with source.open("rb") as src, open(target, "xb") as dst:
        try:
            fcntl.ioctl(dst.fileno(), _FICLONE, src.fileno())
            cloned = True
        except OSError:
            cloned = False
        if cloned:  # shared blocks: hash the copy itself
            dst.flush()
            with target.open("rb") as copy:
                for chunk in iter(lambda: copy.read(_CHUNK), b""):
                    digest.update(chunk)
        else:
            for chunk in iter(lambda: src.read(_CHUNK), b""):
                digest.update(chunk)
                dst.write(chunk)
        dst.flush()
        os.fsync(dst.fileno())
    return digest.hexdigest()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
