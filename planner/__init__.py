"""Placement planning: pure functions from a PlanningProblem to a Plan (no Temporal, no Ray).

`solve(problem, options)` is the one entry point; it returns a Plan that respects every
constraint or raises InfeasiblePlanError naming the one it cannot meet.
"""

from ipnext.planner.solve import solve
from ipnext.planner.validate import check_plan

__all__ = ["check_plan", "solve"]
