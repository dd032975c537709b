"""The placement MIP over any subset of blocks, built as sparse arrays (fast at 10^6 variables).

Variables, in this order:
  x[o]    replicas of option o = (deployment, region, hardware), integer in [0, pool holds]
  f[t]    share of route t = (block, source, region) of the source's traffic, in [0, 1]
  y[b,r]  block b holds replicas in region r, binary
  z[o]    replicas newly placed on option o against the current plan (churn), >= 0

Rows: each (block, source) routes all its traffic; each (deployment, region) carries what
is routed there with headroom, and where the block stands (y[b,r] = 1) its spare too
(`Instance.spare`); y[b,r] = 1 needs a replica of every member in r, and in a group
replicas only stand where y is 1 (same regions for all parts); at least min_regions
regions; survive_region_loss: for every region, the capacity elsewhere covers the total;
pools (optional, or priced into the objective instead: Lagrangian relaxation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from ipnext.planner.instance import Instance

__all__ = ["BlockModel", "build"]


@dataclass
class BlockModel:
    opts: np.ndarray  # option index of each x
    routes: np.ndarray  # route index of each f
    y_keys: list[tuple[int, int]]  # (block, region) of each y
    n_x: int
    n_f: int
    n_y: int
    n_z: int
    lb: np.ndarray
    ub: np.ndarray
    obj: np.ndarray
    integral: np.ndarray  # bool per variable
    matrix: sp.csr_matrix
    row_lb: np.ndarray
    row_ub: np.ndarray
    pool_rows: dict[tuple[int, int], int]  # (region, hardware) -> row


class _Rows:
    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lb: list[float] = []
        self.ub: list[float] = []

    def add(self, cols: list[int] | np.ndarray, vals: list[float] | np.ndarray, lo: float, hi: float) -> int:
        row = len(self.lb)
        self.rows.extend([row] * len(cols))
        self.cols.extend(int(c) for c in cols)
        self.vals.extend(float(v) for v in vals)
        self.lb.append(lo)
        self.ub.append(hi)
        return row


def build(
    inst: Instance,
    blocks: list[int] | np.ndarray,
    *,
    pool_capacity: np.ndarray | None = None,
    prices: np.ndarray | None = None,
    churn_cost: float = 0.0,
) -> BlockModel:
    """The model of `blocks`. With `pool_capacity` (regions x hardware) pool rows are added;
    `prices` (same shape) are added to the unit cost instead (Lagrangian pricing)."""
    members = [i for b in blocks for i in inst.blocks[b]]
    opts = np.concatenate([inst.options_of[i] for i in members]) if members else np.zeros(0, np.int64)
    routes = np.concatenate([inst.routes_of[b] for b in blocks]) if len(blocks) else np.zeros(0, np.int64)
    n_x, n_f = len(opts), len(routes)
    y_keys = [(int(b), r) for b in blocks for r in range(len(inst.regions))]
    y_col = {key: n_x + n_f + k for k, key in enumerate(y_keys)}
    n_y = len(y_keys)
    use_churn = churn_cost > 0 and inst.problem.current is not None
    n_z = n_x if use_churn else 0
    z0 = n_x + n_f + n_y

    unit_price = inst.opt_units[opts] * (
        prices[inst.opt_r[opts], inst.opt_h[opts]] if prices is not None else 0.0
    )
    obj = np.concatenate(
        [
            inst.opt_cost[opts] + unit_price,
            np.zeros(n_f),
            np.zeros(n_y),
            churn_cost * inst.opt_units[opts] if n_z else [],
        ]
    )
    lb = np.zeros(n_x + n_f + n_y + n_z)
    # More replicas of one option than carry the deployment's whole demand and its spare never
    # help (the routing, survive and min_regions rows are all met by that many), so they bound
    # x: a tight bound keeps the LP relaxation, and with it the branch and bound, small.
    x_ub = np.minimum(inst.opt_cap[opts], np.maximum(inst.opt_enough[opts], 1.0))
    ub = np.concatenate([x_ub, np.ones(n_f), np.ones(n_y), np.full(n_z, np.inf)])
    integral = np.zeros(len(lb), dtype=bool)
    integral[:n_x] = True
    integral[n_x + n_f : n_x + n_f + n_y] = True

    rows = _Rows()
    # Options and routes of each (deployment, region) / (block, source), for the rows below.
    opts_at: dict[tuple[int, int], list[int]] = {}
    for k, o in enumerate(opts):
        opts_at.setdefault((int(inst.opt_d[o]), int(inst.opt_r[o])), []).append(k)
    routes_from: dict[tuple[int, int], list[int]] = {}
    routes_to: dict[tuple[int, int], list[int]] = {}
    for k, t in enumerate(routes):
        b, s, r = int(inst.route_b[t]), int(inst.route_s[t]), int(inst.route_r[t])
        routes_from.setdefault((b, s), []).append(n_x + k)
        routes_to.setdefault((b, r), []).append(k)

    for (_b, _s), cols in routes_from.items():
        rows.add(cols, [1.0] * len(cols), 1.0, 1.0)
    for b in blocks:
        b = int(b)
        group = inst.blocks[b]
        regions_used = range(len(inst.regions))
        for i in group:
            alpha = inst.usable[i]
            for r in regions_used:
                here = opts_at.get((i, r), [])
                into = routes_to.get((b, r), [])
                spare = float(inst.spare[i, r]) if here else 0.0
                if into or spare > 0:
                    # what is routed here, plus the spare wherever the block stands
                    cols = [n_x + k for k in into] + here + ([y_col[(b, r)]] if spare > 0 else [])
                    vals = [inst.demand[i, inst.route_s[routes[k]]] for k in into] + [
                        -alpha * inst.opt_qps[opts[k]] for k in here
                    ]
                    rows.add(cols, [*vals, spare] if spare > 0 else vals, -np.inf, 0.0)
                # y[b,r] = 1 needs a replica of this member in r.
                rows.add([y_col[(b, r)], *here], [1.0] + [-1.0] * len(here), -np.inf, 0.0)
                if here:  # replicas only where the block stands (a group's parts share regions)
                    for k in here:
                        rows.add([k, y_col[(b, r)]], [1.0, -float(x_ub[k])], -np.inf, 0.0)
            if inst.survive[i]:
                total = inst.total_demand[i]
                mine = [k for r in regions_used for k in opts_at.get((i, r), [])]
                for lost in regions_used:
                    cols = [k for k in mine if inst.opt_r[opts[k]] != lost]
                    rows.add(cols, [alpha * inst.opt_qps[opts[k]] for k in cols], total, np.inf)
        cols = [y_col[(b, r)] for r in regions_used]
        rows.add(cols, [1.0] * len(cols), float(inst.min_regions[b]), np.inf)

    pool_rows: dict[tuple[int, int], int] = {}
    if pool_capacity is not None:
        by_pool: dict[tuple[int, int], list[int]] = {}
        for k, o in enumerate(opts):
            by_pool.setdefault((int(inst.opt_r[o]), int(inst.opt_h[o])), []).append(k)
        for key, cols in sorted(by_pool.items()):
            pool_rows[key] = rows.add(cols, inst.opt_units[opts[cols]], -np.inf, float(pool_capacity[key]))
    if n_z:
        for k in range(n_x):  # z >= x - current
            rows.add([z0 + k, k], [1.0, -1.0], -float(inst.opt_current[opts[k]]), np.inf)

    matrix = sp.csr_matrix(
        (rows.vals, (rows.rows, rows.cols)), shape=(len(rows.lb), len(lb)), dtype=np.float64
    )
    return BlockModel(
        opts=opts,
        routes=routes,
        y_keys=y_keys,
        n_x=n_x,
        n_f=n_f,
        n_y=n_y,
        n_z=n_z,
        lb=lb,
        ub=ub,
        obj=obj,
        integral=integral,
        matrix=matrix,
        row_lb=np.asarray(rows.lb),
        row_ub=np.asarray(rows.ub),
        pool_rows=pool_rows,
    )
