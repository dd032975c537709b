"""Freeze activity: the freeze calendar named in the settings (`freeze_calendar`), read fresh on
every call so an edited calendar takes effect at a rollout's next step."""

from __future__ import annotations

from pathlib import Path

from temporalio import activity

from ipnext.activities import _context
from ipnext.activities.validate import as_application_error
from ipnext.contracts.freeze import FreezeCalendar, FreezeWindow
from ipnext.errors import IpnextError
from ipnext.names import Frozen
from ipnext.spec.reading import load_yaml, parse_spec

__all__ = ["FreezeWindowsResult", "freeze_windows", "load_freeze_calendar"]


class FreezeWindowsResult(Frozen):
    windows: list[FreezeWindow]


def load_freeze_calendar(path: Path | None) -> list[FreezeWindow]:
    """The windows of a calendar file (none when the settings name no file)."""
    if path is None:
        return []
    calendar = parse_spec(FreezeCalendar, load_yaml(path), source=str(path))
    return list(calendar.freezes)


@activity.defn
def freeze_windows() -> FreezeWindowsResult:
    try:
        return FreezeWindowsResult(windows=load_freeze_calendar(_context.settings().freeze_calendar))
    except IpnextError as err:
        raise as_application_error(err) from None
