"""Solving a BlockModel with an OR-Tools backend (HiGHS by default), as a MIP or its LP relaxation,
within a work limit (nodes, simplex iterations: see work.py) and the outer clock."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from ortools.linear_solver.python import model_builder as mb

from ipnext.planner.formulation import BlockModel
from ipnext.planner.work import (
    LP_ITERATION_WORK,
    MIP_BASE_WORK,
    MIP_NNZ_WORK,
    Budget,
    Clock,
    lp_charge,
    mip_charge,
    mip_nodes,
)

__all__ = ["Solution", "root_work", "solve_model"]


@dataclass
class Solution:
    status: str  # "optimal", "feasible", "infeasible", "unknown"
    values: np.ndarray | None
    objective: float
    bound: float  # proven lower bound of the model's optimum
    pool_duals: dict[tuple[int, int], float]
    work: int = 0  # what the call was charged (work.py)
    clock: bool = False  # the outer clock stopped it before it finished


def root_work(model: BlockModel) -> int:
    """What HiGHS's root (presolve, the LP, cuts, heuristics) of the model costs, in work
    units: the node limit does not bound it, so a MIP given less than this may run far past
    its work (and the clock) before the first node. Callers that can do without a MIP skip
    one given less (see work.py for the rate)."""
    return MIP_BASE_WORK + MIP_NNZ_WORK * int(model.matrix.nnz)


def solve_model(
    model: BlockModel,
    *,
    work: int,
    budget: Budget | None = None,
    relax: bool = False,
    solver: str = "highs",
    relative_gap: float = 1e-6,
    threads: int = 1,
) -> Solution:
    """The model solved within `work` units (nodes and simplex iterations, work.py) and the
    clock of `budget`, which is charged; without a budget, the clock is an hour (a test's).
    Single-threaded with a fixed seed: the same call gives the same answer."""
    clock = budget.clock if budget is not None else Clock.after(3600.0)
    work = max(1, int(work))
    m = mb.Model()
    helper: Any = m.helper  # its stubs want float64-shaped arrays mypy cannot see
    helper.fill_model_from_sparse_data(
        model.lb, model.ub, model.obj, model.row_lb, model.row_ub, model.matrix
    )
    if not relax:
        for k in np.flatnonzero(model.integral):
            m.helper.set_var_integrality(int(k), True)
    name = ("highs_lp" if solver == "highs" else "glop") if relax else solver
    engine = mb.Solver(name)
    seconds = clock.seconds_left()
    engine.set_time_limit_in_seconds(seconds)
    iterations = max(100, work // LP_ITERATION_WORK)
    nnz = int(model.matrix.nnz)
    if not relax and solver == "highs":
        engine.set_solver_specific_parameters(
            f"mip_rel_gap={relative_gap}\nthreads={threads}\noutput_flag=false\nrandom_seed=0\n"
            f"mip_max_nodes={mip_nodes(nnz, work)}"
        )
    elif solver == "highs":
        engine.set_solver_specific_parameters(
            f"threads={threads}\noutput_flag=false\nrandom_seed=0\nsimplex_iteration_limit={iterations}"
        )
    else:  # GLOP's parameters, as text
        engine.set_solver_specific_parameters(f"max_number_of_iterations: {iterations}")
    status = engine.solve(m)
    finished = status in (mb.SolveStatus.OPTIMAL, mb.SolveStatus.INFEASIBLE)
    # Whether the clock stopped it: the one reading of how long a call took, and only to say so
    # (a call the clock stopped is charged as if finished: the result is the clock's anyway).
    stopped = not finished and float(engine.wall_time) >= 0.98 * seconds
    charged = finished or stopped
    infeasible = status == mb.SolveStatus.INFEASIBLE
    charge = lp_charge(nnz, work, charged) if relax else mip_charge(nnz, work, charged, infeasible)
    if budget is not None:
        budget.spend(charge)
        if stopped:
            clock.fired = True
    sol = _solution(engine, m, model, status, relax, relative_gap)
    sol.work, sol.clock = charge, stopped
    return sol


def _solution(
    engine: mb.Solver, m: mb.Model, model: BlockModel, status: Any, relax: bool, relative_gap: float
) -> Solution:
    if status == mb.SolveStatus.INFEASIBLE:
        return Solution("infeasible", None, float("inf"), float("inf"), {})
    if status not in (mb.SolveStatus.OPTIMAL, mb.SolveStatus.FEASIBLE):
        return Solution("unknown", None, float("inf"), _bound(engine, relax), {})
    variables = m.get_variables()
    values = np.asarray(engine.values(variables), dtype=np.float64)
    duals: dict[tuple[int, int], float] = {}
    if relax and model.pool_rows:
        constraints = m.get_linear_constraints()
        all_duals = np.asarray(engine.dual_values(constraints), dtype=np.float64)
        duals = {key: max(0.0, -float(all_duals[row])) for key, row in model.pool_rows.items()}
    objective = float(engine.objective_value)
    bound = objective if relax or status == mb.SolveStatus.OPTIMAL else _bound(engine, relax)
    if status == mb.SolveStatus.OPTIMAL and not relax:
        bound = max(_bound(engine, relax), objective * (1 - relative_gap) - 1e-9)
    return Solution(
        "optimal" if status == mb.SolveStatus.OPTIMAL else "feasible", values, objective, bound, duals
    )


def _bound(engine: mb.Solver, relax: bool) -> float:
    try:
        value = float(engine.best_objective_bound)
    except (TypeError, ValueError):
        return -float("inf")
    return value if np.isfinite(value) else -float("inf")
