"""Shared fixtures for the unit suite: the repo's example spec and fleet, and a small trained snapshot."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from ipnext.examples.click_ranker.train import train
from ipnext.spec.fleet import Fleet, load_fleet
from ipnext.spec.model import ModelSpec, load_model_spec
from ipnext.store.snapshots import request_from_folder
from tests.unit.helpers import DEV_FLEET, EXAMPLE_SPEC, MODEL, Trained


@pytest.fixture(autouse=True)
def no_ray_left_running() -> Iterator[None]:
    """A unit test must not leave Ray running in its process: a later integration test in the
    same xdist worker would then find Ray initialized and stay on that local instance instead of
    its stack (`control.connect` keeps a connection it did not make), and fail far from the cause
    (CI: a writer test's `ray.get_actor` started a local Ray; eight drills on the other stack
    failed 20 minutes later). Such a test fails here, and the instance is shut down."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
        pytest.fail("this test left Ray running in the process (a Ray call started a local instance)")


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
