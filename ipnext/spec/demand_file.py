"""The demand file `ipnext plan solve --demand` reads (demand.yaml): the deployments to place, each
with its hardware options, demand per traffic source and latency budget; a model's parts become
the same deployments when ipnext plans it (`ipnext.contracts.plan.demand_from_model`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from ipnext.names import Frozen
from ipnext.spec.fleet import Name
from ipnext.spec.model import MAX_SPARE_REPLICAS, HardwareOption
from ipnext.spec.reading import load_yaml, parse_spec

__all__ = ["DemandFile", "DeploymentDemand", "load_demand_file"]


class DeploymentDemand(Frozen):
    """One deployment as demand.yaml writes it; a model's part becomes one of these."""

    name: str = Field(pattern=r"^[a-z][a-z0-9-]*(/[a-z][a-z0-9-]*)?$")
    hardware: dict[Name, HardwareOption] = Field(min_length=1)
    demand_qps: dict[Name, Annotated[float, Field(ge=0)]] = Field(min_length=1)
    latency_budget_ms: float = Field(gt=0)
    headroom: float = Field(default=0.2, ge=0, lt=1)
    min_regions: int = Field(default=1, ge=1)
    survive_region_loss: bool = False
    group: str | None = None
    # Replicas a region may lose and still carry its load under the headroom (the model's
    # availability.spare_replicas): the planner places and prices them like any other.
    spare_replicas: int = Field(default=0, ge=0, le=MAX_SPARE_REPLICAS)


class DemandFile(BaseModel):
    """demand.yaml: the deployments to place (unknown keys refused)."""

    model_config = ConfigDict(extra="forbid")
    deployments: list[DeploymentDemand]


def load_demand_file(path: Path) -> DemandFile:
    """demand.yaml read and checked; a SpecError naming the file and the field otherwise."""
    return parse_spec(DemandFile, load_yaml(path), source=str(path))
