"""Freeze windows: the calendar a rollout consults before each step, an override of one, and which window is
active now."""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from pydantic import Field, model_validator

from ipnext.names import Frozen

__all__ = ["FreezeCalendar", "FreezeOverride", "FreezeWindow", "active_freeze"]


# ---- freeze windows -----------------------------------------------------------------------


class FreezeWindow(Frozen):
    """Rollouts may not start (and running ones hold) from `start` to `end`, UTC.

    Written as `{date: 2026-12-25, reason: ...}` for one whole day, or `{start: ..., end: ...,
    reason: ...}` with dates (whole days, `end` included) or datetimes."""

    reason: str = Field(min_length=1)
    start: datetime
    end: datetime

    @model_validator(mode="before")
    @classmethod
    def _days(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
        if "date" in raw:
            day = raw.pop("date")
            if "start" in raw or "end" in raw:
                raise ValueError("freeze window: give date, or start and end, not both")
            raw["start"] = raw["end"] = day
        if "start" not in raw or "end" not in raw:
            raise ValueError("freeze window: give date: YYYY-MM-DD, or start and end")
        for key, day_edge in (("start", time.min), ("end", None)):
            value = raw[key]
            if isinstance(value, str) and len(value) == 10:
                value = date.fromisoformat(value)
            if isinstance(value, date) and not isinstance(value, datetime):
                if day_edge is None:  # an end date includes the whole day
                    value = datetime.combine(value + timedelta(days=1), time.min)
                else:
                    value = datetime.combine(value, day_edge)
            raw[key] = value
        return raw

    @model_validator(mode="after")
    def _utc_and_ordered(self) -> FreezeWindow:
        for key in ("start", "end"):
            value: datetime = getattr(self, key)
            if value.tzinfo is None:
                object.__setattr__(self, key, value.replace(tzinfo=UTC))
        if self.end <= self.start:
            raise ValueError(
                f"freeze window {self.reason!r}: end {self.end.isoformat()} is not after start "
                f"{self.start.isoformat()}"
            )
        return self

    def covers(self, now: datetime) -> bool:
        return self.start <= now < self.end


class FreezeCalendar(Frozen):
    freezes: list[FreezeWindow] = Field(default_factory=list)


class FreezeOverride(Frozen):
    """Start (or keep going) through a freeze window: who decided it and why, kept in the history."""

    reason: str = Field(min_length=1)
    who: str = Field(min_length=1)


def active_freeze(windows: list[FreezeWindow], now: datetime) -> FreezeWindow | None:
    """The window in force at `now` that ends last, if any."""
    covering = [w for w in windows if w.covers(now)]
    return max(covering, key=lambda w: w.end) if covering else None
