"""Planner benchmark: the issue's instance table, our solver against a first-fit baseline and a
plain MIP of the same formulation (HiGHS, same time limit), all in this process.

    .venv/bin/python bench/planner.py                 # every row (the large ones take long)
    .venv/bin/python bench/planner.py --rows 20 100   # some rows
    .venv/bin/python bench/planner.py --rows 1000 --time-limit 600          # more time than the row's
    .venv/bin/python bench/planner.py --rows replan   # the replan goal: 20 and 100 deployments, seeds 1-5
    .venv/bin/python bench/planner.py --rows replan --replan-sizes 20 --seeds 2 --churn 0.5
    .venv/bin/python bench/planner.py --rows 300-tight --repeat 10   # the same solve 10 times
    .venv/bin/python bench/planner.py --family 40     # 40 fresh instances of the family, 60 s each
    .venv/bin/python bench/planner.py --family --family-seeds 17 912   # those instances again

Every row has a work limit (the planner's work units, planner/work.py: the same row gives the
same plan on any machine) and a time limit, the outer stop; `--repeat` runs on the work limit
with the clock at REPEAT_CLOCK_FACTOR times the row's time limit, so that no run is cut by it.
A run the clock cut prints "stopped by the clock". The plain MIP and the replan rows' reference
MIPs are not the planner's and stop on their time limits as before.

Prints one line per (row, method) and writes bench/results/planner.json (the replan rows alone:
bench/results/planner-replan.json; with --repeat, bench/results/planner-repeat.json). A replan row:
a start plan; every (model, source) demand
times a factor drawn from [0.95, 1.05] (a model's parts share it: `generator.changed_demand`);
the from-scratch optimum of the new demand (an exact MIP); the fewest units any plan within 1%
of that optimum moves against the start plan (an exact MIP; where it cannot close in the time
limit, its bound); ipnext's replan against the start plan, and the one-objective replan it
replaced as the baseline; the goals: cost <= 1.01 x optimum, moved units <= 1.25 x that fewest.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from planner_family import FAMILY_WORK, run_family  # bench/ is the script's directory

from ipnext.contracts.plan import PlanningProblem, SolveOptions, plan_moves
from ipnext.errors import InfeasiblePlanError, PlanningTimeoutError
from ipnext.planner import check_plan, solve
from ipnext.planner.backend import solve_model
from ipnext.planner.decompose import decompose
from ipnext.planner.first_fit import solve as first_fit
from ipnext.planner.formulation import build
from ipnext.planner.generator import changed_demand, generate
from ipnext.planner.instance import compile_problem
from ipnext.planner.moves import fewest_moves_model, moved_units_of
from ipnext.planner.pricing import choices_from_values
from ipnext.planner.solve import EXACT_MAX_VARIABLES
from ipnext.planner.work import UNITS_PER_SECOND, Budget, Clock

# name: (deployments, regions, hardware, utilization, time limit s, work limit in work units)
ROWS: dict[str, tuple[int, int, int, float, float, int]] = {
    "20": (20, 4, 2, 0.5, 30, 3_000_000),
    "100": (100, 4, 2, 0.5, 30, 6_000_000),
    "1000": (1000, 16, 4, 0.5, 60, 14_000_000),
    "10000": (10000, 16, 4, 0.5, 300, 70_000_000),
    "300-tight": (300, 8, 3, 0.9, 60, 14_000_000),
    # A 5% demand change, replanned against the plan of the unchanged demand: one row per
    # size in --replan-sizes and seed in --seeds (the deployments here are not used).
    "replan": (100, 4, 2, 0.5, 30, 6_000_000),
}
REPEAT_CLOCK_FACTOR = 10
REFERENCE_WORK = 10**12  # the reference MIPs: no work limit short of their time limit
T = TypeVar("T")
CAP = 1.01  # the replan goal: cost within 1% of the from-scratch optimum,
MOVES_GOAL = 1.25  # moving at most 1.25x the fewest units any plan within that 1% moves


def _ours(problem: PlanningProblem, limit: float, work: int) -> dict[str, Any]:
    started = time.monotonic()
    try:
        plan = solve(problem, SolveOptions(time_limit_s=limit, work_limit=work))
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
        "stopped_by": plan.stopped_by,
        "work_units": plan.work_units,
        "seconds": time.monotonic() - started,
    }


def _replan(
    seed: int, n: int, limit: float, work: int, reference_limit: float, churn: float | None
) -> dict[str, Any]:
    """One row of the replan goal: a start plan, a 5% demand change, then (a) the from-scratch
    optimum cost of the changed demand (exact MIP; on rows it cannot close in
    `reference_limit`, the cheapest of its best, ipnext's from-scratch plan and ipnext's
    replan, which is a plan of the same demand, and the better of the bounds), (c) ipnext's
    replan (`solve` with `current=`, in `limit`), (b) the fewest units moved by any plan
    costing at most 1.01 x that optimum (exact MIP, current plan = the start plan; its bound
    where it cannot close)."""
    _, regions, hardware, utilization, _, _ = ROWS["replan"]
    problem = generate(seed, n, regions, hardware, utilization=utilization)
    out: dict[str, Any] = {
        "row": "replan",
        "deployments": n,
        "seed": seed,
        "time_limit_s": limit,
        "work_limit": work,
        "reference_time_limit_s": reference_limit,
    }
    started = time.monotonic()
    start = _stage("the start plan", solve, problem, SolveOptions(time_limit_s=limit, work_limit=work))
    out["start_seconds"] = time.monotonic() - started
    changed = changed_demand(problem, seed)  # the 5% change
    inst = compile_problem(changed)
    blocks = list(range(len(inst.blocks)))

    options = (
        SolveOptions(time_limit_s=limit, work_limit=work)
        if churn is None
        else SolveOptions(time_limit_s=limit, work_limit=work, churn_cost=churn)
    )
    current = changed.model_copy(update={"current": start})
    started = time.monotonic()  # (c)
    plan = _stage("ipnext's replan", solve, current, options)
    seconds = time.monotonic() - started
    assert check_plan(changed, plan) == []
    units = {d.name: d.hardware for d in changed.deployments}
    moved = sum(
        max(0, m.after - m.before) * units[m.deployment][m.hardware].units for m in plan_moves(start, plan)
    )
    assert moved == plan.moved_units, (moved, plan.moved_units)
    out["ipnext"] = {
        "cost": plan.cost,
        "moved_units": moved,
        "churn_cost": options.churn_cost,
        "status": plan.status,
        "seconds": seconds,
    }

    started = time.monotonic()  # the baseline: one objective, cost + churn_cost x moved units
    weighted = _stage("the one-objective baseline", _weighted, current, limit, work, options.churn_cost)
    out["weighted_baseline"] = {**weighted, "seconds": time.monotonic() - started}

    started = time.monotonic()  # (a)
    sol = solve_model(
        build(inst, blocks, pool_capacity=inst.pool_units),
        work=REFERENCE_WORK,
        budget=Budget(REFERENCE_WORK, Clock.after(reference_limit)),
        relative_gap=1e-9,
    )
    best = sol.objective if sol.values is not None else float("inf")
    bound = sol.bound
    exact = sol.status == "optimal"
    if not exact:
        scratch = _stage(
            "ipnext from scratch", solve, changed, SolveOptions(time_limit_s=limit, work_limit=work)
        )
        assert check_plan(changed, scratch) == []
        best = min(best, scratch.cost, plan.cost)
        bound = max(bound, scratch.lower_bound or 0.0)
        exact = best - bound <= 1e-9 * best
    out["optimum"] = {"cost": best, "bound": bound, "exact": exact, "seconds": time.monotonic() - started}

    started = time.monotonic()  # (b)
    cap = CAP * best
    cur = compile_problem(current)
    model = fewest_moves_model(cur, blocks, cost_cap=cap, pool_capacity=cur.pool_units)
    fewest = solve_model(
        model,
        work=REFERENCE_WORK,
        budget=Budget(REFERENCE_WORK, Clock.after(reference_limit)),
        relative_gap=1e-9,
    )
    out["fewest_moves"] = {
        "cost_cap": cap,
        "moved_units": round(fewest.objective) if fewest.values is not None else None,
        "bound": fewest.bound,
        "exact": fewest.status == "optimal",
        "seconds": time.monotonic() - started,
    }
    reference = fewest.objective if fewest.status == "optimal" else fewest.bound
    out["cost_ratio"] = plan.cost / best
    out["cost_ratio_to_bound"] = plan.cost / bound if bound > 0 else None
    out["moves_ratio"] = moved / reference if reference > 1e-9 else (1.0 if moved == 0 else None)
    out["weighted_baseline"]["cost_ratio"] = weighted["cost"] / best
    out["weighted_baseline"]["moves_ratio"] = (
        weighted["moved_units"] / reference
        if reference > 1e-9
        else (1.0 if weighted["moved_units"] == 0 else None)
    )
    # The cost goal against the optimum where it is proven, else against the best known plan
    # (cost_ratio_to_bound says how far that can be off); the moves goal against the fewest
    # moves where the MIP closed, else its bound (which only makes the goal harder).
    out["cost_goal"] = plan.cost <= CAP * best * (1 + 1e-9)
    out["moves_goal"] = moved <= MOVES_GOAL * reference + 1e-6
    return out


class RowFailed(Exception):
    """A planner run of a replan row failed (on a loaded machine, out of time)."""


def _stage(name: str, fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    except (InfeasiblePlanError, PlanningTimeoutError) as err:
        raise RowFailed(f"{name}: {err}") from None


def _weighted(problem: PlanningProblem, limit: float, work: int, churn: float) -> dict[str, Any]:
    """What the planner did before its replan had two phases: one objective, cost + churn x
    moved units (the exact MIP where it is small enough and closes, else the decomposition),
    in the shares of the planner before, now of the work limit."""
    budget = Budget(work, Clock.after(limit))
    inst = compile_problem(problem)
    blocks = list(range(len(inst.blocks)))
    model = build(inst, blocks, pool_capacity=inst.pool_units, churn_cost=churn)
    choices = None
    if len(model.lb) <= EXACT_MAX_VARIABLES:
        sol = solve_model(
            model, work=max(UNITS_PER_SECOND, int(0.4 * work)), budget=budget, relative_gap=1e-9
        )
        if sol.status == "optimal" and sol.values is not None:
            choices = choices_from_values(inst, model, sol.values, churn, blocks)
    if choices is None:
        left = budget.left()
        part = budget.part(left - int(0.05 * work))
        choices = decompose(
            inst, churn=churn, budget=part, pricing_share=min(1.0, 0.55 * left / max(1, part.total))
        ).choices
    return {
        "cost": sum(float(inst.opt_cost[o] * n) for c in choices.values() for o, n in c.x.items()),
        "moved_units": sum(moved_units_of(inst, c.x) for c in choices.values()),
    }


def _replan_line(r: dict[str, Any]) -> str:
    """One table row: deployments, seed, cost / optimum, moved / fewest moves, the two goals."""
    fewest = r["fewest_moves"]
    reference = fewest["moved_units"] if fewest["exact"] else f"bound {fewest['bound']:.1f}"
    vs_bound = (
        ""
        if r["optimum"]["exact"]
        else " (vs best known; vs bound " + format(r["cost_ratio_to_bound"], ".4f") + ")"
    )
    return (
        f"replan {r['deployments']:>4} seed {r['seed']}: cost/opt {r['cost_ratio']:.4f}"
        f"{vs_bound}"
        f" [{'pass' if r['cost_goal'] else 'FAIL'}], moved {r['ipnext']['moved_units']} vs fewest {reference}"
        f" = {r['moves_ratio'] if r['moves_ratio'] is None else format(r['moves_ratio'], '.3f')}"
        f" [{'pass' if r['moves_goal'] else 'FAIL'}]; one-objective baseline: cost/opt"
        f" {r['weighted_baseline']['cost_ratio']:.4f}, moved {r['weighted_baseline']['moved_units']};"
        f" replan {r['ipnext']['seconds']:.1f}s,"
        f" optimum {r['optimum']['seconds']:.1f}s, fewest-moves MIP {fewest['seconds']:.1f}s"
    )


def _repeated(row: str, problem: PlanningProblem, limit: float, work: int, times: int) -> dict[str, Any]:
    """The same instance, seed and work limit solved `times` times, the clock at
    REPEAT_CLOCK_FACTOR x `limit`: how many runs gave a plan, each run's gap to its proven
    bound, and the spread of the objectives (none, unless the clock cut a run)."""
    runs = []
    for i in range(times):
        run = _ours(problem, REPEAT_CLOCK_FACTOR * limit, work)
        runs.append(run)
        shown = run.get("failed") or (
            f"objective {run['objective']:.4f}, gap {100 * run['gap']:.2f}%, "
            f"{run['work_units']:,} work units, stopped by the {run['stopped_by']}"
        )
        print(f"{row} run {i + 1}/{times}: {shown} in {run['seconds']:.1f}s", flush=True)
    objectives = [r["objective"] for r in runs if "objective" in r]
    gaps = [r["gap"] for r in runs if "gap" in r]
    summary = {
        "row": row,
        "method": "ipnext",
        "time_limit_s": REPEAT_CLOCK_FACTOR * limit,
        "work_limit": work,
        "repeat": times,
        "plans": len(objectives),
        "worst_gap": max(gaps, default=None),
        "objective_min": min(objectives, default=None),
        "objective_max": max(objectives, default=None),
        "objective_spread": (max(objectives) - min(objectives)) / min(objectives) if objectives else None,
        "runs": runs,
    }
    print(
        f"{row}: {len(objectives)} plans of {times}; worst gap "
        f"{'-' if not gaps else format(100 * max(gaps), '.2f') + '%'}; objectives "
        f"{summary['objective_min']} to {summary['objective_max']}",
        flush=True,
    )
    return summary


def _first_fit(problem: PlanningProblem) -> dict[str, Any]:
    started = time.monotonic()
    try:
        plan = first_fit(problem)
    except InfeasiblePlanError as err:
        return {"method": "first-fit", "failed": str(err)[:200], "seconds": time.monotonic() - started}
    return {"method": "first-fit", "objective": plan.cost, "seconds": time.monotonic() - started}


def _plain_mip(problem: PlanningProblem, limit: float) -> dict[str, Any]:
    """HiGHS on the whole model, stopped by its time limit (a reference, not the planner)."""
    started = time.monotonic()
    inst = compile_problem(problem)
    model = build(inst, list(range(len(inst.blocks))), pool_capacity=inst.pool_units)
    sol = solve_model(
        model, work=REFERENCE_WORK, budget=Budget(REFERENCE_WORK, Clock.after(limit)), relative_gap=1e-6
    )
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
        "--methods",
        nargs="*",
        default=["ipnext", "first-fit", "plain-mip"],
        choices=["ipnext", "first-fit", "plain-mip"],
        help="which of the row methods to run (default: all three)",
    )
    parser.add_argument(
        "--time-limit", type=float, help="every row's time limit, in seconds (default: the row's)"
    )
    parser.add_argument(
        "--work-limit", type=int, help="every row's work limit, in work units (default: the row's)"
    )
    parser.add_argument(
        "--seeds", type=int, nargs="*", default=[1, 2, 3, 4, 5], help="the replan rows' seeds"
    )
    parser.add_argument(
        "--replan-sizes", type=int, nargs="*", default=[20, 100], help="the replan rows' deployments"
    )
    parser.add_argument(
        "--reference-limit",
        type=float,
        default=120,
        help="the replan rows' exact MIPs' time limit, in seconds",
    )
    parser.add_argument("--churn", type=float, help="the replan's churn cost (default: SolveOptions')")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help=(
            "solve each row's instance this many times with ipnext alone: "
            "plans found, gaps, objectives' spread"
        ),
    )
    parser.add_argument(
        "--family",
        type=int,
        nargs="?",
        const=40,
        help="instead of the rows, this many fresh instances of the family (planner_family.py; default 40)",
    )
    parser.add_argument(
        "--family-tight", type=int, default=20, help="of the family's instances, how many 90-98%% full"
    )
    parser.add_argument("--family-seeds", type=int, nargs="*", help="the family's seeds (default: fresh)")
    parser.add_argument(
        "--out", type=Path, help="default bench/results/planner.json (planner-replan.json for --rows replan)"
    )
    args = parser.parse_args()
    if args.family is not None or args.family_seeds:
        limit = args.time_limit or 60.0
        result = run_family(
            args.family or 40, args.family_tight, args.family_seeds, limit, args.work_limit or FAMILY_WORK
        )
        out = args.out or Path("bench/results/planner-family.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
        return
    default = (
        "planner-replan" if args.rows == ["replan"] else "planner-repeat" if args.repeat > 1 else "planner"
    )
    out = args.out or Path(f"bench/results/{default}.json")
    results = []
    for row in args.rows:
        n, regions, hardware, utilization, limit, work = ROWS[row]
        limit = args.time_limit or limit
        work = args.work_limit or work
        if row == "replan":
            for size in args.replan_sizes:
                for seed in args.seeds:
                    try:
                        result = _replan(seed, size, limit, work, args.reference_limit, args.churn)
                    except (
                        InfeasiblePlanError,
                        PlanningTimeoutError,
                    ) as err:  # a failed row, not a failed run
                        result = {"row": "replan", "deployments": size, "seed": seed, "failed": str(err)}
                        print(f"replan {size:>4} seed {seed}: FAILED {err}", flush=True)
                    else:
                        print(_replan_line(result), flush=True)
                    results.append(result)
            continue
        problem = generate(args.seed, n, regions, hardware, utilization=utilization)
        if args.repeat > 1:
            results.append(_repeated(row, problem, limit, work, args.repeat))
            continue
        for method in args.methods:
            if method == "ipnext":
                run = _ours(problem, limit, work)
            elif method == "first-fit":
                run = _first_fit(problem)
            else:
                run = _plain_mip(problem, limit)
            result = {"row": row, "time_limit_s": limit, "work_limit": work, **run}
            results.append(result)
            shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items()}
            print(json.dumps(shown), flush=True)
    ours = {r["row"]: r for r in results if r.get("method") == "ipnext"}
    for r in results:
        if (
            r.get("method", "ipnext") != "ipnext"
            and "objective" in r
            and "objective" in ours.get(r["row"], {})
        ):
            r["ours_over_this"] = ours[r["row"]]["objective"] / r["objective"]
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # Worker processes of the block solves: the largest one (ru_maxrss of children is a max).
    child_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"results": results, "peak_rss_mb": peak_mb, "worker_peak_rss_mb": child_mb}, indent=2)
    )
    print(f"peak RSS {peak_mb:.0f} MB (largest worker {child_mb:.0f} MB); wrote {out}")


if __name__ == "__main__":
    main()
