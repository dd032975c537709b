"""The exact optimum of one block's priced placement problem, without a MIP solver.

`solve_block_fast(inst, block, prices, churn)` solves what `formulation.build(inst, [block],
prices=prices, churn_cost=churn)` encodes (no pool rows): integer replicas x[o] in
[0, min(pool holds, ceil(total / (usable * qps)))], routing fractions f, regions y, min_regions,
survive_region_loss and churn. It returns the placement, its priced objective and a lower
bound; `optimal` says whether the bound is the objective. It returns None for what it does
not handle (group members whose demand is not proportional, more than 8 traffic sources), for
a block with no feasible placement, and when its work budget ran out before any placement was
found; the caller then uses the MIP (which also explains an infeasible block).

Why this shape. A block is tiny (in the fleets we plan: up to 16 regions, 4 traffic sources,
3 members, 3 hardware options per member and region) but the MIP is slow on it
(big-M links between y and x, and
survive_region_loss, which makes HiGHS branch for seconds). Its structure lets a dynamic
program over the regions solve it exactly instead:

1. Levels. What a member does in a region matters to every row only through its capacity
   there (the rows are all monotone in it) and its cost, so per (member, region) only the
   Pareto frontier of (capacity, cost) over the replica vectors is kept, with capacity
   truncated at what can ever help (the traffic routed to the region, or the member's whole
   demand when it must survive a loss: the formulation's own bound on x). Churn is a convex
   per-option cost and simply enters the level costs.
2. Routing. With demand proportional across members (d[i] = k_i w), a region's routing
   capacity is L_r = min over members of capacity / k_i, and routing is a transportation
   problem: by the supply-demand theorem (Gale, Hall) fractions exist iff for every set T of
   sources, w(T) <= sum of L_r over the regions reachable from T. Only sets closed under
   "reaches nothing else" and connected through shared regions are needed; the others follow.
3. Survive. sum_r c_r - max_r c_r >= W holds iff some M bounds every c_r and sum_r c_r >= W + M.
   So each survive member's largest capacity M is declared (one of its level capacities), its
   levels are capped at M and its sum is due at W + M: a plain covering row. Every feasible
   placement lies in the run of its own M, and every placement of a run survives, so the best
   over runs is the optimum. Runs are taken in increasing order of a Lagrangian bound
   (computed for all declarations at once) and stop when it reaches the incumbent.
4. The DP. A state is (regions so far, Hall row coverage, survive sums), each truncated at
   what is due, so equal futures merge; a region is left out or takes one of its options (L
   with the members tied to it, each survive member's level at least L). States are pruned by
   valid lower bounds on what the remaining regions must cost (cheapest presences for
   min_regions, per-source cheapest routing of the uncovered traffic - a polymatroid, so
   greedy is exact -, a fractional knapsack on the convex envelope of the survive levels, and
   Lagrangian bounds with LP prices whose region terms are exact over the levels), and by
   dominance (no more cost and at least as much of everything: every completion of the
   dominated state works for the other). Nothing else is dropped, so the DP is exact. Small
   runs go in plain Python; larger ones, after an LP prices their rows, in numpy arrays.

The bounds make the search small on most blocks; big deployments with many near-equal regions
(and groups with survive_region_loss) can still have many near-optimal states. A work budget
caps each block: past it the best placement found is returned with the least lower bound of
what was not finished, and optimal=False.

Modules: structure (the block's data, built whole or not at all), bounds (Lagrangian bounds
and the order of the declarations), run (a run and its Python search), arrays (the array
search), dominance, placement (replicas and routing of the chosen levels), search (the runs
of a block within its work budget).
"""

from ipnext.planner.block.common import FastResult
from ipnext.planner.block.search import search_block, solve_block_fast

__all__ = ["FastResult", "search_block", "solve_block_fast"]
