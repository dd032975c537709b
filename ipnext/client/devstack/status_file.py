"""The supervisor's status file (`<state>/supervisor.json`): where it lies and how it is read.
The supervisor writes it after every pass; `dev up` waits on it and `dev status` prints it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_status", "status_path"]


def status_path(state_dir: Path) -> Path:
    return state_dir / "supervisor.json"


def read_status(state_dir: Path) -> dict[str, Any]:
    """What the supervisor recorded (empty when it never ran or its file is unreadable)."""
    try:
        data: dict[str, Any] = json.loads(status_path(state_dir).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return data
