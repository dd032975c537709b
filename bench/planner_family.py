"""`bench/planner.py --family`: the planner on fresh instances of the family
(`planner.generator.family`), each feasible by construction, with a 60 s wall-clock budget.

Seeds are drawn fresh each run (from the operating system's entropy) and printed, so a run
can be repeated with `--family-seeds`. The first `--family-tight` instances have pools
90-98% full (the planted plan's share of all pool units, `tight_family`); the rest draw their fullness from
the family's whole range (50-98%). Per instance: whether a plan came back and whether the
work or the clock stopped the solve, its gap over its own proven bound, its cost over the
planted plan's (below 1: cheaper than the certificate), and when the first plan existed
(the decomposition's debug record of its first plan; a solve whose first plan failed gets
its plan at the end). Then the distributions (median, p90, max) over the instances."""

from __future__ import annotations

import logging
import random
import statistics
import time
from typing import Any

from ipnext.contracts.plan import SolveOptions
from ipnext.errors import InfeasiblePlanError, PlanningTimeoutError
from ipnext.planner import check_plan, solve
from ipnext.planner.generator import TIGHT, family, tight_family

__all__ = ["FAMILY_WORK", "run_family"]

# The family's work limit: the 1,000-deployment row's. The clock (60 s) then stops the larger
# instances first on this 2-core machine, and each instance says which stopped it.
FAMILY_WORK = 14_000_000


class _FirstPlan(logging.Handler):
    """The wall-clock time of the decomposition's first plan, from its debug record."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.at: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.at is None and getattr(record, "first_plan", False):
            self.at = time.monotonic()


def _one(seed: int, tight: bool, limit: float, work: int) -> dict[str, Any]:
    inst = tight_family(seed) if tight else family(seed)
    problem = inst.problem
    out: dict[str, Any] = {
        "seed": seed,
        "deployments": len(problem.deployments),
        "regions": len(problem.fleet.regions),
        "hardware": len(problem.fleet.hardware),
        "fullness": round(inst.fullness, 4),
        "planted_cost": inst.planted.cost,
        "time_limit_s": limit,
        "work_limit": work,
    }
    watcher = _FirstPlan()
    logger = logging.getLogger("ipnext.planner.decompose")
    level = logger.level
    logger.addHandler(watcher)
    logger.setLevel(logging.DEBUG)
    started = time.monotonic()
    try:
        plan = solve(problem, SolveOptions(time_limit_s=limit, work_limit=work))
    except (InfeasiblePlanError, PlanningTimeoutError) as err:
        out.update(failed=str(err), seconds=time.monotonic() - started)
        return out
    finally:
        logger.removeHandler(watcher)
        logger.setLevel(level)
    seconds = time.monotonic() - started
    assert check_plan(problem, plan) == [], seed
    first = (watcher.at - started) if watcher.at is not None else seconds
    out.update(
        cost=plan.cost,
        lower_bound=plan.lower_bound,
        gap=plan.gap,
        over_planted=plan.cost / inst.planted.cost,
        first_plan_s=first,
        seconds=seconds,
        stopped_by=plan.stopped_by,
        work_units=plan.work_units,
        method=plan.lower_bound_method,
    )
    return out


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {"median": statistics.median(ordered), "p90": p90, "max": ordered[-1]}


def run_family(
    count: int, tight: int, seeds: list[int] | None, limit: float, work: int = FAMILY_WORK
) -> dict[str, Any]:
    """`count` instances (or one per seed in `seeds`), the first `tight` of them 90-98% full."""
    draw = random.SystemRandom()
    seeds = seeds or [draw.randrange(1, 10**9) for _ in range(count)]
    print(f"family seeds: {' '.join(map(str, seeds))}", flush=True)
    runs = []
    for k, seed in enumerate(seeds):
        run = _one(seed, k < tight, limit, work)
        runs.append(run)
        shape = (
            f"seed {seed}: {run['deployments']} deployments, {run['regions']} regions, "
            f"{run['hardware']} hardware, {100 * run['fullness']:.1f}% full"
        )
        if "failed" in run:
            print(f"{shape}: NO PLAN in {run['seconds']:.1f}s: {run['failed'][:300]}", flush=True)
            continue
        print(
            f"{shape}: plan in {run['seconds']:.1f}s (first at {run['first_plan_s']:.1f}s), gap "
            f"{100 * run['gap']:.2f}%, cost {run['over_planted']:.3f} x planted, stopped by the "
            f"{run['stopped_by']}",
            flush=True,
        )
    planned = [r for r in runs if "failed" not in r]
    summary = {
        "instances": len(runs),
        "tight": sum(1 for r in runs if TIGHT[0] <= r["fullness"] <= TIGHT[1]),
        "plans": len(planned),
        "within_limit": sum(1 for r in planned if r["seconds"] <= limit),  # the plan in hand by then
        "stopped_by_clock": sum(1 for r in planned if r["stopped_by"] == "clock"),
        "gap": _spread([r["gap"] for r in planned]),
        "over_planted": _spread([r["over_planted"] for r in planned]),
        "first_plan_s": _spread([r["first_plan_s"] for r in planned]),
        "seconds": _spread([r["seconds"] for r in planned]),
    }

    def shown(key: str, scale: float = 1.0, unit: str = "") -> str:
        s = summary[key]
        if s is None:
            return "-"
        return ", ".join(f"{name} {scale * s[name]:.3g}{unit}" for name in ("median", "p90", "max"))

    print(
        f"family: plans on {summary['plans']} of {summary['instances']} instances "
        f"({summary['tight']} of them 90-98% full), {summary['within_limit']} within {limit:g}s, "
        f"{summary['stopped_by_clock']} stopped by the clock; gap over own bound: "
        f"{shown('gap', 100, '%')}; cost over planted: {shown('over_planted')}; first plan: "
        f"{shown('first_plan_s', unit='s')}; solve: {shown('seconds', unit='s')}",
        flush=True,
    )
    return {"summary": summary, "seeds": seeds, "runs": runs}
