"""Solving a BlockModel with an OR-Tools backend (HiGHS by default), as a MIP or its LP relaxation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from ortools.linear_solver.python import model_builder as mb

from ipnext.planner.formulation import BlockModel

__all__ = ["Solution", "solve_model"]


@dataclass
class Solution:
    status: str  # "optimal", "feasible", "infeasible", "unknown"
    values: np.ndarray | None
    objective: float
    bound: float  # proven lower bound of the model's optimum
    pool_duals: dict[tuple[int, int], float]


def solve_model(
    model: BlockModel,
    *,
    relax: bool = False,
    solver: str = "highs",
    time_limit_s: float = 60.0,
    relative_gap: float = 1e-6,
    threads: int = 1,
) -> Solution:
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
    engine.set_time_limit_in_seconds(max(0.05, time_limit_s))
    if not relax and solver == "highs":
        engine.set_solver_specific_parameters(
            f"mip_rel_gap={relative_gap}\nthreads={threads}\noutput_flag=false\nrandom_seed=0"
        )
    elif solver == "highs":
        engine.set_solver_specific_parameters(f"threads={threads}\noutput_flag=false")
    status = engine.solve(m)
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
