"""The pinned store: copies that training cannot move, delete or rewrite, checked on load."""

from __future__ import annotations

import pickle
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ipnext.errors import SnapshotError
from ipnext.store.pinned import load_verified, pin, pinned_path, verify
from ipnext.store.snapshots import sha256_file


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    path = tmp_path / "training" / "v1" / "embed.safetensors"
    path.parent.mkdir(parents=True)
    save_file({"user.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, str(path))
    return path


def test_a_pinned_copy_is_read_only_named_by_its_hash_and_made_once(weights: Path, tmp_path: Path) -> None:
    store = tmp_path / "pinned"
    digest = sha256_file(weights)
    copy = pin(weights, digest, store)
    assert copy == pinned_path(store, digest) == store / digest[:2] / f"{digest}.safetensors"
    assert sha256_file(copy) == digest
    assert stat.S_IMODE(copy.stat().st_mode) == 0o444
    assert copy.stat().st_ino != weights.stat().st_ino  # a copy, never a hard link
    made = copy.stat()
    assert (
        pin(weights, digest, store) == copy and copy.stat().st_ino == made.st_ino
    )  # found, not copied again
    assert copy.stat().st_mtime_ns >= made.st_mtime_ns  # freshened: a collection's grace starts again
    assert [p.name for p in copy.parent.iterdir()] == [copy.name]  # nothing partial left


def test_the_pinned_bytes_outlive_a_moved_or_rewritten_training_file(weights: Path, tmp_path: Path) -> None:
    digest = sha256_file(weights)
    copy = pin(weights, digest, tmp_path / "pinned")
    with weights.open("r+b") as f:  # training rewrites its file in place: same path, same inode
        f.seek(-4, 2)
        f.write(b"\xff\xff\xff\xff")
    assert sha256_file(copy) == digest
    weights.unlink()  # and then deletes it
    tensors = load_verified(copy, digest)
    assert torch.equal(tensors["user.weight"], torch.arange(12, dtype=torch.float32).reshape(3, 4))


def test_bytes_that_do_not_match_the_manifest_are_not_kept(weights: Path, tmp_path: Path) -> None:
    store = tmp_path / "pinned"
    with pytest.raises(
        SnapshotError, match=f"checksum mismatch: the file's sha256 is {sha256_file(weights)}"
    ):
        pin(weights, "0" * 64, store)
    assert not pinned_path(store, "0" * 64).exists()
    assert [p for p in store.rglob("*") if p.is_file()] == []


def test_a_changed_pinned_copy_is_refused_on_load(weights: Path, tmp_path: Path) -> None:
    digest = sha256_file(weights)
    copy = pin(weights, digest, tmp_path / "pinned")
    copy.chmod(0o644)
    copy.write_bytes(copy.read_bytes()[:-1] + b"\0")
    with pytest.raises(SnapshotError, match="the pinned copy was changed"):
        load_verified(copy, digest)


def test_verify_says_whether_a_pinned_copy_may_still_be_served(weights: Path, tmp_path: Path) -> None:
    store = tmp_path / "pinned"
    digest = sha256_file(weights)
    copy = pin(weights, digest, store)
    assert verify(store, digest) is None
    copy.chmod(0o644)
    copy.write_bytes(copy.read_bytes()[:-1] + b"\0")
    assert "its bytes changed" in (verify(store, digest) or "")
    copy.unlink()
    assert "missing from the pinned store" in (verify(store, digest) or "")


def test_a_pickle_with_the_right_hash_is_still_never_unpickled(tmp_path: Path) -> None:
    evil = tmp_path / "evil.safetensors"
    evil.write_bytes(pickle.dumps({"user.weight": [1.0]}))
    digest = sha256_file(evil)
    copy = pin(evil, digest, tmp_path / "pinned")
    with pytest.raises(SnapshotError, match="not a safetensors file"):
        load_verified(copy, digest)


@pytest.mark.parametrize("bad", ["../../etc/passwd", "A" * 64, "0" * 63, ""])
def test_only_a_sha256_names_a_pinned_file(bad: str, tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="is not 64 lowercase hex digits"):
        pinned_path(tmp_path, bad)
