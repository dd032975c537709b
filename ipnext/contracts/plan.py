"""Placement: what the planner is asked (demand per deployment) and what it answers (a Plan)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from ipnext.names import Frozen
from ipnext.spec.demand_file import DeploymentDemand
from ipnext.spec.fleet import Fleet
from ipnext.spec.model import ModelSpec

__all__ = [
    "DEFAULT_WORK_LIMIT",
    "DeploymentDemand",
    "DeploymentPlacement",
    "Plan",
    "PlanMove",
    "PlanningProblem",
    "SolveOptions",
    "demand_from_model",
    "merge_plans",
    "placement_revision",
    "plan_moves",
]


class DeploymentPlacement(Frozen):
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


class Plan(Frozen):
    deployments: dict[str, DeploymentPlacement]
    cost: float  # sum of replicas x units x unit_cost
    moved_units: int = 0  # units newly placed against the current plan
    solver: str
    revision: int = 1
    objective: float | None = None  # cost + churn_cost x moved_units
    lower_bound: float | None = None  # a proven lower bound of the optimal objective
    lower_bound_method: str = ""
    gap: float | None = None  # (objective - lower_bound) / objective
    solve_seconds: float | None = None
    status: str = "feasible"  # "optimal" when the gap is closed
    # What bounded the solve: "work" (every phase ended inside its share of the work limit, so
    # the same problem, options and limit give this plan again) or "clock" (the time limit cut
    # a phase: not reproducible). None for a plan not made by the planner.
    stopped_by: Literal["work", "clock"] | None = None
    work_units: int | None = None  # the work units the solve spent (planner/work.py)

    def figures(self) -> str:
        """Its figures in one line, as `ipnext plan solve` and `plan show` print them."""
        gap = f"{100 * self.gap:.3f}%" if self.gap is not None else "n/a"
        objective = self.objective if self.objective is not None else self.cost
        bound = f"{self.lower_bound:.2f}" if self.lower_bound is not None else "n/a"
        seconds = f", {self.solve_seconds:.1f}s" if self.solve_seconds is not None else ""
        work = f", {self.work_units:,} work units" if self.work_units is not None else ""
        stopped = f", stopped by the {self.stopped_by}" if self.stopped_by is not None else ""
        return (
            f"cost {self.cost:.2f}, objective {objective:.2f}, lower bound {bound} "
            f"({self.lower_bound_method}), gap {gap}, {self.status}{seconds}{work}{stopped}"
        )

    def to_report(self) -> dict[str, object]:
        """The flat JSON `ipnext plan solve --out` writes."""
        return {
            "placements": [
                {"deployment": d, "region": r, "hardware": h, "replicas": n}
                for d, p in sorted(self.deployments.items())
                for r, by_hw in sorted(p.replicas.items())
                for h, n in sorted(by_hw.items())
                if n > 0
            ],
            "routing": [
                {"deployment": d, "source": s, "region": r, "fraction": f}
                for d, p in sorted(self.deployments.items())
                for s, row in sorted(p.fractions.items())
                for r, f in sorted(row.items())
                if f > 0
            ],
            "cost": self.cost,
            "moved_units": self.moved_units,
            "objective": self.objective if self.objective is not None else self.cost,
            "lower_bound": self.lower_bound,
            "lower_bound_method": self.lower_bound_method,
            "gap": self.gap,
            "solve_seconds": self.solve_seconds,
            "stopped_by": self.stopped_by,
            "work_units": self.work_units,
            "status": self.status,
            "solver": self.solver,
            "revision": self.revision,
        }

    @classmethod
    def from_report(cls, data: dict[str, object]) -> Plan:
        """Read back what `to_report` wrote (for `--current plan.json`)."""
        deployments: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
        rows: Any = data.get("placements", [])
        for row in rows:
            entry = deployments.setdefault(row["deployment"], {"replicas": {}, "fractions": {}})
            entry["replicas"].setdefault(row["region"], {})[row["hardware"]] = int(row["replicas"])
        rows = data.get("routing", [])
        for row in rows:
            entry = deployments.setdefault(row["deployment"], {"replicas": {}, "fractions": {}})
            entry["fractions"].setdefault(row["source"], {})[row["region"]] = float(row["fraction"])
        return cls(
            deployments={d: DeploymentPlacement.model_validate(e) for d, e in deployments.items()},
            cost=float(data.get("cost", 0.0)),  # type: ignore[arg-type]
            moved_units=int(data.get("moved_units", 0)),  # type: ignore[call-overload]
            solver=str(data.get("solver", "file")),
            revision=int(data.get("revision", 1)),  # type: ignore[call-overload]
        )


class PlanningProblem(Frozen):
    fleet: Fleet
    deployments: list[DeploymentDemand]
    current: Plan | None = None


# The default work limit, in the planner's work units (planner/work.py): the 100-deployment bench
# row's (0.115% over its bound there; 3,000,000 gave 2.8%), which its solve spends inside the
# default time limit on the bench's 2-core machine when nothing else runs.
DEFAULT_WORK_LIMIT = 6_000_000


class SolveOptions(Frozen):
    churn_cost: float = Field(default=0.05, ge=0)
    # The user's outer stop, in seconds: a solve it cuts says so (`Plan.stopped_by`).
    time_limit_s: float = Field(default=60, gt=0)
    # What every phase is budgeted in: the same problem, options and work limit give the same
    # plan on any machine at any load, when the time limit does not cut it first.
    work_limit: int = Field(default=DEFAULT_WORK_LIMIT, ge=1)

    @field_validator("work_limit", mode="before")
    @classmethod
    def _default_work(cls, value: object) -> object:
        return DEFAULT_WORK_LIMIT if value is None else value  # None: the default (a CLI's unset flag)

    seed: int = 0
    workers: int | None = Field(default=None, ge=1)  # None: every core
    # Solve small instances whole with the exact MIP first; tests switch it off to check
    # that the scalable path alone reaches the optimum.
    exact_fallback: bool = True


def demand_from_model(spec: ModelSpec, demand_qps: dict[str, float] | None = None) -> list[DeploymentDemand]:
    """Each part is a deployment `<model>/<part>` with the model's traffic and budgets, grouped
    by model so all parts are placed in the same regions with the same routing. The traffic is
    the declared `traffic.peak_qps` unless the fleet replan passes what it plans per source
    (`ipnext.policy.demand.plan_demand`: the larger of declared and observed)."""
    return [
        DeploymentDemand(
            name=f"{spec.name}/{part}",
            hardware=part_spec.hardware,
            demand_qps=dict(spec.traffic.peak_qps) if demand_qps is None else dict(demand_qps),
            latency_budget_ms=spec.latency_budget_ms,
            headroom=spec.availability.headroom,
            min_regions=spec.availability.min_regions,
            survive_region_loss=spec.availability.survive_region_loss,
            spare_replicas=spec.availability.spare_replicas,
            group=spec.name,
        )
        for part, part_spec in spec.parts.items()
    ]


class PlanMove(Frozen):
    """One (deployment, region, hardware) whose replica count a new plan changes."""

    deployment: str
    region: str
    hardware: str
    before: int
    after: int

    def __str__(self) -> str:
        return f"{self.deployment}: {self.region}/{self.hardware} {self.before} -> {self.after}"


def plan_moves(old: Plan | None, new: Plan) -> list[PlanMove]:
    """Every replica count `new` changes against `old` (deployments `new` drops included)."""
    before = old.deployments if old else {}
    moves = []
    for name in sorted(set(before) | set(new.deployments)):
        a = before[name].replicas if name in before else {}
        b = new.deployments[name].replicas if name in new.deployments else {}
        for region in sorted(set(a) | set(b)):
            for hw in sorted(set(a.get(region, {})) | set(b.get(region, {}))):
                n0, n1 = a.get(region, {}).get(hw, 0), b.get(region, {}).get(hw, 0)
                if n0 != n1:
                    moves.append(PlanMove(deployment=name, region=region, hardware=hw, before=n0, after=n1))
    return moves


def placement_revision(old: Plan | None, deployments: dict[str, DeploymentPlacement]) -> int:
    """The placement revision of a model's new placement: the old one when only replica counts
    or routing changed (its set apps change in place), the next one when a deployment gains or
    loses a (region, hardware) (Serve cannot add a deployment to a running app: a new revision
    of the set app comes up beside the old one)."""
    if old is None:
        return 1

    def layout(placements: dict[str, DeploymentPlacement]) -> dict[str, set[tuple[str, str]]]:
        return {
            name: {(r, hw) for r, by_hw in p.replicas.items() for hw, n in by_hw.items() if n > 0}
            for name, p in placements.items()
        }

    return old.revision if layout(old.deployments) == layout(deployments) else old.revision + 1


def merge_plans(plans: list[Plan]) -> Plan | None:
    """One fleet-wide plan out of per-model plans (the current plan a replan starts from)."""
    if not plans:
        return None
    deployments: dict[str, DeploymentPlacement] = {}
    for plan in plans:
        deployments.update(plan.deployments)
    return Plan(
        deployments=deployments,
        cost=sum(p.cost for p in plans),
        solver="merged",
        revision=max(p.revision for p in plans),
    )
