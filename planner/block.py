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
3 members, 3 hardware options per member and region) but the MIP is slow on it (big-M links between y and x, and
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
"""

from __future__ import annotations

import heapq
import itertools
import math
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import numpy as np
from scipy.optimize import linprog

from ipnext.planner.instance import Instance

__all__ = ["FastResult", "solve_block_fast"]

TOL = 1e-9
WORK_BUDGET = 20_000  # per block; a unit is about one Python DP step (a few microseconds)
EASY_WORK = 1_500  # Python search before a run is priced by an LP and searched in arrays
NP_WORK_SCALE = 20  # array work units (state transitions) per Python work unit
MAX_OPTIONS = 4_000  # a region's options multiplied out, at most
LP_WORK = 500  # what one LP for multipliers counts as
FEW_DECLARATIONS = 8  # survive declarations tried without an LP to order them
BEAM = 6
RECENT_MULTS = 2  # multipliers of earlier runs a run is first bounded with
PROBES = 6  # declarations searched with a beam for an incumbent before any exact run
DOMINANCE_REFS = 512

Level = tuple[float, float, tuple[int, ...]]  # (capacity, cost, replicas per option)
Key = tuple[tuple[float, ...], int, tuple[float, ...]]  # (Hall row coverage, regions, survive sums)


@dataclass
class FastResult:
    x: dict[int, int]  # option -> replicas
    f: dict[int, float]  # route -> fraction
    objective: float  # priced cost (+ churn)
    bound: float  # proven lower bound of the block's optimum (== objective when optimal)
    optimal: bool  # False: the work budget ran out; objective is the best found
    work: int = 0  # work units spent
    states: int = 0  # most DP states in one layer
    runs: int = 0  # DP runs (survive declarations searched)


@dataclass
class _Region:
    r: int
    wa: float  # traffic of the sources routed to it
    smask: int  # those sources
    cmask: int  # Hall rows its routing capacity counts in
    oids: list[list[int]]  # per member: option ids, aligned with the counts of its levels
    levels: list[list[Level]]  # per member
    lopts: list[tuple[float, float, tuple[int, ...]]]  # (L, cost of the members tied to L, their levels)
    svlev: list[list[tuple[float, float]]]  # per survive member: (capacity, cost)
    zcost: float  # presence of the members without demand
    rate_l: float  # cost per unit of routing capacity, at least
    rate_sv: list[float]  # per survive member: cost per unit of its capacity, at least


@dataclass
class _RunRegion:
    """A region under a run's declared largest capacities (survive levels capped)."""

    g: _Region
    lopts: list[tuple[float, float, int]]  # (L, cost, index in g.lopts)
    svlev: list[list[tuple[float, float, int]]]  # per survive member: (capacity, cost, level)
    base: float  # cheapest presence
    max_l: float  # most routing capacity
    sv_u: list[float]  # per survive member: most capacity
    sv_unit: list[float]  # per survive member: slope of the convex envelope of its cost


def _pareto(cand: list[Level]) -> list[Level]:
    """The levels no other beats on both capacity and cost, by capacity."""
    cand.sort(key=lambda t: (-t[0], t[1]))
    out = []
    best = math.inf
    for item in cand:
        if item[1] < best:
            out.append(item)
            best = item[1]
    out.reverse()
    return out


def _levels(opts: list[tuple[float, list[float]]], limit: float) -> list[Level]:
    """Pareto (capacity, cost, counts) of the nonzero replica vectors of one member in one
    region, capacity truncated at `limit`."""
    lim = limit - TOL * max(1.0, limit)
    front: list[Level] = []
    for k, (qn, costs) in enumerate(opts):
        cand: list[Level] = []
        for cap, cost, x in front:
            for n, cn in enumerate(costs):
                c = cap + n * qn
                if c >= lim:
                    cand.append((limit, cost + cn, (*x, n)))
                    break
                cand.append((c, cost + cn, (*x, n)))
        zx = (0,) * k
        for n in range(1, len(costs)):
            c = n * qn
            if c >= lim:
                cand.append((limit, costs[n], (*zx, n)))
                break
            cand.append((c, costs[n], (*zx, n)))
        front = _pareto(cand)
    return front


def _below(value: float) -> float:
    """What a cost must stay under to beat `value` (by more than the tolerance)."""
    return value - TOL * max(1.0, abs(value)) if value < math.inf else math.inf


def _nondominated(vecs: list[tuple[float, ...]]) -> list[int]:
    """Indices of the vectors (sorted by cost) that no earlier kept one covers in every
    component."""
    if len(vecs) > 48:
        return [int(i) for i in _nondominated_np(np.asarray(vecs, dtype=np.float64), 0)]
    kept: list[tuple[float, ...]] = []
    out = []
    for i, vec in enumerate(vecs):
        if not any(all(a >= b for a, b in zip(kv, vec, strict=True)) for kv in kept):
            kept.append(vec)
            out.append(i)
    return out


def _knap(items: list[tuple[float, float, int]], need: float, j: int) -> float:
    """Fractional knapsack cover of `need` by items (unit cost, size, position) at position >= j,
    cheapest unit first (the caller has checked that they hold `need`, within tolerance)."""
    lb = 0.0
    for unit, size, pos in items:
        if pos < j:
            continue
        if size >= need:
            return lb + unit * need
        lb += unit * size
        need -= size
    return lb


def _nondominated_np(arr: np.ndarray, beam: int) -> np.ndarray:
    """Indices of the rows (sorted by cost) that no earlier kept row covers in every
    component; with `beam`, only the first that many. Each row is checked against at most
    DOMINANCE_REFS kept rows: keeping a dominated row is only slower, never wrong."""
    n, d = arr.shape
    if n <= 1:
        return np.arange(n)
    cols = np.ascontiguousarray(arr.T)
    kept: list[int] = []
    ref: np.ndarray | None = None  # (components, kept rows) checked against
    step = 128
    lower_tri = np.tri(step, k=-1, dtype=bool)
    for start in range(0, n, step):
        end = min(n, start + step)
        part = cols[:, start:end]
        size = end - start
        if ref is not None:
            cover = np.ones((size, ref.shape[1]), dtype=bool)
            for k in range(d):
                cover &= ref[k][None, :] >= part[k][:, None]
            ok = np.logical_not(cover.any(axis=1))
        else:
            ok = np.ones(size, dtype=bool)
        inner = lower_tri[:size, :size] & ok[None, :]
        for k in range(d):
            inner &= part[k][None, :] >= part[k][:, None]
        ok &= ~inner.any(axis=1)
        kept.extend((np.flatnonzero(ok) + start).tolist())
        if beam and len(kept) >= beam:
            return np.asarray(kept[:beam], dtype=np.int64)
        if ref is None or ref.shape[1] < DOMINANCE_REFS:
            ref = cols[:, kept[:DOMINANCE_REFS]]
    return np.asarray(kept, dtype=np.int64)


def _thinned(
    lev: list[tuple[float, float, int]], floor: float, need: float
) -> list[tuple[float, float, int]]:
    """A few of a member's levels for a heuristic search: the least allowed, the least that
    covers `need`, the largest, and some spread between."""
    first = bisect_left([lv[0] for lv in lev], floor)
    if len(lev) - first <= 6:
        return lev[first:]
    cover = first
    while cover < len(lev) - 1 and lev[cover][0] < need:
        cover += 1
    picks = {first, cover, len(lev) - 1, *np.linspace(first, len(lev) - 1, 5).astype(int).tolist()}
    return [lev[i] for i in sorted(picks)]


def _first_unique(y: np.ndarray) -> np.ndarray:
    """Index of the first occurrence of each distinct row, in order."""
    rows = np.ascontiguousarray(y).view(np.dtype((np.void, y.dtype.itemsize * y.shape[1]))).ravel()
    _, first = np.unique(rows, return_index=True)
    first.sort()
    return first


class _Block:
    """A block's data for the search: proportional demand, Hall rows, and per region the
    members' levels and the options they make."""

    def __init__(self, inst: Instance, block: int, prices: np.ndarray, churn: float) -> None:
        self.ok = False
        self.work = 0
        self.inst = inst
        self.block = block
        self.prices = prices
        self.churn = churn
        self.use_churn = churn > 0 and inst.problem.current is not None
        members = [int(i) for i in inst.blocks[block]]
        self.members = members
        n_mem = len(members)
        dem = inst.demand[members]
        tot = dem.sum(axis=1)
        big_w = float(tot.max())
        if big_w > 0:
            w = dem[int(np.argmax(tot))]
            k = tot / big_w
            if np.abs(dem - k[:, None] * w[None, :]).max() > TOL * big_w:
                return
        else:
            w = np.zeros(dem.shape[1])
            k = np.zeros(n_mem)
        self.big_w = big_w
        n_regions = len(inst.regions)
        routes = inst.routes_of[block]
        src = sorted({int(s) for s in inst.route_s[routes]})
        if any(w[s] <= 0 for s in src) or len(src) > 8 or (big_w > 0 and not src):
            return
        self.src = src
        s_index = {s: j for j, s in enumerate(src)}
        reach = [0] * n_regions  # region -> bitmask of sources routed to it
        for t in routes:
            reach[int(inst.route_r[t])] |= 1 << s_index[int(inst.route_s[t])]
        ws = [float(w[s]) for s in src]
        self.ws = ws
        n_src = len(src)
        self.n_src = n_src
        self.m_need = int(inst.min_regions[block])

        opts_at: list[dict[int, list[int]]] = []
        for i in members:
            by_r: dict[int, list[int]] = {}
            for o in inst.options_of[i]:
                by_r.setdefault(int(inst.opt_r[o]), []).append(int(o))
            opts_at.append(by_r)
        cand_regions = [r for r in range(n_regions) if all(r in by_r for by_r in opts_at)]

        # Hall rows: for each closed, connected set T of sources, the routing capacity of the
        # regions reachable from T covers the traffic of T.
        nmask = [0] * n_src
        for r in range(n_regions):
            for j in range(n_src):
                if reach[r] >> j & 1:
                    nmask[j] |= 1 << r
        sub_n = [0] * (1 << n_src)
        sub_w = [0.0] * (1 << n_src)
        for u in range(1, 1 << n_src):
            low = (u & -u).bit_length() - 1
            sub_n[u] = sub_n[u & (u - 1)] | nmask[low]
            sub_w[u] = sub_w[u & (u - 1)] + ws[low]
        self.sub_w = sub_w

        def components(u: int) -> list[int]:
            out = []
            left = u
            while left:
                first = (left & -left).bit_length() - 1
                comp = 1 << first
                stack = [first]
                while stack:
                    a = stack.pop()
                    for b in range(n_src):
                        if left >> b & 1 and not comp >> b & 1 and nmask[a] & nmask[b]:
                            comp |= 1 << b
                            stack.append(b)
                out.append(comp)
                left &= ~comp
            return out

        def closure(u: int) -> int:
            nm = sub_n[u]
            return sum(1 << j for j in range(n_src) if nmask[j] & ~nm == 0)

        rows: dict[int, int] = {}  # closed connected source set -> row
        row_sets: list[int] = []
        comp_rows: list[list[int]] = [[] for _ in range(1 << n_src)]
        for u in range(1, 1 << n_src):
            for comp in components(u):
                c = closure(comp)
                if c not in rows:
                    rows[c] = len(row_sets)
                    row_sets.append(c)
                comp_rows[u].append(rows[c])
        self.comp_rows = comp_rows
        self.con_w = [sub_w[c] for c in row_sets]
        self.con_n = [sub_n[c] for c in row_sets]
        n_con = len(row_sets)
        self.n_con = n_con

        mplus = [a for a in range(n_mem) if k[a] > 0]
        sv = [a for a in mplus if inst.survive[members[a]]]
        ns = [a for a in mplus if not inst.survive[members[a]]]
        zero = [a for a in range(n_mem) if k[a] <= 0]
        self.sv, self.ns, self.k = sv, ns, k
        self.n_sv = len(sv)
        self.ns_tied = bool(ns) or not sv

        regions: list[_Region] = []
        for r in cand_regions:
            wa = sum(ws[j] for j in range(n_src) if reach[r] >> j & 1)
            lv: list[list[Level]] = []
            rates: list[float] = []
            oids: list[list[int]] = []
            for a, i in enumerate(members):
                olist = opts_at[a][r]
                oids.append(olist)
                data = []
                rate = math.inf
                for o in olist:
                    p = float(inst.opt_cost[o] + inst.opt_units[o] * prices[r, inst.opt_h[o]])
                    q = float(inst.usable[i] * inst.opt_qps[o])
                    if q <= 0 or p < 0:
                        return
                    qn = q / float(k[a]) if k[a] > 0 else 1.0
                    enough = math.ceil(float(tot[a]) / q - 1e-9)
                    ub = int(min(inst.opt_cap[o], max(enough, 1)))
                    cur = float(inst.opt_current[o]) if self.use_churn else 0.0
                    cu = churn * float(inst.opt_units[o]) if self.use_churn else 0.0
                    data.append((qn, [p * n + cu * max(0.0, n - cur) for n in range(ub + 1)]))
                    rate = min(rate, p / qn)
                limit = 0.0 if k[a] <= 0 else (big_w if a in sv else wa)
                lv.append(_levels(data, limit))
                rates.append(rate if k[a] > 0 else 0.0)
            zcost = sum((lv[a][0][1] for a in zero), 0.0)
            lopts: list[tuple[float, float, tuple[int, ...]]] = []
            if not self.ns_tied or not mplus:
                lopts = [(0.0, zcost, ())]
            else:
                lset = sorted({min(c, wa) for a in mplus for c, _, _ in lv[a]})
                svtop = min((lv[a][-1][0] for a in sv), default=math.inf)
                for ell in lset:
                    if ell > svtop:
                        break
                    total = zcost
                    idx = []
                    for a in ns:
                        for q, (cap, cost, _) in enumerate(lv[a]):
                            if cap >= ell:
                                total += cost
                                idx.append(q)
                                break
                        else:
                            break
                    if len(idx) < len(ns):
                        break
                    if lopts and lopts[-1][1] >= total and not sv:  # same cost, more capacity
                        lopts.pop()
                    lopts.append((ell, total, tuple(idx)))
            regions.append(
                _Region(
                    r=r,
                    wa=wa,
                    smask=reach[r],
                    cmask=sum(1 << c for c in range(n_con) if self.con_n[c] >> r & 1),
                    oids=oids,
                    levels=lv,
                    lopts=lopts,
                    svlev=[[(c, cost) for c, cost, _ in lv[a]] for a in sv],
                    zcost=zcost,
                    rate_l=sum(rates[a] for a in mplus),
                    rate_sv=[rates[a] for a in sv],
                )
            )
        self.regions = regions
        self.ok = True

    def prepare(self, mvec: tuple[float, ...]) -> list[_RunRegion]:
        """The regions of the run with these declared largest capacities (those where every
        survive member has a level under its declaration), cheapest routing first."""
        out = []
        for g in self.regions:
            svl = []
            for s, m in enumerate(mvec):
                lim = m + TOL * max(1.0, m)
                lev = [(c, cost, q) for q, (c, cost) in enumerate(g.svlev[s]) if c <= lim]
                if not lev:
                    break
                svl.append(lev)
            if len(svl) < len(mvec):
                continue
            if self.ns_tied:
                top = min((lev[-1][0] for lev in svl), default=math.inf)
                top += TOL * max(1.0, top)
                lo = [(ell, cost, li) for li, (ell, cost, _) in enumerate(g.lopts) if ell <= top]
                max_l = lo[-1][0]
            else:
                lo = [(0.0, g.zcost, 0)]
                max_l = min(min(lev[-1][0] for lev in svl), g.wa)
            sv_u = [lev[-1][0] for lev in svl]
            out.append(
                _RunRegion(
                    g=g,
                    lopts=lo,
                    svlev=svl,
                    base=lo[0][1] + sum(lev[0][1] for lev in svl),
                    max_l=max_l,
                    sv_u=sv_u,
                    sv_unit=[max(svl[s][0][1] / sv_u[s], g.rate_sv[s]) for s in range(len(svl))],
                )
            )
        out.sort(key=lambda x: (x.g.rate_l, x.base))
        return out

    def options_of(self, rr: _RunRegion) -> list[tuple[float, float, list[float]]]:
        """Explicit (cost, L, survive capacities) options of a region, enough to price its rows:
        each L with every survive member's cheapest level at least L (or, with no member tied
        to L, each threshold t with every survive member's cheapest level at least t)."""
        out = []
        if self.ns_tied:
            for ell, lcost, _ in rr.lopts:
                cost = lcost
                caps = []
                floor = ell - TOL * max(1.0, ell)
                for lev in rr.svlev:
                    for cap, c, _q in lev:
                        if cap >= floor:
                            cost += c
                            caps.append(cap)
                            break
                if len(caps) == len(rr.svlev):
                    out.append((cost, ell, caps))
            if rr.svlev:
                top = [lev[-1] for lev in rr.svlev]
                out.append((rr.lopts[0][1] + sum(t[1] for t in top), rr.lopts[0][0], [t[0] for t in top]))
        else:
            zc = rr.lopts[0][1]
            for t in sorted({cap for lev in rr.svlev for cap, _, _ in lev}):
                floor = t - TOL * max(1.0, t)
                cost = zc
                caps = []
                for lev in rr.svlev:
                    for cap, c, _q in lev:
                        if cap >= floor:
                            cost += c
                            caps.append(cap)
                            break
                if len(caps) < len(rr.svlev):
                    break
                out.append((cost, min(min(caps), rr.g.wa), caps))
            top = [lev[-1] for lev in rr.svlev]
            caps = [t[0] for t in top]
            out.append((zc + sum(t[1] for t in top), min(min(caps), rr.g.wa), caps))
        return out

    def region_term(self, rr: _RunRegion, lam: list[float]) -> float:
        """min(0, least cost - lam . contribution over the region's options): exact over every
        combination of levels (per L, or per threshold, the survive members are independent)."""
        n_con = self.n_con
        lrow = sum(lam[c] for c in range(n_con) if rr.g.cmask >> c & 1)
        mu = lam[-1]
        sufs = []
        for s, lev in enumerate(rr.svlev):
            ls = lam[n_con + s]
            vals = [c - ls * cap for cap, c, _ in lev]
            for q in range(len(vals) - 2, -1, -1):
                if vals[q + 1] < vals[q]:
                    vals[q] = vals[q + 1]
            sufs.append(([cap for cap, _, _ in lev], vals))
        best = 0.0
        if self.ns_tied:
            for ell, lcost, _ in rr.lopts:
                v = lcost - lrow * ell - mu
                floor = ell - TOL * max(1.0, ell)
                for caps, vals in sufs:
                    q = bisect_left(caps, floor)
                    v = v + vals[q] if q < len(caps) else math.inf
                best = min(best, v)
        else:
            zc = rr.lopts[0][1]
            for t in sorted({cap for caps, _ in sufs for cap in caps}):
                floor = t - TOL * max(1.0, t)
                v = zc - lrow * min(t, rr.g.wa) - mu
                for caps, vals in sufs:
                    q = bisect_left(caps, floor)
                    v = v + vals[q] if q < len(caps) else math.inf
                if v == math.inf:
                    break
                best = min(best, v)
        return best

    def lagrangian(
        self, regs: list[_RunRegion], lam: list[float], targets: list[float]
    ) -> tuple[tuple[list[float], list[float]], float]:
        """Suffix sums of the region terms under `lam`, and the bound it gives at the start."""
        suf = [0.0] * (len(regs) + 1)
        for j in range(len(regs) - 1, -1, -1):
            suf[j] = suf[j + 1] + self.region_term(regs[j], lam)
        root = suf[0] + lam[-1] * self.m_need
        root += sum(lam[c] * self.con_w[c] for c in range(self.n_con))
        root += sum(lam[self.n_con + s] * targets[s] for s in range(self.n_sv))
        return (lam, suf), root

    def multipliers(self, regs: list[_RunRegion], targets: list[float]) -> list[float] | None:
        """Row prices from the LP over the regions' options (the dual of its covering rows)."""
        n_con, n_sv = self.n_con, self.n_sv
        k = n_con + n_sv + 1
        costs: list[float] = []
        cols: list[list[float]] = []
        region_of: list[int] = []
        for pos, rr in enumerate(regs):
            for cost, ell, caps in self.options_of(rr):
                col = [ell if rr.g.cmask >> c & 1 else 0.0 for c in range(n_con)]
                col.extend(caps)
                col.append(1.0)
                cols.append(col)
                costs.append(cost)
                region_of.append(pos)
        if not cols:
            return None
        cover = np.asarray(cols).T
        region = np.zeros((len(regs), len(cols)))
        region[region_of, np.arange(len(cols))] = 1.0
        need = np.asarray([*self.con_w, *targets, float(self.m_need)])
        res = linprog(
            np.asarray(costs),
            A_ub=np.vstack([-cover, region]),
            b_ub=np.concatenate([-need, np.ones(len(regs))]),
            bounds=(0, None),
            method="highs",
        )
        self.work += LP_WORK
        if res.status != 0:
            return None
        lam = np.maximum(0.0, -np.asarray(res.ineqlin.marginals[:k], dtype=float))
        return [float(v) for v in lam]

    def screen(
        self, cands: list[list[float]], lam: list[float]
    ) -> Iterator[tuple[float, float, tuple[float, ...]]]:
        """Declared vectors under `lam`, in increasing order of a Lagrangian bound separable
        over the survive members (region terms min(0, a + sum b_s) >= min(0, a) + sum
        min(0, b_s)), each with the coupled bound sum over regions of min(0, a + sum b_s)
        (for a lone member both are the exact Lagrangian bound). Declarations under which
        the regions cannot hold W + M are left out."""
        n_con, n_sv, big_w = self.n_con, self.n_sv, self.big_w
        mu = lam[-1]
        const = mu * self.m_need + sum(lam[c] * self.con_w[c] for c in range(n_con))
        lone = not self.ns_tied and len(self.members) == 1
        lrows = [sum(lam[c] for c in range(n_con) if g.cmask >> c & 1) for g in self.regions]
        if lone:
            fixed = np.zeros(len(self.regions))
        elif self.ns_tied:
            fixed = np.asarray(
                [
                    min(lc - lr * ell for ell, lc, _ in g.lopts) - mu
                    for g, lr in zip(self.regions, lrows, strict=True)
                ]
            )
        else:
            fixed = np.asarray([g.zcost - lr * g.wa - mu for g, lr in zip(self.regions, lrows, strict=True)])
        parts, lins, terms = [], [], []
        for s in range(n_sv):
            grid = np.asarray(cands[s])
            ls = lam[n_con + s]
            lin = ls * (big_w + grid)
            room = np.zeros(len(grid))  # most capacity the regions hold under each declaration
            term = np.full((len(self.regions), len(grid)), np.inf)  # b_s per region, inf: absent
            for pos, g in enumerate(self.regions):
                caps = np.asarray([c for c, _ in g.svlev[s]])
                vals = np.asarray([cost for _, cost in g.svlev[s]]) - ls * caps
                if lone:
                    vals = vals - lrows[pos] * np.minimum(caps, g.wa) - mu + g.zcost
                idx = np.searchsorted(caps, grid * (1 + TOL) + TOL, side="right") - 1
                pref = np.minimum.accumulate(vals)
                term[pos] = np.where(idx >= 0, pref[np.maximum(idx, 0)], np.inf)
                room = room + np.where(idx >= 0, caps[np.maximum(idx, 0)], 0.0)
            need = big_w + grid
            ok = room >= need - TOL * np.maximum(1.0, need)
            lins.append(np.where(ok, lin, np.inf))
            terms.append(term)
            parts.append(np.where(ok, lin + np.minimum(0.0, term).sum(axis=0), np.inf))
        const_sep = const + float(np.minimum(0.0, fixed).sum())
        order = [np.argsort(part, kind="stable") for part in parts]
        order = [o[part[o] < math.inf] for o, part in zip(order, parts, strict=True)]
        if any(not len(o) for o in order):
            return
        start = tuple(0 for _ in order)
        heap = [(const_sep + sum(float(parts[s][o[0]]) for s, o in enumerate(order)), start)]
        seen = {start}
        while heap:
            total, at_pos = heapq.heappop(heap)
            at = [int(order[s][i]) for s, i in enumerate(at_pos)]
            if lone:
                coupled = total
            else:
                inner = fixed.copy()
                for s, g_s in enumerate(at):
                    inner += terms[s][:, g_s]
                coupled = const + sum(float(lins[s][g_s]) for s, g_s in enumerate(at))
                coupled += float(np.minimum(0.0, inner).sum())
            yield total, coupled, tuple(cands[s][g_s] for s, g_s in enumerate(at))
            for s in range(n_sv):
                if at_pos[s] + 1 < len(order[s]):
                    nxt = (*at_pos[:s], at_pos[s] + 1, *at_pos[s + 1 :])
                    if nxt not in seen:
                        seen.add(nxt)
                        step = float(parts[s][order[s][at_pos[s] + 1]] - parts[s][order[s][at_pos[s]]])
                        heapq.heappush(heap, (total + step, nxt))

    def solve(self, budget: int) -> FastResult | None:
        """One run per declared vector of the survive members' largest region capacities, for
        the vectors whose Lagrangian bound is under the incumbent (a block without survive
        members is one run)."""
        regions = self.regions
        if not regions:
            return None
        n_sv, big_w = self.n_sv, self.big_w
        bases = sorted(g.lopts[0][1] + sum(lev[0][1] for lev in g.svlev) for g in regions)
        root = sum(bases[: self.m_need]) if len(bases) >= self.m_need else math.inf
        flow = 0.0
        for a in range(self.n_src):
            rho = min((g.rate_l for g in regions if g.smask >> a & 1), default=math.inf)
            flow += rho * self.ws[a]
        root = max(root, flow)
        self.best_cost: float = math.inf
        self.best_chosen: dict[int, list[int]] | None = None
        self.work = self.peak = self.n_runs = 0
        self.mults: list[list[float]] = []  # multipliers found so far: valid in every run
        unresolved = math.inf
        if not n_sv:
            unresolved = self.exact_run((), root, budget)
        else:
            cands = [sorted({c for g in regions for c, _ in g.svlev[s]}) for s in range(n_sv)]
            hard = math.prod(len(c) for c in cands) > FEW_DECLARATIONS
            # prices to order the declarations by: a survive unit at its cheapest rate, or,
            # with many declarations, the LP of the loosest one (every level, the least sum)
            lam0 = [0.0] * self.n_con + [min(g.rate_sv[s] for g in regions) for s in range(n_sv)] + [0.0]
            if hard:
                found = self.multipliers(
                    self.prepare(tuple(c[-1] for c in cands)), [big_w + c[0] for c in cands]
                )
                if found is not None:
                    lam0 = found
                    self.mults.append(lam0)
            order = self.screen(cands, lam0)
            probes = list(itertools.islice(order, PROBES))
            for _, _, mvec in probes:  # quick incumbents from the most promising declarations
                run = _Run(self, mvec)
                if hard:
                    lam = self.multipliers(run.regs, run.targets)
                    if lam is None:
                        continue
                    run.add_multipliers(lam)
                self._absorb(run.search_py(BEAM, self.best_cost, max(0, budget - self.work)))
            if self.best_chosen is None:  # the loosest caps: most likely to hold some placement
                run = _Run(self, tuple(c[-1] for c in cands))
                self._absorb(run.search_py(4 * BEAM, self.best_cost, max(0, budget - self.work)))
            for sep, coupled, mvec in itertools.chain(probes, order):
                sep = max(sep, root)  # no later declaration has a lower bound
                if sep >= _below(self.best_cost):
                    break
                if self.work > budget:
                    unresolved = min(unresolved, sep)
                    break
                if coupled >= _below(self.best_cost):
                    continue
                unresolved = min(unresolved, self.exact_run(mvec, max(sep, coupled), budget))
        if self.best_chosen is None:
            return None
        sol = self.solution(self.best_chosen)
        if sol is None:
            return None
        x, f = sol
        obj = self.objective(x)
        optimal = unresolved >= _below(self.best_cost)
        bound = obj if optimal else min(obj, unresolved)
        return FastResult(x, f, obj, bound, optimal, self.work, self.peak, self.n_runs)

    def exact_run(self, mvec: tuple[float, ...], lb: float, budget: int) -> float:
        """Search the run with these declared largest capacities (every placement it finds
        survives), updating the incumbent; returns a lower bound of the run's optimum if it
        was cut short, else inf. Small runs go in Python; one that outgrows that is priced by
        an LP and searched again in arrays."""
        run = _Run(self, mvec)
        self.work += len(run.regs)
        for known in self.mults[:1] + self.mults[1:][-RECENT_MULTS:]:
            self.work += len(run.regs)
            lb = max(lb, run.add_multipliers(known))
            if lb >= _below(self.best_cost):
                return math.inf
        if lb >= _below(self.best_cost):
            return math.inf
        self.n_runs += 1
        if self.best_chosen is None:
            self._absorb(run.search_py(BEAM, self.best_cost, max(0, budget - self.work)))
        out = run.search_py(0, self.best_cost, max(0, min(EASY_WORK, budget - self.work)))
        self._absorb(out)
        if out.left == math.inf or self.work >= budget:
            return out.left
        lam = self.multipliers(run.regs, run.targets)
        if lam is not None:
            self.mults.append(lam)
            if run.add_multipliers(lam) >= _below(self.best_cost):
                return math.inf
        search = run.search_np if run.np_data().multiplied else run.search_np_staged
        big = search(0, self.best_cost, NP_WORK_SCALE * (budget - self.work))
        big.work //= NP_WORK_SCALE
        self._absorb(big)
        return big.left

    def _absorb(self, out: _Outcome) -> None:
        self.work += out.work
        self.peak = max(self.peak, out.peak)
        if out.chosen is not None and out.cost < self.best_cost:
            self.best_cost, self.best_chosen = out.cost, out.chosen

    def solution(self, chosen: dict[int, list[int]]) -> tuple[dict[int, int], dict[int, float]] | None:
        inst, members = self.inst, self.members
        by_r = {g.r: g for g in self.regions}
        x: dict[int, int] = {}
        cap_of: dict[int, float] = {}
        for r, lv in chosen.items():
            g = by_r[r]
            caps = []
            for a, i in enumerate(members):
                counts = g.levels[a][lv[a]][2]
                c = 0.0
                for o, nrep in zip(g.oids[a], counts, strict=False):
                    if nrep:
                        x[o] = nrep
                        c += nrep * float(inst.usable[i] * inst.opt_qps[o])
                if self.k[a] > 0:
                    caps.append(c / float(self.k[a]))
            cap_of[r] = min(caps) if caps else 0.0
        f = _route(inst, self.block, self.src, self.ws, cap_of)
        if f is None:
            return None
        return x, f

    def objective(self, x: dict[int, int]) -> float:
        inst = self.inst
        obj = 0.0
        for o, nrep in x.items():
            p = float(inst.opt_cost[o] + inst.opt_units[o] * self.prices[inst.opt_r[o], inst.opt_h[o]])
            obj += p * nrep
            if self.use_churn:
                obj += self.churn * float(inst.opt_units[o]) * max(0.0, nrep - float(inst.opt_current[o]))
        return obj


class _Run:
    """One DP over the regions with the survive members' largest capacities declared (their
    levels capped, their sums due at W + M): states are (regions so far, Hall row coverage,
    survive sums), all truncated at what is due, pruned by bounds and dominance."""

    def __init__(self, blk: _Block, mvec: tuple[float, ...]) -> None:
        self.blk = blk
        self.mvec = mvec
        regs = blk.prepare(mvec)
        self.regs = regs
        self.targets = [blk.big_w + m for m in mvec]
        self.lag: list[tuple[list[float], list[float]]] = []
        self.ready = False
        self._np: _NpData | None = None

    def _suffixes(self) -> None:
        """Bounds on what the regions from j on can still add (computed once, when searched)."""
        if self.ready:
            return
        self.ready = True
        blk, regs = self.blk, self.regs
        n, n_con, n_sv, m_need = len(regs), blk.n_con, blk.n_sv, blk.m_need
        self.suf_base: list[list[float]] = []  # [j][need]: cheapest presence of `need` more regions
        self.suf_cap: list[list[float]] = []  # [j][row]: most routing capacity regions j.. add
        self.suf_svcap: list[list[float]] = []  # [j][member]: most survive capacity they add
        self.suf_order: list[list[tuple[int, float]]] = []  # sources, dearest cheapest route first
        for j in range(n + 1):
            rest = regs[j:]
            bases = sorted(x.base for x in rest)
            acc = [0.0]
            for need in range(1, m_need + 1):
                acc.append(acc[-1] + bases[need - 1] if need <= len(bases) else math.inf)
            self.suf_base.append(acc)
            self.suf_cap.append([sum(x.max_l for x in rest if x.g.cmask >> c & 1) for c in range(n_con)])
            self.suf_svcap.append([sum(x.sv_u[s] for x in rest) for s in range(n_sv)])
            rho = [
                min((x.g.rate_l for x in rest if x.g.smask >> a & 1), default=math.inf)
                for a in range(blk.n_src)
            ]
            self.suf_order.append(sorted(((a, rho[a]) for a in range(blk.n_src)), key=lambda t: -t[1]))
        self.knaps = [
            sorted((x.sv_unit[s], x.sv_u[s], pos) for pos, x in enumerate(regs)) for s in range(n_sv)
        ]

    def add_multipliers(self, lam: list[float]) -> float:
        """Use `lam` in the bounds; returns the bound it gives on the whole run."""
        term, value = self.blk.lagrangian(self.regs, lam, self.targets)
        self.lag.append(term)
        if self._np is not None:
            self._np.add_lag(self, term)
        return value

    # ---- the pure Python engine (small runs)
    def lower(self, key: Key, j: int, gap: float) -> float:
        """A lower bound on what regions j.. must still cost to complete `key` (returns as soon
        as it exceeds `gap`)."""
        blk = self.blk
        cov, cnt, ssum = key
        m_need, con_w, targets = blk.m_need, blk.con_w, self.targets
        lb = 0.0
        if cnt < m_need:
            lb = self.suf_base[j][m_need - cnt]
            if lb > gap:
                return lb
        capj = self.suf_cap[j]
        short = False
        for c in range(blk.n_con):
            d = con_w[c] - cov[c]
            if d > 0:
                short = True
                if capj[c] < d - TOL * max(1.0, con_w[c]):
                    return math.inf
        if blk.n_sv:
            tot = 0.0
            for s in range(blk.n_sv):
                d = targets[s] - ssum[s]
                if d > 0:
                    if self.suf_svcap[j][s] < d - TOL * max(1.0, targets[s]):
                        return math.inf
                    tot += _knap(self.knaps[s], d, j)
            if tot > lb:
                lb = tot
                if lb > gap:
                    return lb
        n_con = blk.n_con
        for lam, suf in self.lag:
            v = suf[j] + lam[-1] * (m_need - cnt)
            for c in range(n_con):
                v += lam[c] * (con_w[c] - cov[c])
            for s in range(blk.n_sv):
                v += lam[n_con + s] * (targets[s] - ssum[s])
            if v > lb:
                lb = v
                if lb > gap:
                    return lb
        if short:
            # Cheapest routing of what the regions so far cannot carry: the traffic they can
            # serve forms a polymatroid, so serving the dearest sources first is optimal.
            n_src, sub_w, ws = blk.n_src, blk.sub_w, blk.ws
            vals = [0.0] * (1 << n_src)
            for u in range(1, 1 << n_src):
                vals[u] = sum(cov[c] for c in blk.comp_rows[u])
            prefix = 0
            f_prev = 0.0
            flow_lb = 0.0
            for a, rho in self.suf_order[j]:
                prefix |= 1 << a
                best = sub_w[prefix]
                u = prefix
                while u:
                    v = sub_w[prefix & ~u] + vals[u]
                    if v < best:
                        best = v
                    u = (u - 1) & prefix
                rest = ws[a] - (best - f_prev)
                f_prev = best
                if rest > TOL * max(1.0, ws[a]):
                    if rho == math.inf:
                        return math.inf
                    flow_lb += rho * rest
            if flow_lb > lb:
                lb = flow_lb
        return lb

    def search_py(self, beam: int, incumbent: float, budget: int) -> _Outcome:
        self._suffixes()
        blk = self.blk
        con_w, n_con, n_sv, m_need, ns_tied = blk.con_w, blk.n_con, blk.n_sv, blk.m_need, blk.ns_tied
        targets = self.targets
        wtol = [c - TOL * max(1.0, c) for c in con_w]
        ttol = [t - TOL * max(1.0, t) for t in targets]

        def cover(cov: tuple[float, ...], ell: float, cmask: int) -> tuple[float, ...]:
            return tuple(
                (cov[c] + ell if cov[c] + ell < wtol[c] else con_w[c]) if cmask >> c & 1 else cov[c]
                for c in range(n_con)
            )

        best_cost, best_node = incumbent, None
        start: Key = (tuple(0.0 for _ in range(n_con)), 0, tuple(0.0 for _ in range(n_sv)))
        states: dict[Key, tuple[float, object]] = {start: (0.0, None)}
        work = 0
        peak = 1
        for j, rr in enumerate(self.regs):
            g = rr.g
            cut = _below(best_cost)
            mid: dict[tuple[Key, float], tuple[float, object]] = {}
            nxt: dict[Key, tuple[float, object]] = dict(states)
            cmask = g.cmask
            if ns_tied:
                # presence, routing level L and the members tied to it
                for key, (cost, node) in states.items():
                    cov, cnt, ssum = key
                    ncnt = min(cnt + 1, m_need)
                    for ell, lcost, li in rr.lopts:
                        c2 = cost + lcost
                        work += 1
                        if c2 >= cut:
                            break
                        nkey: Key = (cover(cov, ell, cmask) if ell > 0 else cov, ncnt, ssum)
                        if n_sv:
                            mk = (nkey, ell)
                            old = mid.get(mk)
                            if old is None or c2 < old[0]:
                                mid[mk] = (c2, (node, j, 0, li))
                        else:
                            old = nxt.get(nkey)
                            if old is None or c2 < old[0]:
                                nxt[nkey] = (c2, (node, j, 0, li))
            else:
                # no member tied to L: L is the least capacity of the survive members
                zc = rr.lopts[0][1]
                for key, (cost, node) in states.items():
                    cov, cnt, ssum = key
                    c2 = cost + zc
                    mk2 = ((cov, min(cnt + 1, m_need), ssum), math.inf)
                    old = mid.get(mk2)
                    if c2 < cut and (old is None or c2 < old[0]):
                        mid[mk2] = (c2, (node, j, 0, 0))
            # each survive member's level (at least L when L is set)
            for s in range(n_sv):
                lev = rr.svlev[s]
                mid2: dict[tuple[Key, float], tuple[float, object]] = {}
                last = s == n_sv - 1
                tgt, tgt_tol = targets[s], ttol[s]
                for (key, ell), (cost, node) in mid.items():
                    cov, cnt, ssum = key
                    have = ssum[s]
                    floor = ell - TOL * max(1.0, ell) if ns_tied else -1.0
                    for cap, lcost, q in _thinned(lev, floor, tgt - have) if beam else lev:
                        if cap < floor:
                            continue
                        c2 = cost + lcost
                        work += 1
                        if c2 >= cut:
                            break
                        if have >= tgt:
                            nsum = ssum
                        else:
                            v = have + cap
                            nsum = (*ssum[:s], tgt if v >= tgt_tol else v, *ssum[s + 1 :])
                        nell = ell if ns_tied else min(ell, cap)
                        if last:
                            if ns_tied:
                                nkey = (cov, cnt, nsum)
                            else:
                                ell2 = min(nell, g.wa)
                                nkey = (cover(cov, ell2, cmask) if ell2 > 0 else cov, cnt, nsum)
                            old = nxt.get(nkey)
                            if old is None or c2 < old[0]:
                                nxt[nkey] = (c2, (node, j, s + 1, q))
                        else:
                            mk3 = ((cov, cnt, nsum), nell)
                            old = mid2.get(mk3)
                            if old is None or c2 < old[0]:
                                mid2[mk3] = (c2, (node, j, s + 1, q))
                if beam and len(mid2) > 4 * beam:  # a heuristic search keeps the stages small too,
                    # ranked by cost and what the regions after this one would still cost once
                    # this one is finished at the members' largest levels
                    tops = [rr.svlev[s2][-1][0] for s2 in range(n_sv)]

                    def rank(
                        item: tuple[tuple[Key, float], tuple[float, object]],
                        j: int = j,
                        s: int = s,
                        tops: list[float] = tops,
                        g: _Region = g,
                    ) -> float:
                        (cov, cnt, ssum), ell = item[0]
                        full = tuple(
                            min(targets[s2], ssum[s2] + (tops[s2] if s2 > s else 0.0)) for s2 in range(n_sv)
                        )
                        if not ns_tied:
                            cov = cover(cov, min(ell, g.wa), g.cmask)
                        return item[1][0] + self.lower((cov, cnt, full), j + 1, math.inf)

                    mid2 = dict(sorted(mid2.items(), key=rank)[: 4 * beam])
                mid = mid2
                if work > budget:
                    break
            if work > budget:  # cut short: what is left is bounded from the last full layer
                left = min(
                    (cost + self.lower(key, j, math.inf) for key, (cost, _) in states.items()),
                    default=math.inf,
                )
                return _Outcome(best_cost, self._decode_py(best_node), work, peak, min(left, best_cost))
            scored = []
            for key, (cost, node) in nxt.items():
                cov, cnt, ssum = key
                if (
                    cnt >= m_need
                    and all(cov[c] >= con_w[c] for c in range(n_con))
                    and all(ssum[s] >= targets[s] for s in range(n_sv))
                ):
                    if cost < best_cost:
                        best_cost, best_node = cost, node
                    continue
                scored.append((cost, key, node))
            cut = _below(best_cost)
            kept_states = []
            for cost, key, node in scored:
                if cost >= cut:
                    continue
                lb = self.lower(key, j + 1, cut - cost)
                work += 1
                if cost + lb >= cut:
                    continue
                kept_states.append((cost + lb if beam else cost, cost, key, node))
            kept_states.sort(key=lambda t: t[0])
            keep = _nondominated([(t[2][1], *t[2][0], *t[2][2]) for t in kept_states])
            work += len(kept_states) + len(kept_states) ** 2 // 64
            states = {}
            for i in keep:
                _, cost, key, node = kept_states[i]
                states[key] = (cost, node)
                if beam and len(states) >= beam:
                    break
            peak = max(peak, len(states))
            if not states:
                break
        return _Outcome(best_cost, self._decode_py(best_node), work, peak, math.inf)

    def _decode_py(self, node: object) -> dict[int, list[int]] | None:
        """Region -> level index per member, from a node chain (None for no node)."""
        if node is None:
            return None
        blk = self.blk
        chosen: dict[int, list[int]] = {}
        while node is not None:
            parent, j, stage, idx = cast(tuple[object, int, int, int], node)
            g = self.regs[j].g
            lv = chosen.setdefault(g.r, [0] * len(blk.members))
            if stage == 0:
                for a, q in zip(blk.ns, g.lopts[idx][2], strict=True):
                    lv[a] = q
            else:
                lv[blk.sv[stage - 1]] = idx
            node = parent
        return chosen

    # ---- the numpy engine (large runs): the same DP, a layer at a time in arrays
    def np_data(self) -> _NpData:
        self._suffixes()
        if self._np is None:
            self._np = _NpData.build(self)
        return self._np

    def search_np(self, beam: int, incumbent: float, budget: int) -> _Outcome:
        data = self.np_data()
        top, top_tol = data.top, data.top_tol
        d = len(top)
        x = np.zeros((1, d))
        cost = np.zeros(1)
        layers: list[tuple[np.ndarray, np.ndarray]] = []
        best_cost = incumbent
        best_ref: tuple[int, int, int] | None = None
        work = 0
        peak = 1
        for j in range(len(self.regs)):
            add, add_cost = data.opt_add[j], data.opt_cost[j]
            n, m = len(cost), len(add_cost)
            y = np.concatenate([x, (x[:, None, :] + add[None, :, :]).reshape(n * m, d)])
            cy = np.concatenate([cost, (cost[:, None] + add_cost[None, :]).ravel()])
            par = np.concatenate([np.arange(n), np.repeat(np.arange(n), m)])
            opt = np.concatenate([np.full(n, -1), np.tile(np.arange(m), n)])
            work += n * m
            sel = cy < _below(best_cost)
            y, cy, par, opt = y[sel], cy[sel], par[sel], opt[sel]
            y = np.minimum(y, top)
            y = np.where(y >= top_tol, top, y)
            done = (y >= top).all(axis=1)
            if done.any():
                i = int(np.argmin(np.where(done, cy, np.inf)))
                if cy[i] < best_cost:
                    best_cost, best_ref = float(cy[i]), (j, int(par[i]), int(opt[i]))
                keep = ~done
                y, cy, par, opt = y[keep], cy[keep], par[keep], opt[keep]
            lb = data.lower(y, j + 1)
            sel = cy + lb < _below(best_cost)
            y, cy, par, opt, lb = y[sel], cy[sel], par[sel], opt[sel], lb[sel]
            order = np.argsort(cy + lb if beam else cy, kind="stable")
            y, cy, par, opt = y[order], cy[order], par[order], opt[order]
            first = _first_unique(y)
            y, cy, par, opt = y[first], cy[first], par[first], opt[first]
            keep_idx = _nondominated_np(y, beam)
            work += len(cy) + len(cy) ** 2 // 256
            x, cost = y[keep_idx], cy[keep_idx]
            layers.append((par[keep_idx], opt[keep_idx]))
            peak = max(peak, len(cost))
            if work > budget:
                left = float((cost + data.lower(x, j + 1)).min()) if len(cost) else math.inf
                return _Outcome(
                    best_cost, self._decode_np(best_ref, layers), work, peak, min(left, best_cost)
                )
            if not len(cost):
                break
        return _Outcome(best_cost, self._decode_np(best_ref, layers), work, peak, math.inf)

    def search_np_staged(self, beam: int, incumbent: float, budget: int) -> _Outcome:
        """The numpy engine for blocks with survive members: in a region, first the presence
        and routing level (members tied to it), then one member's level per stage, so that
        the members' levels are never multiplied out. Between stages a state carries the
        pending L (levels must reach it) or, with no member tied to L, the least capacity so
        far (the region's L once all are chosen)."""
        data = self.np_data()
        blk = self.blk
        n_con, n_sv, tied = blk.n_con, blk.n_sv, blk.ns_tied
        top, top_tol = data.top, data.top_tol
        d = len(top)
        x = np.zeros((1, d))
        cost = np.zeros(1)
        layers: list[tuple[np.ndarray, np.ndarray, list[tuple[np.ndarray, np.ndarray]]]] = []
        best_cost = incumbent
        best_ref: tuple[int, int, int] | None = None
        work = 0
        peak = 1

        def snap(y: np.ndarray) -> np.ndarray:
            y = np.minimum(y, top)
            return np.where(y >= top_tol, top, y)

        for j, rr in enumerate(self.regs):
            g = rr.g
            rowmask = data.rowmask[j]
            cut = _below(best_cost)
            n = len(cost)
            # stage 0: presence, and L with the members tied to it
            if tied:
                ells = np.asarray([lo[0] for lo in rr.lopts])
                lcs = np.asarray([lo[1] for lo in rr.lopts])
                m = len(ells)
                spar = np.repeat(np.arange(n), m)
                sch = np.tile(np.arange(m), n)
                z = x[spar].copy()
                z[:, 0] += 1.0
                z[:, 1 : 1 + n_con] += ells[sch][:, None] * rowmask[None, :]
                cz = cost[spar] + lcs[sch]
                extra = ells[sch]  # pending L
            else:
                spar = np.arange(n)
                sch = np.zeros(n, dtype=np.int64)
                z = x.copy()
                z[:, 0] += 1.0
                cz = cost + rr.lopts[0][1]
                extra = np.full(n, np.inf)  # least capacity so far
            z = snap(z)
            sel = cz < cut
            z, cz, extra, spar, sch = z[sel], cz[sel], extra[sel], spar[sel], sch[sel]
            work += n * len(rr.lopts)
            stages: list[tuple[np.ndarray, np.ndarray]] = [(spar, sch)]
            for s in range(n_sv):
                lev = rr.svlev[s]
                caps = np.asarray([lv[0] for lv in lev])
                lcs = np.asarray([lv[1] for lv in lev])
                qs = np.asarray([lv[2] for lv in lev], dtype=np.int64)
                nz, m = len(cz), len(caps)
                ii = np.repeat(np.arange(nz), m)
                qq = np.tile(np.arange(m), nz)
                if tied:
                    ok = caps[qq] >= extra[ii] - TOL * np.maximum(1.0, extra[ii])
                    ii, qq = ii[ok], qq[ok]
                z2 = z[ii].copy()
                z2[:, 1 + n_con + s] += caps[qq]
                cz2 = cz[ii] + lcs[qq]
                extra2 = extra[ii] if tied else np.minimum(extra[ii], caps[qq])
                work += nz * m
                last = s == n_sv - 1
                if last and not tied:
                    ell = np.minimum(extra2, g.wa)
                    z2[:, 1 : 1 + n_con] += ell[:, None] * rowmask[None, :]
                z2 = snap(z2)
                sel = cz2 < cut
                if sel.any():
                    # bounded by the regions after this one once it is finished: before that,
                    # finished for free at the members' largest levels (an optimistic state)
                    ahead = z2[sel]
                    if not last:
                        ahead = ahead.copy()
                        for s2 in range(s + 1, n_sv):
                            ahead[:, 1 + n_con + s2] += rr.svlev[s2][-1][0]
                        if not tied:
                            ell = np.minimum(extra2[sel], g.wa)
                            ahead[:, 1 : 1 + n_con] += ell[:, None] * rowmask[None, :]
                        ahead = snap(ahead)
                    lb = data.lower(ahead, j + 1)
                    sel[np.flatnonzero(sel)[cz2[sel] + lb >= cut]] = False
                z2, cz2, extra2, ii, qq = z2[sel], cz2[sel], extra2[sel], ii[sel], qq[sel]
                order = np.argsort(cz2, kind="stable")
                z2, cz2, extra2, ii, qq = z2[order], cz2[order], extra2[order], ii[order], qq[order]
                if last:
                    key = z2
                else:  # more routing is better; a lower pending L is better
                    key = np.hstack([z2, (-extra2 if tied else extra2)[:, None]])
                first = _first_unique(key)
                key, z2, cz2, extra2, ii, qq = (
                    key[first],
                    z2[first],
                    cz2[first],
                    extra2[first],
                    ii[first],
                    qq[first],
                )
                keep = _nondominated_np(key, 0)
                work += len(cz2) + len(cz2) ** 2 // 256
                z, cz, extra = z2[keep], cz2[keep], extra2[keep]
                stages.append((ii[keep], qs[qq[keep]]))
            # the layer: regions left out, and those placed
            y = np.concatenate([x, z])
            cy = np.concatenate([cost, cz])
            par = np.concatenate([np.arange(n), np.full(len(cz), -1)])
            kind = np.concatenate([np.full(n, -1), np.arange(len(cz))])
            done = (y >= top).all(axis=1)
            if done.any():
                i = int(np.argmin(np.where(done, cy, np.inf)))
                if cy[i] < best_cost:
                    best_cost, best_ref = float(cy[i]), (j, int(kind[i]), int(par[i]))
                left_open = np.logical_not(done)
                y, cy, par, kind = y[left_open], cy[left_open], par[left_open], kind[left_open]
            lb = data.lower(y, j + 1)
            sel = cy + lb < _below(best_cost)
            y, cy, par, kind, lb = y[sel], cy[sel], par[sel], kind[sel], lb[sel]
            order = np.argsort(cy + lb if beam else cy, kind="stable")
            y, cy, par, kind = y[order], cy[order], par[order], kind[order]
            first = _first_unique(y)
            y, cy, par, kind = y[first], cy[first], par[first], kind[first]
            keep = _nondominated_np(y, beam)
            work += len(cy) + len(cy) ** 2 // 256
            x, cost = y[keep], cy[keep]
            layers.append((par[keep], kind[keep], stages))
            peak = max(peak, len(cost))
            if work > budget:
                left = float((cost + data.lower(x, j + 1)).min()) if len(cost) else math.inf
                return _Outcome(
                    best_cost, self._decode_staged(best_ref, layers), work, peak, min(left, best_cost)
                )
            if not len(cost):
                break
        return _Outcome(best_cost, self._decode_staged(best_ref, layers), work, peak, math.inf)

    def _decode_staged(
        self,
        ref: tuple[int, int, int] | None,
        layers: list[tuple[np.ndarray, np.ndarray, list[tuple[np.ndarray, np.ndarray]]]],
    ) -> dict[int, list[int]] | None:
        if ref is None:
            return None
        blk = self.blk
        chosen: dict[int, list[int]] = {}
        j, kind, par = ref
        while True:
            if kind >= 0:  # placed in region j: its stages, last to first
                stages = layers[j][2]
                g = self.regs[j].g
                lv = [0] * len(blk.members)
                k = kind
                for s in range(blk.n_sv, 0, -1):
                    spar, sch = stages[s]
                    lv[blk.sv[s - 1]] = int(sch[k])
                    k = int(spar[k])
                spar, sch = stages[0]
                li = self.regs[j].lopts[int(sch[k])][2] if blk.ns_tied else 0
                for a, q in zip(blk.ns, g.lopts[li][2], strict=True):
                    lv[a] = q
                chosen[g.r] = lv
                par = int(spar[k])
            if j == 0:
                break
            p_arr, k_arr, _ = layers[j - 1]
            kind, par = int(k_arr[par]), int(p_arr[par])
            j -= 1
        return chosen

    def _decode_np(
        self, ref: tuple[int, int, int] | None, layers: list[tuple[np.ndarray, np.ndarray]]
    ) -> dict[int, list[int]] | None:
        if ref is None:
            return None
        assert self._np is not None
        meta = self._np.opt_meta
        chosen: dict[int, list[int]] = {}
        j, p, o = ref
        while True:
            if o >= 0:
                chosen[self.regs[j].g.r] = list(meta[j][o])
            if j == 0:
                break
            par, opt = layers[j - 1]
            p, o = int(par[p]), int(opt[p])
            j -= 1
        return chosen


@dataclass
class _Outcome:
    cost: float  # best found under the incumbent given (or that incumbent)
    chosen: dict[int, list[int]] | None  # its levels, None if nothing beat the incumbent
    work: int
    peak: int
    left: float  # lower bound of the run's optimum if cut short, else inf


class _NpData:
    """A run's region options and suffix bounds as arrays."""

    top: np.ndarray  # what each state component is due: [regions, rows..., survive sums...]
    top_tol: np.ndarray
    opt_add: list[np.ndarray]  # per region: (options, components) contributions
    opt_cost: list[np.ndarray]
    opt_meta: list[list[tuple[int, ...]]]  # per region and option: level index per member
    rowmask: list[np.ndarray]  # per region: 1 on the Hall rows it counts in
    multiplied: bool  # options multiplied out (else survive members are searched in stages)
    n_con: int
    n_sv: int
    n_src: int
    cnt_tab: np.ndarray  # [j, regions so far]: cheapest presence of the regions still due
    row_cap: np.ndarray  # [j, row]: most routing capacity regions j.. add
    row_w: np.ndarray
    sv_cap: np.ndarray
    knap_pts: list[list[tuple[np.ndarray, np.ndarray]]]  # [j][member]: knapsack bound breakpoints
    sub: np.ndarray  # (rows, source subsets): rows summed in each subset's capacity
    flow: list[list[tuple[np.ndarray, np.ndarray, float, float]]]  # [j]: per source prefix, its cuts
    lag_vecs: list[tuple[np.ndarray, np.ndarray]]  # (multipliers, suffix sums of region terms)

    @classmethod
    def build(cls, run: _Run) -> _NpData:
        blk = run.blk
        self = cls()
        n_con, n_sv, n_mem = blk.n_con, blk.n_sv, len(blk.members)
        self.n_con, self.n_sv = n_con, n_sv
        top = np.asarray([float(blk.m_need), *blk.con_w, *run.targets])
        self.top = top
        self.top_tol = top - TOL * np.maximum(1.0, top)
        self.opt_add, self.opt_cost, self.opt_meta, self.rowmask = [], [], [], []
        self.multiplied = all(
            sum(math.prod(len(lev) for lev in rr.svlev) for _ in rr.lopts) <= MAX_OPTIONS for rr in run.regs
        )
        for rr in run.regs:
            g = rr.g
            rowmask = np.asarray([1.0 if g.cmask >> c & 1 else 0.0 for c in range(n_con)])
            self.rowmask.append(rowmask)
            if not self.multiplied:
                continue
            # every option of the region: L with the members tied to it and each survive
            # member's level (at least L), or with no member tied to L, the survive members'
            # levels with L their least capacity
            adds: list[list[float]] = []
            costs: list[float] = []
            metas: list[tuple[int, ...]] = []
            for ell0, lcost, li in rr.lopts:
                floor = ell0 - TOL * max(1.0, ell0) if blk.ns_tied else -1.0
                per = [[lv for lv in lev if lv[0] >= floor] for lev in rr.svlev]
                for pick in itertools.product(*per):
                    caps = [p[0] for p in pick]
                    ell = ell0 if blk.ns_tied else min(min(caps), g.wa)
                    adds.append([1.0, *(ell * rowmask), *caps])
                    costs.append(lcost + sum(p[1] for p in pick))
                    lv = [0] * n_mem
                    for a, q in zip(blk.ns, g.lopts[li][2], strict=True):
                        lv[a] = q
                    for a, p in zip(blk.sv, pick, strict=True):
                        lv[a] = p[2]
                    metas.append(tuple(lv))
            add = np.asarray(adds, dtype=np.float64).reshape(len(adds), 1 + n_con + n_sv)
            cst = np.asarray(costs)
            order = np.argsort(cst, kind="stable")
            keep = order[_nondominated_np(add[order], 0)]
            self.opt_add.append(add[keep])
            self.opt_cost.append(cst[keep])
            self.opt_meta.append([metas[int(i)] for i in keep])
        # suffix bounds
        n = len(run.regs)
        self.cnt_tab = np.asarray(
            [
                [run.suf_base[j][blk.m_need - c] if c < blk.m_need else 0.0 for c in range(blk.m_need + 1)]
                for j in range(n + 1)
            ]
        )
        self.row_cap = np.asarray(run.suf_cap).reshape(n + 1, n_con)
        self.row_w = np.asarray(blk.con_w)
        self.sv_cap = np.asarray(run.suf_svcap).reshape(n + 1, n_sv)
        self.knap_pts = []
        for j in range(n + 1):
            pts = []
            for s in range(n_sv):
                xs, ys = [0.0], [0.0]
                for unit, size, pos in run.knaps[s]:
                    if pos >= j:
                        xs.append(xs[-1] + size)
                        ys.append(ys[-1] + unit * size)
                pts.append((np.asarray(xs), np.asarray(ys)))
            self.knap_pts.append(pts)
        # the flow bound: subset sums of row coverage, and per suffix the prefixes' cuts
        n_src = blk.n_src
        self.n_src = n_src
        sub = np.zeros((n_con, 1 << n_src))
        for u in range(1, 1 << n_src):
            for c in blk.comp_rows[u]:
                sub[c, u] += 1.0
        self.sub = sub
        self.flow = []
        for j in range(n + 1):
            steps = []
            prefix = 0
            for a, rho in run.suf_order[j]:
                prefix |= 1 << a
                us = [u for u in range(1 << n_src) if u & prefix == u]
                consts = [blk.sub_w[prefix & ~u] for u in us]
                steps.append((np.asarray(us), np.asarray(consts), blk.ws[a], rho))
            self.flow.append(steps)
        self.lag_vecs = []
        for term in run.lag:
            self.add_lag(run, term)
        return self

    def add_lag(self, run: _Run, term: tuple[list[float], list[float]]) -> None:
        lam, suf = term
        n_con = self.n_con
        vec = np.asarray([lam[-1], *lam[:n_con], *lam[n_con:-1]])
        self.lag_vecs.append((vec, np.asarray(suf)))

    def lower(self, y: np.ndarray, j: int) -> np.ndarray:
        """Lower bounds (as in _Run.lower) on what regions j.. must still cost, per state."""
        n = len(y)
        if not n:
            return np.zeros(0)
        n_con, n_sv = self.n_con, self.n_sv
        deficit = self.top[None, :] - y
        lb = self.cnt_tab[j][y[:, 0].astype(np.int64)]
        bad = np.zeros(n, dtype=bool)
        if n_con:
            rd = deficit[:, 1 : 1 + n_con]
            bad |= (rd > self.row_cap[j][None, :] + TOL * np.maximum(1.0, self.row_w)[None, :]).any(axis=1)
        if n_sv:
            tot = np.zeros(n)
            for s in range(n_sv):
                ds = deficit[:, 1 + n_con + s]
                xs, ys = self.knap_pts[j][s]
                bad |= ds > xs[-1] + TOL * max(1.0, float(self.top[1 + n_con + s]))
                tot += np.interp(ds, xs, ys)
            lb = np.maximum(lb, tot)
        for vec, suf in self.lag_vecs:
            lb = np.maximum(lb, suf[j] + deficit @ vec)
        if n_con:
            vals = y[:, 1 : 1 + n_con] @ self.sub
            f_prev = np.zeros(n)
            flow = np.zeros(n)
            for us, consts, w_a, rho in self.flow[j]:
                f = (vals[:, us] + consts[None, :]).min(axis=1)
                rest = w_a - (f - f_prev)
                f_prev = f
                short = rest > TOL * max(1.0, w_a)
                if rho == math.inf:
                    bad |= short
                else:
                    flow += np.where(short, rho * rest, 0.0)
            lb = np.maximum(lb, flow)
        return np.where(bad, np.inf, lb)


def solve_block_fast(
    inst: Instance, block: int, prices: np.ndarray, churn: float, *, budget: int = WORK_BUDGET
) -> FastResult | None:
    blk = _Block(inst, block, prices, churn)
    if not blk.ok:
        return None
    return blk.solve(budget)


def _route(
    inst: Instance, block: int, src: list[int], ws: list[float], cap_of: dict[int, float]
) -> dict[int, float] | None:
    """Fractions routing every source within the regions' capacities (max flow, augmenting paths)."""
    routes = inst.routes_of[block]
    if not src:
        return {}
    regs = sorted(cap_of)
    r_idx = {r: j for j, r in enumerate(regs)}
    s_idx = {s: j for j, s in enumerate(src)}
    ns, nr = len(src), len(regs)
    flow = [[0.0] * nr for _ in range(ns)]
    edge = [[-1] * nr for _ in range(ns)]
    for t in routes:
        r = int(inst.route_r[t])
        if r in r_idx:
            edge[s_idx[int(inst.route_s[t])]][r_idx[r]] = int(t)
    left_s = list(ws)
    left_r = [cap_of[r] for r in regs]
    total = sum(ws)
    eps = 1e-12 * max(1.0, total)
    while True:
        prev_s: list[int] = [-2] * ns
        prev_r: list[int] = [-2] * nr
        queue: list[tuple[bool, int]] = []
        for a in range(ns):
            if left_s[a] > eps:
                prev_s[a] = -1
                queue.append((True, a))
        end = -1
        qi = 0
        while qi < len(queue) and end < 0:
            is_s, v = queue[qi]
            qi += 1
            if is_s:
                for b in range(nr):
                    if edge[v][b] >= 0 and prev_r[b] == -2:
                        prev_r[b] = v
                        if left_r[b] > eps:
                            end = b
                            break
                        queue.append((False, b))
            else:
                for a in range(ns):
                    if flow[a][v] > eps and prev_s[a] == -2:
                        prev_s[a] = v
                        queue.append((True, a))
        if end < 0:
            break
        path = []
        b = end
        amt = left_r[end]
        while True:
            a = prev_r[b]
            path.append((a, b))
            if prev_s[a] == -1:
                amt = min(amt, left_s[a])
                break
            b2 = prev_s[a]
            amt = min(amt, flow[a][b2])
            path.append((a, -b2 - 1))
            b = b2
        for a, b in path:
            if b >= 0:
                flow[a][b] += amt
            else:
                flow[a][-b - 1] -= amt
        left_r[end] -= amt
        left_s[path[-1][0]] -= amt
    if any(left_s[a] > 1e-9 * max(1.0, ws[a]) for a in range(ns)):
        return None
    f: dict[int, float] = {}
    for a in range(ns):
        row = sum(flow[a])
        for b in range(nr):
            if flow[a][b] > 0:
                f[edge[a][b]] = flow[a][b] / row
    return f
