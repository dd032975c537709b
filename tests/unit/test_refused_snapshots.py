"""The watcher's memory of refused snapshots: offered again only once training rewrote them."""

from __future__ import annotations

from pathlib import Path

from ipnext.activities.metadata import RefusedSnapshots


def test_a_refusal_is_remembered_per_version_and_fingerprint(tmp_path: Path) -> None:
    memory = RefusedSnapshots(tmp_path, "feed-ranker")
    assert not memory.refused("v2", "f1")
    memory.remember("v2", "f1", "checksum mismatch")
    again = RefusedSnapshots(tmp_path, "feed-ranker")  # the next tick: a new activity, same file
    assert again.refused("v2", "f1")
    assert not again.refused("v2", "f2")  # training wrote v2 again: offer it again
    assert not again.refused("v3", "f1")
    assert not RefusedSnapshots(tmp_path, "other-model").refused("v2", "f1")
    again.remember("v3", "f9", "tensors do not fit")
    assert again.refused("v2", "f1") and again.refused("v3", "f9")
    assert [p.name for p in (tmp_path / "watch").iterdir()] == ["feed-ranker.json"]  # no partial left


def test_an_unreadable_memory_starts_empty(tmp_path: Path) -> None:
    (tmp_path / "watch").mkdir()
    (tmp_path / "watch" / "feed-ranker.json").write_text("{torn")
    memory = RefusedSnapshots(tmp_path, "feed-ranker")
    assert not memory.refused("v2", "f1")  # one more refusal costs a few events, nothing else
    memory.remember("v2", "f1", "bad")
    assert memory.refused("v2", "f1")
