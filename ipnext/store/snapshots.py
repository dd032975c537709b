"""Snapshot folders as training writes them, and the checks every snapshot passes before use.

A training job writes one folder per version under `<snapshot root>/<model>/`:

    <root>/feed-ranker/v2/
        manifest.json          {"format": "ipnext.snapshot/v1", "model": "feed-ranker",
                                "version": "v2", "created_at": "<ISO 8601>",
                                "parts": {"embed": {"file": "embed.safetensors",
                                                    "sha256": "<64 hex>"}, ...}}
        embed.safetensors
        dense.safetensors

A part may instead be a Hugging Face checkpoint folder (`config.json`, safetensors weights,
possibly sharded, `tokenizer.json`, ...): its entry names the folder, `"."` (the snapshot
folder itself) or one folder beside the manifest, and lists each file with its sha256; the
entry's own sha256 is `ipnext.spec.model.checkpoint_digest` of that list:

        "parts": {"lm": {"checkpoint": ".", "sha256": "<digest of files>",
                         "files": {"config.json": "<64 hex>", "model.safetensors": "<64 hex>",
                                   "tokenizer.json": "<64 hex>", ...}}}

`ipnext snapshot import-hf` writes such a manifest for a folder a download or training job left
under a snapshot root (`import_checkpoint`).

The manifest is written last, so a folder without one is still being written and
is ignored. Weights are only ever read as safetensors: nothing here unpickles.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal
from urllib.parse import unquote, urlparse

from pydantic import Field, ValidationError, model_validator

from ipnext.errors import SnapshotError
from ipnext.names import Frozen
from ipnext.spec.model import (
    CHECKPOINT_SUFFIXES,
    CheckpointFileName,
    Sha256,
    SnapshotSetRequest,
    Version,
    checkpoint_digest,
)
from ipnext.spec.reading import format_validation_error

if TYPE_CHECKING:
    import torch

__all__ = [
    "MANIFEST",
    "Manifest",
    "ManifestPart",
    "discover",
    "folder_fingerprint",
    "import_checkpoint",
    "inspect_safetensors",
    "load_weights",
    "read_manifest",
    "request_from_folder",
    "resolve_in_roots",
    "sha256_file",
    "write_snapshot",
]

MANIFEST = "manifest.json"
_MAX_HEADER = 100 * 1024 * 1024
# safetensors dtype tags -> torch dtype names
_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


class ManifestPart(Frozen):
    """One part: a safetensors `file` beside the manifest, or a `checkpoint` folder ("." or a
    folder beside the manifest, never a path) with its `files`."""

    file: str | None = Field(default=None, pattern=r"^[^/\\]+$")  # a file beside the manifest, never a path
    checkpoint: str | None = Field(default=None, pattern=r"^(\.|[^./\\][^/\\]*)$")
    files: dict[CheckpointFileName, Sha256] | None = None
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @model_validator(mode="after")
    def _one_kind(self) -> ManifestPart:
        if (self.file is None) == (self.checkpoint is None):
            raise ValueError("give either file (one safetensors file) or checkpoint (a folder), not both")
        if self.checkpoint is not None:
            if not self.files:
                raise ValueError("checkpoint: list its files, each with its sha256")
            if checkpoint_digest(self.files) != self.sha256:
                raise ValueError("sha256: not the digest of the checkpoint's file list (checkpoint_digest)")
        elif self.files is not None:
            raise ValueError("files: only a checkpoint lists files")
        return self


class Manifest(Frozen):
    format: Literal["ipnext.snapshot/v1"] = "ipnext.snapshot/v1"
    model: str
    version: Version  # the grammar is ipnext.spec.model.VERSION_PATTERN
    created_at: datetime
    parts: dict[str, ManifestPart] = Field(min_length=1)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def resolve_in_roots(uri: str, roots: list[Path]) -> Path:
    """The file a snapshot URI names, refused unless it lies inside a configured root.

    Symlinks and `..` are resolved first, so neither can step outside a root.
    """
    parsed = urlparse(uri)
    if parsed.scheme not in ("", "file"):
        raise SnapshotError(
            f"snapshot uri {uri!r}: scheme {parsed.scheme!r} is not supported.",
            field="uri",
            value=uri,
            fix="use a file:// URI or a plain path inside a snapshot root",
        )
    raw = unquote(parsed.path) if parsed.scheme == "file" else uri  # as_uri() encodes spaces
    path = Path(raw).resolve()
    for root in roots:
        if path.is_relative_to(root.resolve()):
            return path
    raise SnapshotError(
        f"snapshot uri {uri!r} resolves to {path}, outside every snapshot root {[str(r) for r in roots]}.",
        field="uri",
        value=uri,
        fix="write snapshots under a configured snapshot root (snapshot_roots in ipnext.yaml)",
    )


def inspect_safetensors(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor names -> (shape, dtype) from a safetensors header, reading no tensor data.

    Anything else (a pickle, a zip from torch.save, random bytes) is refused here.
    """
    with path.open("rb") as f:
        return _read_header(f, path.stat().st_size, path)


def parse_safetensors_header(data: bytes, path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """`inspect_safetensors` for a file already read into memory (`path` names it in errors)."""
    return _read_header(io.BytesIO(data), len(data), path)


def _read_header(f: BinaryIO, size: int, path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    head = f.read(8)
    if len(head) < 8:
        raise _not_safetensors(path, "file is shorter than a safetensors header")
    (header_len,) = struct.unpack("<Q", head)
    if header_len > min(size - 8, _MAX_HEADER):
        raise _not_safetensors(path, "its first 8 bytes are not a safetensors header length")
    raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _not_safetensors(path, "its header is not JSON") from None
    if not isinstance(header, dict):
        raise _not_safetensors(path, "its header is not a JSON object")
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise _not_safetensors(path, f"entry {name!r} of its header is malformed") from None
        if not 0 <= begin <= end <= size - 8 - header_len:
            raise _not_safetensors(path, f"tensor {name!r} points past the end of the file")
        tensors[name] = (shape, dtype)
    return tensors


def _not_safetensors(path: Path, why: str) -> SnapshotError:
    return SnapshotError(
        f"{path.name} is not a safetensors file: {why}. Weights are never unpickled.",
        field="file",
        value=str(path),
        fix="save weights with safetensors (safetensors.torch.save_file)",
    )


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """Load weights from a safetensors file (after inspect_safetensors accepted it)."""
    from safetensors.torch import load_file

    inspect_safetensors(path)
    return load_file(str(path))


def read_manifest(folder: Path) -> Manifest:
    file = folder / MANIFEST
    try:
        data: Any = json.loads(file.read_text())
    except FileNotFoundError:
        raise SnapshotError(
            f"{folder}: no {MANIFEST}.",
            field="folder",
            value=str(folder),
            fix="point at a snapshot folder that training finished writing",
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SnapshotError(f"{file}: not JSON: {err}", field=MANIFEST, value=str(file)) from None
    try:
        return Manifest.model_validate(data)
    except ValidationError as err:
        raise _manifest_error(file, err) from None


def _manifest_error(file: Path, err: ValidationError) -> SnapshotError:
    """A manifest field that does not read, named (e.g. `version`, whose grammar
    docs/reference/parts-and-snapshots.md gives)."""
    first = err.errors(include_url=False)[0]
    field = ".".join(str(p) for p in first["loc"]) or MANIFEST
    fix = (
        "write a version of ASCII letters, digits, '.', '_' and '-', starting with a letter or digit "
        "(at most 128 characters), e.g. v2 or 2024-06-01.1"
        if field == "version"
        else None
    )
    return SnapshotError(
        f"{file}: {format_validation_error(err)}", field=field, value=first.get("input"), fix=fix
    )


def request_from_folder(folder: Path) -> SnapshotSetRequest:
    """The publish request for a snapshot folder: one SnapshotRef per part in its manifest."""
    folder = folder.resolve()
    manifest = read_manifest(folder)
    try:
        return SnapshotSetRequest.model_validate(
            {
                "model": manifest.model,
                "version": manifest.version,
                "parts": {
                    part: {
                        "uri": _part_path(folder, entry).as_uri(),
                        "sha256": entry.sha256,
                        "snapshot_id": f"{manifest.model}/{part}@{manifest.version}",
                        "files": entry.files,
                    }
                    for part, entry in manifest.parts.items()
                },
            }
        )
    except ValidationError as err:  # a model or part name the manifest gives is not a name
        raise _manifest_error(folder / MANIFEST, err) from None


def _part_path(folder: Path, entry: ManifestPart) -> Path:
    """The file or checkpoint folder a manifest entry names, beside the manifest."""
    if entry.file is not None:
        return folder / entry.file
    return folder if entry.checkpoint == "." else folder / str(entry.checkpoint)


def discover(
    roots: list[Path], model: str, unreadable: list[tuple[Path, str]] | None = None
) -> list[tuple[Path, Manifest]]:
    """Finished snapshot folders of a model under every root, oldest first.

    A folder whose manifest does not read (malformed JSON, a missing field) is skipped, and
    added with the reason to `unreadable` when given: one bad folder never hides the others."""
    found: list[tuple[Path, Manifest]] = []
    for root in roots:
        model_dir = root / model
        if not model_dir.is_dir():
            continue
        for folder in sorted(model_dir.iterdir()):
            if not (folder / MANIFEST).is_file():
                continue
            try:
                manifest = read_manifest(folder)
            except SnapshotError as err:
                if unreadable is not None:
                    unreadable.append((folder, str(err)))
                continue
            if manifest.model == model:
                found.append((folder, manifest))
    found.sort(key=lambda item: (item[1].created_at, item[1].version))
    return found


def folder_fingerprint(folder: Path) -> str:
    """What changes when training writes a snapshot folder again: its manifest's bytes and
    each file's name, size and modification time (no file is read beyond the manifest)."""
    digest = hashlib.sha256()
    digest.update((folder / MANIFEST).read_bytes())
    for path in sorted(folder.iterdir()):
        if path.name == MANIFEST or not path.is_file():
            continue
        stat = path.stat()
        digest.update(f"\0{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def write_snapshot(
    folder: Path, model: str, version: str, weights_by_part: dict[str, dict[str, torch.Tensor]]
) -> Manifest:
    """Save each part's weights as safetensors, then the manifest (last, so readers see it whole)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    parts: dict[str, ManifestPart] = {}
    for part, weights in weights_by_part.items():
        file = folder / f"{part}.safetensors"
        save_file({k: v.contiguous() for k, v in weights.items()}, str(file))
        parts[part] = ManifestPart(file=file.name, sha256=sha256_file(file))
    manifest = Manifest(model=model, version=version, created_at=datetime.now(UTC), parts=parts)
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(manifest.model_dump_json(indent=2, exclude_none=True))
    tmp.replace(folder / MANIFEST)
    return manifest


def import_checkpoint(
    checkpoint: Path,
    model: str,
    part: str | Sequence[str],
    version: str,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[Path, Manifest, list[str]]:
    """Write the manifest that makes a Hugging Face checkpoint folder a snapshot of `part` (or
    of each of several parts, in one write: a disaggregated prefill/decode pair serves the same
    checkpoint): every `.json`, `.jinja` and `.safetensors` file in it, each hashed (progress to
    `log`).

    The folder must be the snapshot folder `<root>/<model>/<version>/` itself, or one folder in
    it (for a model of several parts), so that the snapshot watch finds it and the manifest
    names nothing outside it. A manifest already there keeps its other parts. Returns the
    snapshot folder, the manifest and the files left out (anything else, e.g. pickled weights,
    which are never read)."""
    checkpoint = checkpoint.resolve()
    if not checkpoint.is_dir():
        raise SnapshotError(f"{checkpoint}: not a folder", field="folder", value=str(checkpoint))
    if checkpoint.parent.name == model and checkpoint.name == version:
        snapshot, where = checkpoint, "."
    elif checkpoint.parent.parent.name == model and checkpoint.parent.name == version:
        snapshot, where = checkpoint.parent, checkpoint.name
    else:
        raise SnapshotError(
            f"{checkpoint}: a checkpoint snapshot lives in <root>/{model}/{version}/ (or a folder "
            "in it), so the snapshot watch finds it and its manifest names nothing outside it.",
            field="folder",
            value=str(checkpoint),
            fix=(
                f"move the folder to <snapshot root>/{model}/{version}/ "
                f"(or .../{version}/{part}/) and run this again"
            ),
        )
    names = sorted(p.name for p in checkpoint.iterdir() if p.is_file() and not p.is_symlink())
    taken = [n for n in names if n.endswith(CHECKPOINT_SUFFIXES) and not n.startswith(".") and n != MANIFEST]
    left_out = [n for n in names if n not in taken and n != MANIFEST]
    left_out += sorted(p.name + "/" for p in checkpoint.iterdir() if p.is_dir() or p.is_symlink())
    if "config.json" not in taken or not any(n.endswith(".safetensors") for n in taken):
        pickled = [n for n in left_out if n.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt"))]
        raise SnapshotError(
            f"{checkpoint}: a checkpoint needs config.json and safetensors weights; "
            f"found {taken or 'neither'}"
            + (f" (and {pickled}: pickled weights are never read)" if pickled else ""),
            field="folder",
            value=str(checkpoint),
            fix="save it with save_pretrained(..., safe_serialization=True)",
        )
    files: dict[str, str] = {}
    for i, name in enumerate(taken, 1):
        size = (checkpoint / name).stat().st_size
        log(f"  [{i}/{len(taken)}] sha256 {name} ({size / 1e6:.1f} MB)")
        files[name] = sha256_file(checkpoint / name)
    entry = ManifestPart(checkpoint=where, files=files, sha256=checkpoint_digest(files))
    parts: dict[str, ManifestPart] = {}
    if (snapshot / MANIFEST).is_file():
        existing = read_manifest(snapshot)
        if existing.model != model or existing.version != version:
            raise SnapshotError(
                f"{snapshot / MANIFEST}: names {existing.model}@{existing.version}, not {model}@{version}",
                field=MANIFEST,
                fix="import into the folder of that model and version",
            )
        parts = dict(existing.parts)
    for name in [part] if isinstance(part, str) else part:
        parts[name] = entry
    manifest = Manifest(model=model, version=version, created_at=datetime.now(UTC), parts=parts)
    tmp = snapshot / (MANIFEST + ".tmp")
    tmp.write_text(manifest.model_dump_json(indent=2, exclude_none=True))
    tmp.replace(snapshot / MANIFEST)
    return snapshot, manifest, left_out
