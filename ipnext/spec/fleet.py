"""The fleet: regions (also the traffic sources), hardware classes, capacity pools and latencies."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, StringConstraints, model_validator

from ipnext.names import Frozen
from ipnext.spec.reading import load_yaml, parse_spec

__all__ = ["Fleet", "HardwareClass", "Name", "Pool", "load_fleet"]

# Ray Serve rejects some characters in deployment names, so every name is this.
Name = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9-]*$", max_length=63)]


class HardwareClass(Frozen):
    kind: Literal["cpu", "gpu"]


class Pool(Frozen):
    model_config = ConfigDict(allow_inf_nan=False)  # a cost of inf would reach the solver

    region: Name
    hardware: Name
    units: int = Field(gt=0)
    unit_cost: float = Field(ge=0)


class Fleet(Frozen):
    # A latency of inf is not "unreachable" (JSON, which carries the fleet to the planner, has no
    # inf): leave the pair out instead, which `latency` reads as unreachable.
    model_config = ConfigDict(allow_inf_nan=False)

    regions: list[Name] = Field(min_length=1)
    hardware: dict[Name, HardwareClass] = Field(min_length=1)
    pools: list[Pool] = Field(min_length=1)
    latency_ms: dict[Name, dict[Name, float]]

    @model_validator(mode="after")
    def _check_references(self) -> Fleet:
        if len(set(self.regions)) != len(self.regions):
            dupes = sorted({r for r in self.regions if self.regions.count(r) > 1})
            raise ValueError(f"regions: duplicate names {dupes}; list each region once")
        seen: set[tuple[str, str]] = set()
        for i, pool in enumerate(self.pools):
            if pool.region not in self.regions:
                raise ValueError(
                    f"pools.{i}.region: {pool.region!r} is not one of regions {self.regions}; "
                    "add it to regions or fix the name"
                )
            if pool.hardware not in self.hardware:
                raise ValueError(
                    f"pools.{i}.hardware: {pool.hardware!r} is not one of hardware "
                    f"{sorted(self.hardware)}; declare it under hardware or fix the name"
                )
            if (pool.region, pool.hardware) in seen:
                raise ValueError(
                    f"pools.{i}: a second pool for ({pool.region}, {pool.hardware}); merge them into one pool"
                )
            seen.add((pool.region, pool.hardware))
        for source, row in self.latency_ms.items():
            for name in (source, *row):
                if name not in self.regions:
                    raise ValueError(
                        f"latency_ms: {name!r} is not one of regions {self.regions}; "
                        "latency is given between declared regions"
                    )
            for target, ms in row.items():
                if ms < 0:
                    raise ValueError(f"latency_ms.{source}.{target}: {ms} is negative")
        return self

    def pool(self, region: str, hardware: str) -> Pool | None:
        for pool in self.pools:
            if pool.region == region and pool.hardware == hardware:
                return pool
        return None

    def latency(self, source: str, region: str) -> float:
        """One-way latency source -> region; a region reaches itself in 0 ms unless stated."""
        row = self.latency_ms.get(source, {})
        if region in row:
            return row[region]
        return 0.0 if source == region else float("inf")


def load_fleet(path: str | Path) -> Fleet:
    return parse_spec(Fleet, load_yaml(path), source=str(path))
