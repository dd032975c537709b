"""Shared fixtures for the unit suite: the repo's example spec and fleet, and a small trained snapshot."""

from __future__ import annotations

import pytest

from ipnext.examples.click_ranker.train import train
from ipnext.spec.fleet import Fleet, load_fleet
from ipnext.spec.model import ModelSpec, load_model_spec
from ipnext.store.snapshots import request_from_folder
from tests.unit.helpers import DEV_FLEET, EXAMPLE_SPEC, MODEL, Trained


@pytest.fixture(scope="session")
def example_spec() -> ModelSpec:
    return load_model_spec(EXAMPLE_SPEC)


@pytest.fixture(scope="session")
def dev_fleet() -> Fleet:
    return load_fleet(DEV_FLEET)


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """One snapshot of the example ranker (default config, dim 16), trained for a few steps.

    Read-only for tests: copy files before changing them.
    """
    root = tmp_path_factory.mktemp("snapshots")
    report = train(root, MODEL, "v1", steps=20)
    return Trained(root=root, folder=report.folder, request=request_from_folder(report.folder))
