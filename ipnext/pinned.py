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

Faults: a copy is written under a temporary name and renamed into place only when complete
and hashed, so a crash leaves no half-written file under a hash name (at worst a `.partial`
file, which nothing reads). Two pins of the same bytes at once both copy, and the second
rename replaces the first with identical bytes. The store must be on a filesystem every Ray node
reads (one machine in the dev stack; shared storage on a cluster).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ipnext.errors import SnapshotError
from ipnext.snapshots import parse_safetensors_header

if TYPE_CHECKING:
    import torch

__all__ = ["load_verified", "pin", "pinned_path", "verify"]

_CHUNK = 1 << 20
_FICLONE = 0x40049409  # Linux ioctl: share the source's blocks copy-on-write (btrfs, xfs)


def pinned_path(store: Path, sha256: str) -> Path:
    """Where the file with this sha256 lives in the store (whether it is there or not)."""
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise SnapshotError(
            f"sha256 {sha256!r} is not 64 lowercase hex digits.",
            field="sha256",
            value=sha256,
            fix="give the file's sha256 as hashlib's hexdigest() writes it",
        )
    return store / sha256[:2] / f"{sha256}.safetensors"


def pin(source: Path, sha256: str, store: Path) -> Path:
    """Copy `source` into the store under its sha256 and return the copy's path; raise
    SnapshotError (and keep nothing) if the bytes copied do not hash to `sha256`."""
    target = pinned_path(store, sha256)
    if target.is_file():
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
        os.replace(partial, target)  # atomic: the hash name only ever names complete bytes
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
    _fsync_dir(target.parent)
    return target


def verify(store: Path, sha256: str) -> str | None:
    """Why the pinned copy of `sha256` cannot be served (missing, or its bytes changed), or
    None when it is whole. Reads the whole file: call it where a set is about to be relied on
    (a rollback target), not per request."""
    path = pinned_path(store, sha256)
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

    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise SnapshotError(
            f"{path}: sha256 {digest} is not {sha256}, the sha256 validated: the pinned copy was changed.",
            field="sha256",
            value=sha256,
            fix="publish the snapshot again, so it is validated and pinned again",
        )
    parse_safetensors_header(data, path)  # refuses anything but safetensors before parsing it
    tensors: dict[str, torch.Tensor] = load(data)
    return tensors


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
