"""Constants and small builders shared by the unit tests."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ipnext.model import SnapshotSetRequest

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
