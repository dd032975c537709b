"""The supervisor's status file (`<state>/supervisor.json`): where it lies and how it is read.
The supervisor writes it after every pass; `dev up` waits on it and `dev status` prints it, with
the pinned store's last collection (`<store>/gc.json`, `pinned_store_lines`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ipnext.store.pinned_store import GcReport

__all__ = ["format_bytes", "pinned_store_lines", "read_status", "status_path"]


def status_path(state_dir: Path) -> Path:
    return state_dir / "supervisor.json"


def read_status(state_dir: Path) -> dict[str, Any]:
    """What the supervisor recorded (empty when it never ran or its file is unreadable)."""
    try:
        data: dict[str, Any] = json.loads(status_path(state_dir).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return data


def pinned_store_lines(store: Path, report: GcReport | None) -> list[str]:
    """What `dev status` says of the pinned store, from its gc.json (`report`; None: no
    collection ran yet): the files and bytes in use, and the space reclaimed by the last
    collection and by all of them."""
    if report is None:
        return [f"pinned store {store}: no collection yet (one runs after a model's set list changes)"]
    last = report.last
    at = last.at.strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [
        f"pinned store {store}: {last.files} files, {format_bytes(last.bytes)} in use (as of {at})",
        f"  reclaimed: {format_bytes(last.removed_bytes)} ({last.removed_files} files) by the last "
        f"collection, {format_bytes(report.removed_bytes)} ({report.removed_files} files) in all "
        f"over {report.runs} collections",
    ]
    if last.skipped:
        lines.append(f"  the last collection deleted nothing: {last.skipped}")
    if last.missing:
        lines.append(f"  {last.missing} files the models name are missing from the store")
    return lines


def format_bytes(count: int) -> str:
    """1536 -> "1.5 KiB"; under 1 KiB in bytes."""
    if count < 1024:
        return f"{count} B"
    size = float(count)
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024:
            return f"{size:.1f} {unit}"
    return f"{size / 1024:.1f} TiB"
