"""Checks a snapshot passes before anything serves it: confined path, file, checksum (of the
copy pinned for serving), safetensors format (never unpickled), and tensors that fit the part.

`pin_snapshot` runs no model code; `check_part_fits` imports the part's factory and builds the
part with the weights, so the worker runs it in a child process (activities/spec_check.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ipnext.errors import SnapshotError, SpecError
from ipnext.spec.model import ModelSpec, SnapshotRef, SnapshotSetRequest, import_factory
from ipnext.store.pinned import load_verified_checkpoint, pin, pin_checkpoint
from ipnext.store.snapshots import inspect_safetensors, load_weights, resolve_in_roots

__all__ = ["check_part_fits", "complete_set", "pin_snapshot", "validate_snapshot"]


def complete_set(
    spec: ModelSpec, request: SnapshotSetRequest, serving: dict[str, SnapshotRef] | None
) -> dict[str, SnapshotRef]:
    """A snapshot for every part: the request's, and with `independent`, the serving set's for the rest."""
    for part in request.parts:
        if part not in spec.parts:
            raise SnapshotError(
                f"parts.{part}: model {spec.name} has no part {part!r}.",
                field=f"parts.{part}",
                value=part,
                fix=f"publish snapshots for the parts {sorted(spec.parts)}",
            )
    missing = sorted(set(spec.parts) - set(request.parts))
    if not missing:
        return dict(request.parts)
    if spec.sync == "synchronized" or serving is None:
        why = (
            "the model is synchronized: every set names every part"
            if spec.sync == "synchronized"
            else "no set serves yet to take them from"
        )
        raise SnapshotError(
            f"parts: no snapshot for {missing} ({why}).",
            field="parts",
            value=missing,
            fix="add a snapshot for every part to the set",
        )
    return {**{p: serving[p] for p in missing}, **request.parts}


def validate_snapshot(spec: ModelSpec, part: str, ref: SnapshotRef, roots: list[Path], store: Path) -> None:
    """Pin the part's file into `store` (ipnext/store/pinned.py) and check the pinned copy: raise a
    SnapshotError naming the part, the snapshot and what is wrong; return if it fits. What is
    checked is what replicas will load, whatever happens to the training file afterwards.
    In this process: the worker runs `check_part_fits` in a child instead."""
    check_part_fits(spec, part, ref, pin_snapshot(spec, part, ref, roots, store))


def pin_snapshot(spec: ModelSpec, part: str, ref: SnapshotRef, roots: list[Path], store: Path) -> Path:
    """The part's file, confined to `roots`, pinned into `store` with its checksum checked and
    its header read as safetensors: the pinned copy's path. Runs no model code."""
    where = f"parts.{part} ({ref.snapshot_id})"
    try:
        source = resolve_in_roots(ref.uri, roots)
    except SnapshotError as err:
        raise SnapshotError(f"{where}: {err}", field=f"parts.{part}.uri", value=ref.uri) from None
    if ref.files is not None:
        return _pin_checkpoint(where, part, ref, source, store)
    if not source.is_file():
        raise SnapshotError(
            f"{where}: file {source} does not exist.",
            field=f"parts.{part}.uri",
            value=ref.uri,
            fix="check that training finished writing the snapshot",
        )
    try:
        path = pin(source, ref.sha256, store)
    except SnapshotError as err:
        raise SnapshotError(f"{where}: {err}", field=f"parts.{part}.sha256", value=ref.sha256) from None
    try:
        inspect_safetensors(path)
    except SnapshotError as err:
        raise SnapshotError(f"{where}: {err}", field=f"parts.{part}.uri", value=ref.uri) from None
    return path


def _pin_checkpoint(where: str, part: str, ref: SnapshotRef, source: Path, store: Path) -> Path:
    """A checkpoint folder's files pinned (each checksum checked), every safetensors file's header
    read: the pinned file list's path."""
    assert ref.files is not None
    if not source.is_dir():
        raise SnapshotError(
            f"{where}: checkpoint folder {source} does not exist.",
            field=f"parts.{part}.uri",
            value=ref.uri,
            fix="check that the download or training job finished writing the checkpoint",
        )
    try:
        listing = pin_checkpoint(source, ref.files, ref.sha256, store)
    except SnapshotError as err:
        raise SnapshotError(f"{where}: {err}", field=f"parts.{part}.{err.field}", value=err.value) from None
    _checkpoint_header(where, part, ref, listing)
    return listing


def _checkpoint_header(
    where: str, part: str, ref: SnapshotRef, listing: Path
) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of a pinned checkpoint's safetensors files, by name; a name in two files is
    refused (which would the part get?)."""
    from ipnext.store.pinned import pinned_path

    assert ref.files is not None
    header: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, digest in sorted(ref.files.items()):
        if not name.endswith(".safetensors"):
            continue
        try:
            tensors = inspect_safetensors(pinned_path(listing.parent.parent, digest))
        except SnapshotError as err:
            raise SnapshotError(f"{where}: {name}: {err}", field=f"parts.{part}.files.{name}") from None
        twice = sorted(set(tensors) & set(header))
        if twice:
            raise SnapshotError(
                f"{where}: {name} holds {twice[:3]} again, which another file of the checkpoint holds.",
                field=f"parts.{part}.files.{name}",
                fix="save the checkpoint again (each tensor in one shard)",
            )
        header |= tensors
    return header


def check_part_fits(
    spec: ModelSpec, part: str, ref: SnapshotRef, path: Path, prefixes: Sequence[str] | None = None
) -> None:
    """Build the part from its pinned weights at `path` and check the tensors it expects: the
    model's own code runs here. `prefixes`: where its factory must be defined."""
    where = f"parts.{part} ({ref.snapshot_id})"
    header = inspect_safetensors(path) if ref.files is None else _checkpoint_header(where, part, ref, path)
    part_spec = spec.parts[part]
    try:
        factory = import_factory(part_spec.factory, prefixes)
    except SpecError as err:
        raise SpecError(
            f"parts.{part}.factory: {err}", field=f"parts.{part}.factory", value=part_spec.factory
        ) from None
    try:
        # A checkpoint part gets its files (CheckpointFiles), a one-file part its tensors.
        weights = load_weights(path) if ref.files is None else load_verified_checkpoint(path, ref.sha256)
        built = factory(weights, dict(part_spec.config))
    except MemoryError:
        raise  # out of the validation's memory: the caller names its limit
    except Exception as err:  # the part rejected the weights; say so with its words
        raise SnapshotError(
            f"{where}: tensors do not fit the part: {type(err).__name__}: {err}",
            field=f"parts.{part}",
            value=ref.uri,
            fix="publish weights trained for this part's config",
        ) from None
    if part_spec.batching is not None and not callable(getattr(built, "batch", None)):
        raise SpecError(
            f"parts.{part}.batching: the part built by {part_spec.factory} has no `batch` method, "
            "so its calls cannot be batched.",
            field=f"parts.{part}.batching",
            value=part_spec.batching.model_dump(),
            fix="remove `batching`, or give the part an `async batch(list_of_inputs) -> list` method",
        )
    expected_fn = getattr(built, "expected_tensors", None)
    if expected_fn is None:
        return
    expected: dict[str, tuple[tuple[int, ...], str]] = expected_fn()
    for name, (shape, dtype) in sorted(expected.items()):
        if name not in header:
            raise _mismatch(where, part, ref, f"tensor {name!r} is missing")
        got_shape, got_dtype = header[name]
        if tuple(got_shape) != tuple(shape) or got_dtype != dtype:
            raise _mismatch(
                where,
                part,
                ref,
                f"tensor {name!r} is {got_dtype}{list(got_shape)}, the part expects {dtype}{list(shape)}",
            )
    extra = sorted(set(header) - set(expected))
    if extra:
        raise _mismatch(where, part, ref, f"unexpected tensors {extra}")


def _mismatch(where: str, part: str, ref: SnapshotRef, what: str) -> SnapshotError:
    return SnapshotError(
        f"{where}: tensors do not fit the part: {what}.",
        field=f"parts.{part}",
        value=ref.uri,
        fix="publish weights trained for this part's config",
    )
