"""Snapshot folders: manifest round trip, publish requests, discovery, confinement, safetensors headers."""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ipnext.errors import SnapshotError
from ipnext.spec.model import ModelSpec, SnapshotRef
from ipnext.store.snapshots import (
    MANIFEST,
    discover,
    folder_fingerprint,
    inspect_safetensors,
    load_weights,
    read_manifest,
    request_from_folder,
    resolve_in_roots,
    sha256_file,
    write_snapshot,
)
from ipnext.store.validation import validate_snapshot

WEIGHTS = {
    "embed": {"table": torch.arange(12, dtype=torch.float32).reshape(3, 4)},
    "dense": {"w": torch.ones(2, 5, dtype=torch.float16), "steps": torch.tensor([7], dtype=torch.int64)},
}


def snapshot(root: Path, version: str, model: str = "feed-ranker") -> Path:
    folder = root / model / version
    write_snapshot(folder, model, version, WEIGHTS)
    return folder


# --- manifest ---------------------------------------------------------------------------------


def test_write_and_read_manifest_round_trip(tmp_path: Path) -> None:
    folder = tmp_path / "feed-ranker" / "v1"
    written = write_snapshot(folder, "feed-ranker", "v1", WEIGHTS)
    read = read_manifest(folder)
    assert read == written
    assert read.format == "ipnext.snapshot/v1"
    assert (read.model, read.version) == ("feed-ranker", "v1")
    assert {p: e.file for p, e in read.parts.items()} == {
        "embed": "embed.safetensors",
        "dense": "dense.safetensors",
    }
    for part, entry in read.parts.items():
        assert entry.sha256 == sha256_file(folder / entry.file)
        loaded = load_weights(folder / entry.file)
        assert set(loaded) == set(WEIGHTS[part])
        for name, tensor in WEIGHTS[part].items():
            assert torch.equal(loaded[name], tensor)
    assert not (folder / (MANIFEST + ".tmp")).exists()


def test_read_manifest_without_one(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match=r"no manifest\.json") as info:
        read_manifest(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_read_manifest_that_is_not_json(tmp_path: Path) -> None:
    (tmp_path / MANIFEST).write_text("{nope")
    with pytest.raises(SnapshotError, match="not JSON"):
        read_manifest(tmp_path)


def test_read_manifest_with_a_path_as_file_is_rejected(tmp_path: Path) -> None:
    folder = snapshot(tmp_path, "v1")
    data = json.loads((folder / MANIFEST).read_text())
    data["parts"]["embed"]["file"] = "../../etc/passwd"
    (folder / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(SnapshotError) as info:
        read_manifest(folder)
    assert "parts.embed.file" in str(info.value)
    assert "'../../etc/passwd'" in str(info.value)


def test_sha256_file_matches_hashlib(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"abc")
    assert sha256_file(path) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


# --- request_from_folder ----------------------------------------------------------------------


def test_request_from_folder(tmp_path: Path) -> None:
    folder = snapshot(tmp_path, "v3")
    request = request_from_folder(folder)
    assert request.model == "feed-ranker"
    assert request.version == "v3"
    assert sorted(request.parts) == ["dense", "embed"]
    for part, ref in request.parts.items():
        file = (folder / f"{part}.safetensors").resolve()
        assert ref.uri == file.as_uri()
        assert ref.uri.startswith("file:///")
        assert ref.sha256 == sha256_file(file)
        assert ref.snapshot_id == f"feed-ranker/{part}@v3"
        assert resolve_in_roots(ref.uri, [tmp_path]) == file


def test_request_from_a_folder_with_a_space_resolves_back_to_its_files(tmp_path: Path) -> None:
    # BUG: request_from_folder writes Path.as_uri(), which percent-encodes (' ' -> %20), but
    # resolve_in_roots uses urlparse(uri).path without unquoting it, so the URI names a
    # different path ('snap%20root') and is refused as outside the root.
    root = tmp_path / "snap root"
    folder = snapshot(root, "v1")
    ref = request_from_folder(folder).parts["embed"]
    assert "%20" in ref.uri
    assert resolve_in_roots(ref.uri, [root]) == (folder / "embed.safetensors").resolve()


# --- discover ---------------------------------------------------------------------------------


def test_discover_lists_finished_folders_oldest_first(tmp_path: Path) -> None:
    snapshot(tmp_path, "v9")  # written first, so oldest despite its name
    time.sleep(0.002)  # created_at is the clock's (microseconds): 2 ms on, the order is certain
    snapshot(tmp_path, "v10")
    time.sleep(0.002)
    snapshot(tmp_path, "a-last")
    (tmp_path / "feed-ranker" / "half-written").mkdir()
    (tmp_path / "feed-ranker" / "half-written" / "embed.safetensors").write_bytes(b"x")
    (tmp_path / "feed-ranker" / "stray-file.txt").write_text("not a folder")
    found = discover([tmp_path], "feed-ranker")
    assert [folder.name for folder, _ in found] == ["v9", "v10", "a-last"]
    assert [m.version for _, m in found] == ["v9", "v10", "a-last"]
    created = [m.created_at for _, m in found]
    assert created == sorted(created)


def test_discover_across_roots_and_models(tmp_path: Path) -> None:
    first, second = tmp_path / "one", tmp_path / "two"
    snapshot(first, "v1")
    time.sleep(0.002)
    snapshot(second, "v2")
    snapshot(first, "v1", model="other-model")
    # A manifest for another model inside this model's folder is not this model's snapshot.
    write_snapshot(first / "feed-ranker" / "foreign", "other-model", "x", WEIGHTS)
    found = discover([second, first, tmp_path / "missing"], "feed-ranker")
    assert [(folder.parent.parent.name, m.version) for folder, m in found] == [("one", "v1"), ("two", "v2")]
    assert discover([first], "nobody") == []


def test_one_unreadable_manifest_hides_no_other_version(tmp_path: Path) -> None:
    snapshot(tmp_path, "v1")
    for name, text in (("broken", "{not json"), ("binary", None), ("incomplete", '{"format": "x"}')):
        folder = tmp_path / "feed-ranker" / name
        folder.mkdir()
        if text is None:
            (folder / "manifest.json").write_bytes(b"\xff\xfe\x00garbage")
        else:
            (folder / "manifest.json").write_text(text)
    time.sleep(0.002)
    snapshot(tmp_path, "v2")
    unreadable: list[tuple[Path, str]] = []
    found = discover([tmp_path], "feed-ranker", unreadable)
    assert [m.version for _, m in found] == ["v1", "v2"]
    assert sorted(folder.name for folder, _ in unreadable) == ["binary", "broken", "incomplete"]
    assert all("manifest.json" in why for _, why in unreadable)
    assert [m.version for _, m in discover([tmp_path], "feed-ranker")] == ["v1", "v2"]  # no list: skipped


def test_a_folders_fingerprint_changes_only_when_training_writes_it_again(tmp_path: Path) -> None:
    folder = snapshot(tmp_path, "v1")
    first = folder_fingerprint(folder)
    assert folder_fingerprint(folder) == first
    weights = folder / "embed.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data + b"\0")  # rewritten (here: longer)
    assert folder_fingerprint(folder) != first


# --- resolve_in_roots -------------------------------------------------------------------------


def test_resolve_accepts_paths_inside_a_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    file = root / "m" / "v1" / "w.safetensors"
    file.parent.mkdir(parents=True)
    file.write_bytes(b"")
    other = tmp_path / "other"
    other.mkdir()
    assert resolve_in_roots(file.as_uri(), [other, root]) == file.resolve()
    assert resolve_in_roots(str(file), [root]) == file.resolve()
    assert resolve_in_roots(f"file://{root}/m/../m/v1/w.safetensors", [root]) == file.resolve()


@pytest.mark.parametrize("template", ["file://{root}/../secret", "{root}/m/../../secret", "{root}/.."])
def test_resolve_rejects_dot_dot_escapes(tmp_path: Path, template: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "secret").write_text("s")
    uri = template.format(root=root)
    with pytest.raises(SnapshotError) as info:
        resolve_in_roots(uri, [root])
    assert "outside" in str(info.value)
    assert info.value.field == "uri"
    assert info.value.value == uri


def test_resolve_rejects_a_symlink_pointing_outside(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"x")
    link = root / "innocent.safetensors"
    os.symlink(secret, link)
    with pytest.raises(SnapshotError) as info:
        resolve_in_roots(link.as_uri(), [root])
    assert "outside" in str(info.value)
    assert str(secret) in str(info.value)


def test_resolve_rejects_a_symlinked_folder_pointing_outside(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    (outside / "v1").mkdir(parents=True)
    (outside / "v1" / "w.safetensors").write_bytes(b"x")
    os.symlink(outside, root / "model")
    with pytest.raises(SnapshotError, match="outside"):
        resolve_in_roots(str(root / "model" / "v1" / "w.safetensors"), [root])


@pytest.mark.parametrize("uri", ["http://example.com/w.safetensors", "s3://bucket/w.safetensors"])
def test_resolve_rejects_other_schemes(tmp_path: Path, uri: str) -> None:
    with pytest.raises(SnapshotError) as info:
        resolve_in_roots(uri, [tmp_path])
    assert "scheme" in str(info.value)
    assert repr(uri.split(":")[0]) in str(info.value)


def test_resolve_rejects_a_sibling_with_a_common_prefix(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    sibling = tmp_path / "root-evil" / "w.safetensors"
    sibling.parent.mkdir()
    sibling.write_bytes(b"x")
    with pytest.raises(SnapshotError, match="outside"):
        resolve_in_roots(sibling.as_uri(), [root])


# --- inspect_safetensors ----------------------------------------------------------------------


def test_inspect_safetensors_reads_shapes_and_dtypes(tmp_path: Path) -> None:
    folder = snapshot(tmp_path, "v1")
    assert inspect_safetensors(folder / "embed.safetensors") == {"table": ((3, 4), "float32")}
    assert inspect_safetensors(folder / "dense.safetensors") == {
        "w": ((2, 5), "float16"),
        "steps": ((1,), "int64"),
    }


def _rejected(path: Path) -> SnapshotError:
    with pytest.raises(SnapshotError) as info:
        inspect_safetensors(path)
    assert "not a safetensors file" in str(info.value)
    assert path.name in str(info.value)
    assert info.value.field == "file"
    return info.value


def test_inspect_rejects_a_torch_save_file(tmp_path: Path) -> None:
    path = tmp_path / "weights.safetensors"
    torch.save({"w": torch.zeros(3)}, path)
    _rejected(path)


def test_inspect_rejects_a_legacy_torch_pickle(tmp_path: Path) -> None:
    path = tmp_path / "legacy.safetensors"
    buffer = io.BytesIO()
    torch.save({"w": torch.zeros(3)}, buffer, _use_new_zipfile_serialization=False)
    path.write_bytes(buffer.getvalue())
    _rejected(path)


def test_inspect_rejects_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.safetensors"
    path.write_bytes(b"")
    assert "shorter" in str(_rejected(path))


def test_inspect_rejects_random_bytes(tmp_path: Path) -> None:
    path = tmp_path / "noise.safetensors"
    path.write_bytes(random.Random(0).randbytes(4096))
    _rejected(path)


def test_inspect_rejects_a_header_that_is_not_json(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 4) + b"nope")
    assert "not JSON" in str(_rejected(path))


def test_inspect_rejects_a_json_list_header(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 2) + b"[]")
    assert "not a JSON object" in str(_rejected(path))


def test_inspect_rejects_a_tensor_past_the_end(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    path = tmp_path / "short.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    assert "'w' points past the end" in str(_rejected(path))


def test_inspect_rejects_a_malformed_entry(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4]}}).encode()
    path = tmp_path / "malformed.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    assert "entry 'w'" in str(_rejected(path))


class _Trap:
    """Unpickling this creates the marker file: proof that something unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Path]]:
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_a_pickle_is_never_unpickled(tmp_path: Path, example_spec: ModelSpec, protocol: int) -> None:
    marker = tmp_path / "unpickled.marker"
    root = tmp_path / "root"
    root.mkdir()
    path = root / "embed.safetensors"
    path.write_bytes(pickle.dumps({"user.weight": _Trap(marker)}, protocol=protocol))

    with pytest.raises(SnapshotError, match="not a safetensors file"):
        inspect_safetensors(path)
    with pytest.raises(SnapshotError, match="not a safetensors file"):
        load_weights(path)
    ref = SnapshotRef(uri=path.as_uri(), sha256=sha256_file(path), snapshot_id="feed-ranker/embed@evil")
    with pytest.raises(SnapshotError) as info:
        validate_snapshot(example_spec, "embed", ref, [root], tmp_path / "pinned")
    assert "not a safetensors file" in str(info.value)
    assert "parts.embed" in str(info.value)
    assert not marker.exists()

    # The trap is armed: unpickling it really would have created the marker.
    pickle.loads(path.read_bytes())
    assert marker.exists()


# --- the version grammar at the manifest --------------------------------------------------------


@pytest.mark.parametrize("version", ["v2\u00e9", "v\uff11", "-v1", "v 1", "v" * 129])
def test_a_manifest_version_outside_the_grammar_is_refused_with_the_field_named(
    tmp_path: Path, version: str
) -> None:
    folder = snapshot(tmp_path, "v1")
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**manifest, "version": version}))
    for read in (read_manifest, request_from_folder):
        with pytest.raises(SnapshotError) as info:
            read(folder)
        assert info.value.field == "version" and info.value.value == version
        assert "Fix: write a version of ASCII letters" in str(info.value)
    unreadable: list[tuple[Path, str]] = []
    assert discover([tmp_path], "feed-ranker", unreadable) == []  # the watcher never publishes it
    assert [(f, "version" in why) for f, why in unreadable] == [(folder, True)]


def test_a_manifest_whose_model_is_not_a_name_is_refused_by_field(tmp_path: Path) -> None:
    folder = snapshot(tmp_path, "v1")
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**manifest, "model": "Feed Ranker"}))
    with pytest.raises(SnapshotError) as info:
        request_from_folder(folder)
    assert info.value.field == "model" and info.value.value == "Feed Ranker"
