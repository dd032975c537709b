"""Placement: what the planner is asked (demand per deployment) and what it answers (a Plan)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from ipnext.fleet import Fleet, Name
from ipnext.model import HardwareOption, ModelSpec

__all__ = [
    "DeploymentDemand",
    "DeploymentPlacement",
    "Plan",
    "PlanningProblem",
    "SolveOptions",
    "demand_from_model",
]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DeploymentDemand(_Frozen):
    """One deployment as demand.yaml writes it; a model's part becomes one of these."""

    name: str = Field(pattern=r"^[a-z][a-z0-9-]*(/[a-z][a-z0-9-]*)?$")
    hardware: dict[Name, HardwareOption] = Field(min_length=1)
    demand_qps: dict[Name, Annotated[float, Field(ge=0)]] = Field(min_length=1)
    latency_budget_ms: float = Field(gt=0)
    headroom: float = Field(default=0.2, ge=0, lt=1)
    min_regions: int = Field(default=1, ge=1)
    survive_region_loss: bool = False
    group: str | None = None


class DeploymentPlacement(_Frozen):
    replicas: dict[str, dict[str, int]]  # region -> hardware -> replicas
    fractions: dict[str, dict[str, float]]  # traffic source -> serving region -> share

    def regions(self) -> list[str]:
        return sorted(r for r, by_hw in self.replicas.items() if sum(by_hw.values()) > 0)

    def serving_region(self, source: str) -> str | None:
        """The region that takes the largest share of a source's traffic."""
        row = self.fractions.get(source)
        if not row:
            return None
        return max(sorted(row), key=lambda r: row[r])


class Plan(_Frozen):
    deployments: dict[str, DeploymentPlacement]
    cost: float
    moved_units: int = 0
    solver: str
    revision: int = 1


class PlanningProblem(_Frozen):
    fleet: Fleet
    deployments: list[DeploymentDemand]
    current: Plan | None = None


class SolveOptions(_Frozen):
    churn_cost: float = Field(default=0.05, ge=0)
    time_limit_s: float = Field(default=10, gt=0)
    seed: int = 0


def demand_from_model(spec: ModelSpec) -> list[DeploymentDemand]:
    """Each part is a deployment `<model>/<part>` with the model's traffic and budgets, grouped
    by model so all parts are placed in the same regions with the same routing."""
    return [
        DeploymentDemand(
            name=f"{spec.name}/{part}",
            hardware=part_spec.hardware,
            demand_qps=dict(spec.traffic.peak_qps),
            latency_budget_ms=spec.latency_budget_ms,
            headroom=spec.availability.headroom,
            min_regions=spec.availability.min_regions,
            survive_region_loss=spec.availability.survive_region_loss,
            group=spec.name,
        )
        for part, part_spec in spec.parts.items()
    ]
