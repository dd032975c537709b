"""Planner benchmark: the issue's instance table, our solver against a first-fit baseline and a
plain MIP of the same formulation (HiGHS, same time limit), all in this process.

    .venv/bin/python bench/planner.py                 # every row (the large ones take long)
    .venv/bin/python bench/planner.py --rows 20 100   # some rows
    .venv/bin/python bench/planner.py --rows 1000 --time-limit 600          # more time than the row's
    .venv/bin/python bench/planner.py --rows replan --deployments 20 --churn 0.05 5 --seed 2
        # small enough for the exact path: how few units a replan can move at each churn cost

Prints one line per (row, method) and writes bench/results/planner.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path
from typing import Any

from ipnext.errors import InfeasiblePlanError, PlanningTimeoutError
from ipnext.plan import Plan, PlanningProblem, SolveOptions
from ipnext.planner import check_plan, solve
from ipnext.planner.backend import solve_model
from ipnext.planner.first_fit import solve as first_fit
from ipnext.planner.formulation import build
from ipnext.planner.generator import generate
from ipnext.planner.instance import compile_problem

# name: (deployments, regions, hardware, utilization, time limit s)
ROWS: dict[str, tuple[int, int, int, float, float]] = {
    "20": (20, 4, 2, 0.5, 30),
    "100": (100, 4, 2, 0.5, 30),
    "1000": (1000, 16, 4, 0.5, 60),
    "10000": (10000, 16, 4, 0.5, 300),
    "300-tight": (300, 8, 3, 0.9, 60),
    "replan": (100, 4, 2, 0.5, 30),  # 5% demand change, against the plan of the unchanged demand
}


def _ours(problem: PlanningProblem, limit: float) -> dict[str, Any]:
    started = time.monotonic()
    try:
        plan = solve(problem, SolveOptions(time_limit_s=limit))
    except (InfeasiblePlanError, PlanningTimeoutError) as err:
        return {"method": "ipnext", "failed": str(err), "seconds": time.monotonic() - started}
    assert check_plan(problem, plan) == []
    return {
        "method": "ipnext",
        "objective": plan.objective,
        "lower_bound": plan.lower_bound,
        "lower_bound_method": plan.lower_bound_method,
        "gap": plan.gap,
        "status": plan.status,
        "seconds": time.monotonic() - started,
    }


def _replan(problem: PlanningProblem, limit: float, seed: int, churns: list[float]) -> dict[str, Any]:
    """Plan, change every deployment's demand by up to +-5%, then plan again against the first
    plan (churn counted, at each of `churns`) and from scratch; compare the units each moves
    against the first plan."""
    import random

    from ipnext.plan import plan_moves

    started = time.monotonic()
    first = solve(problem, SolveOptions(time_limit_s=limit))
    rng = random.Random(seed)
    changed = problem.model_copy(
        update={
            "deployments": [
                d.model_copy(
                    update={"demand_qps": {s: q * rng.uniform(0.95, 1.05) for s, q in d.demand_qps.items()}}
                )
                for d in problem.deployments
            ]
        }
    )
    units = {d.name: {h: o.units for h, o in d.hardware.items()} for d in problem.deployments}

    def moved(plan: Plan) -> int:
        return sum(
            max(0, m.after - m.before) * units[m.deployment][m.hardware] for m in plan_moves(first, plan)
        )

    scratch = solve(changed, SolveOptions(time_limit_s=limit))
    assert check_plan(changed, scratch) == []
    out: dict[str, Any] = {
        "method": "ipnext replan",
        "first_status": first.status,
        "moved_units_from_scratch": moved(scratch),
        "cost_from_scratch": scratch.cost,
    }
    for churn in churns:
        again = solve(
            changed.model_copy(update={"current": first}), SolveOptions(time_limit_s=limit, churn_cost=churn)
        )
        assert check_plan(changed, again) == []
        out[f"churn {churn}"] = {
            "moved_units": moved(again),
            "moved_ratio": moved(again) / max(1, moved(scratch)),
            "cost": again.cost,
            "status": again.status,
        }
    out["seconds"] = time.monotonic() - started
    return out


def _first_fit(problem: PlanningProblem) -> dict[str, Any]:
    started = time.monotonic()
    try:
        plan = first_fit(problem)
    except InfeasiblePlanError as err:
        return {"method": "first-fit", "failed": str(err)[:200], "seconds": time.monotonic() - started}
    return {"method": "first-fit", "objective": plan.cost, "seconds": time.monotonic() - started}


def _plain_mip(problem: PlanningProblem, limit: float) -> dict[str, Any]:
    started = time.monotonic()
    inst = compile_problem(problem)
    model = build(inst, list(range(len(inst.blocks))), pool_capacity=inst.pool_units)
    sol = solve_model(model, time_limit_s=limit, relative_gap=1e-6)
    out: dict[str, Any] = {
        "method": "plain MIP (HiGHS)",
        "status": sol.status,
        "seconds": time.monotonic() - started,
    }
    if sol.values is not None:
        out["objective"] = sol.objective
    out["lower_bound"] = sol.bound if sol.bound > -float("inf") else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--time-limit", type=float, help="every row's time limit, in seconds (default: the row's)"
    )
    parser.add_argument(
        "--churn", type=float, nargs="*", default=[0.05], help="churn costs the replan rows replan at"
    )
    parser.add_argument("--deployments", type=int, help="the replan row's size (default 100)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/planner.json"))
    args = parser.parse_args()
    results = []
    for row in args.rows:
        n, regions, hardware, utilization, limit = ROWS[row]
        limit = args.time_limit or limit
        if row == "replan" and args.deployments:
            n = args.deployments
        problem = generate(args.seed, n, regions, hardware, utilization=utilization)
        if row == "replan":
            result = {
                "row": row,
                "deployments": n,
                "time_limit_s": limit,
                **_replan(problem, limit, args.seed, args.churn),
            }
            results.append(result)
            print(
                json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items()}),
                flush=True,
            )
            continue
        for method in ("ipnext", "first-fit", "plain-mip"):
            if method == "ipnext":
                run = _ours(problem, limit)
            elif method == "first-fit":
                run = _first_fit(problem)
            else:
                run = _plain_mip(problem, limit)
            result = {"row": row, "time_limit_s": limit, **run}
            results.append(result)
            shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items()}
            print(json.dumps(shown), flush=True)
    ours = {r["row"]: r for r in results if r["method"] == "ipnext"}
    for r in results:
        if r["method"] != "ipnext" and "objective" in r and "objective" in ours.get(r["row"], {}):
            r["ours_over_this"] = ours[r["row"]]["objective"] / r["objective"]
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # Worker processes of the block solves: the largest one (ru_maxrss of children is a max).
    child_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"results": results, "peak_rss_mb": peak_mb, "worker_peak_rss_mb": child_mb}, indent=2)
    )
    print(f"peak RSS {peak_mb:.0f} MB (largest worker {child_mb:.0f} MB); wrote {args.out}")


if __name__ == "__main__":
    main()
