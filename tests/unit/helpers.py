"""Constants and small builders shared by the unit tests."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ipnext.contracts.plan import SolveOptions
from ipnext.planner.work import UNITS_PER_SECOND
from ipnext.spec.model import SnapshotSetRequest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_SPEC = REPO / "examples" / "click_ranker" / "model.yaml"
DEV_FLEET = REPO / "config" / "fleet.dev.yaml"
MODEL = "feed-ranker"


def spec_dict() -> dict[str, Any]:
    """A fresh, mutable copy of the example model.yaml as plain data."""
    return copy.deepcopy(yaml.safe_load(EXAMPLE_SPEC.read_text()))


def fleet_dict() -> dict[str, Any]:
    """A fresh, mutable copy of config/fleet.dev.yaml as plain data."""
    return copy.deepcopy(yaml.safe_load(DEV_FLEET.read_text()))


@dataclass(frozen=True)
class Trained:
    """A trained snapshot: its root (to pass as snapshot_roots), its folder and its publish request."""

    root: Path
    folder: Path
    request: SnapshotSetRequest


# Planner tests run on work limits (planner/work.py): the clock is only an outer stop, far past
# what the work takes, so that no result they assert depends on the machine's speed or load.
PLAN_CLOCK_S = 250.0


def work_options(work_seconds: float, **fields: Any) -> SolveOptions:
    """Solve options whose work limit is about `work_seconds` of the bench machine's work
    (`UNITS_PER_SECOND`), with the clock at PLAN_CLOCK_S."""
    return SolveOptions(work_limit=int(work_seconds * UNITS_PER_SECOND), time_limit_s=PLAN_CLOCK_S, **fields)
