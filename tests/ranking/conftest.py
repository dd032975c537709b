"""A trained ranking snapshot (small world, tables in 3 hashed shards and whole) for the part tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipnext.examples.request_ranker.train import TrainReport, train


@pytest.fixture(scope="session")
def trained_whole(tmp_path_factory: pytest.TempPathFactory) -> TrainReport:
    return train(Path(tmp_path_factory.mktemp("ranking")), "feed-ranking", "v1", steps=40)


@pytest.fixture(scope="session")
def trained_sharded(tmp_path_factory: pytest.TempPathFactory) -> TrainReport:
    return train(Path(tmp_path_factory.mktemp("ranking-sharded")), "feed-ranking", "v1", steps=40, shards=3)
