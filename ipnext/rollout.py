"""Rollout state shared by the workflows, the SDK and the CLI: router configs and rollout status."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["RolloutState", "RolloutStatus", "RouterConfig"]


class RolloutState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    PAUSED = "paused"
    COMPLETED = "completed"
    ABORTED = "aborted"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"


class RouterConfig(BaseModel):
    """The router app's user_config: applied in place by `reconfigure`, never restarting it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    generation: int = Field(ge=0)
    weights: dict[str, float]  # set app name -> percent of traffic


class RolloutStatus(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    set_id: str
    from_set_id: str | None
    state: RolloutState
    step: str
    traffic_percent: dict[str, float]  # set id -> percent
    generations: list[int] = Field(default_factory=list)
    detail: str = ""
