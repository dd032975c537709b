"""The array engine for large runs: the same DP as the Python search, a layer of states at a
time in numpy arrays, with the run's options and suffix bounds as arrays (NpData)."""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ipnext.planner.block.bounds import LagTerm
from ipnext.planner.block.common import MAX_OPTIONS, TOL, Chosen, Outcome, below
from ipnext.planner.block.dominance import dominance_work, first_unique, nondominated_np
from ipnext.planner.block.run import Run

# What a region adds to the states: (candidate states, their costs, two tags per state that
# name where it came from, what the layer keeps to decode them, work done); None when making
# them would take more work than the room it was given.
Expansion = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Any, int] | None
# A layer as kept: the tags of its states and what the expansion kept.
Layer = tuple[np.ndarray, np.ndarray, Any]
Ref = tuple[int, int, int]  # (region, tags) of the best finished state
# Records the levels a state took in region j (given its tags and what the layer kept) and
# returns the index of its parent state in the layer before.
Visit = Callable[[Chosen, int, int, int, Any], int]


class NpData:
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
    def build(cls, run: Run) -> NpData:
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
                # a survive member's level routes its capacity less its spare
                per = [
                    [lv for lv in lev if lv[0] >= floor + spare]
                    for lev, spare in zip(rr.svlev, g.sv_spare, strict=True)
                ]
                for pick in itertools.product(*per):
                    caps = [p[0] for p in pick]
                    if blk.ns_tied:
                        ell = ell0
                    else:
                        routes = [c - spare for c, spare in zip(caps, g.sv_spare, strict=True)]
                        ell = min(max(0.0, min(routes)), g.wa)
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
            keep = order[nondominated_np(add[order], 0)]
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
            self.add_lag(term)
        return self

    def add_lag(self, term: LagTerm) -> None:
        lam, suf = term
        n_con = self.n_con
        vec = np.asarray([lam[-1], *lam[:n_con], *lam[n_con:-1]])
        self.lag_vecs.append((vec, np.asarray(suf)))

    def lower(self, y: np.ndarray, j: int) -> np.ndarray:
        """Lower bounds (as in Run.lower) on what regions j.. must still cost, per state."""
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

    def snap(self, y: np.ndarray) -> np.ndarray:
        """States truncated at what is due (within the tolerance, exactly what is due)."""
        y = np.minimum(y, self.top)
        return np.where(y >= self.top_tol, self.top, y)


_BUILT: weakref.WeakKeyDictionary[Run, NpData] = weakref.WeakKeyDictionary()


def np_data(run: Run) -> NpData:
    """`run` as arrays, for the array engine: built once per run, then told of each multiplier
    the run adds after (`Run.lag_listeners`)."""
    found = _BUILT.get(run)
    if found is None:
        run.suffixes()
        found = _BUILT[run] = NpData.build(run)
        run.lag_listeners.append(found.add_lag)
    return found


def search_arrays(run: Run, beam: int, incumbent: float, budget: int) -> Outcome:
    """The run searched in arrays: with the regions' options multiplied out when they are few
    enough, else a survive member at a time."""
    if np_data(run).multiplied:
        return _search_options(run, beam, incumbent, budget)
    return _search_staged(run, beam, incumbent, budget)


def _search_layers(
    run: Run,
    beam: int,
    incumbent: float,
    budget: int,
    expand: Callable[[int, np.ndarray, np.ndarray, float, int], Expansion],
    visit: Visit,
) -> Outcome:
    """The DP a region at a time: `expand` gives the states region j makes of the layer's
    (with those that leave it out); the finished ones update the incumbent, the others are
    pruned by bound and dominance. Each step is checked against the budget before it runs,
    not after: one layer can hold hundreds of thousands of states, and a search that stops
    there returns the least bound of the states it holds."""
    data = np_data(run)
    top = data.top
    x = np.zeros((1, len(top)))
    cost = np.zeros(1)
    layers: list[Layer] = []
    best_cost = incumbent
    best_ref: Ref | None = None
    work = 0
    peak = 1

    def cut_short(left: float) -> Outcome:  # the best so far, and the least bound of what is left
        return Outcome(best_cost, _decode(best_ref, layers, visit), work, peak, min(left, best_cost))

    for j in range(len(run.regs)):
        grown = expand(j, x, cost, best_cost, budget - work)
        if grown is None:
            return cut_short(float((cost + data.lower(x, j)).min()) if len(cost) else math.inf)
        y, cy, tag_a, tag_b, kept, spent = grown
        work += spent
        done = (y >= top).all(axis=1)
        if done.any():
            i = int(np.argmin(np.where(done, cy, np.inf)))
            if cy[i] < best_cost:
                best_cost, best_ref = float(cy[i]), (j, int(tag_a[i]), int(tag_b[i]))
            left_open = np.logical_not(done)
            y, cy, tag_a, tag_b = y[left_open], cy[left_open], tag_a[left_open], tag_b[left_open]
        lb = data.lower(y, j + 1)
        sel = cy + lb < below(best_cost)
        y, cy, tag_a, tag_b, lb = y[sel], cy[sel], tag_a[sel], tag_b[sel], lb[sel]
        order = np.argsort(cy + lb if beam else cy, kind="stable")
        y, cy, tag_a, tag_b, lb = y[order], cy[order], tag_a[order], tag_b[order], lb[order]
        first = first_unique(y)
        y, cy, tag_a, tag_b, lb = y[first], cy[first], tag_a[first], tag_b[first], lb[first]
        if work + len(cy) + dominance_work(len(cy)) > budget:
            # bounded by the states the dominance check would have thinned (a state it drops
            # is never the cheaper way)
            layers.append((tag_a[:0], tag_b[:0], kept))  # what decoding a state of j reads
            return cut_short(float((cy + lb).min()) if len(cy) else math.inf)
        keep = nondominated_np(y, beam)
        work += len(cy) + dominance_work(len(cy))
        x, cost = y[keep], cy[keep]
        layers.append((tag_a[keep], tag_b[keep], kept))
        peak = max(peak, len(cost))
        if work > budget:
            return cut_short(float((cost + data.lower(x, j + 1)).min()) if len(cost) else math.inf)
        if not len(cost):
            break
    return Outcome(best_cost, _decode(best_ref, layers, visit), work, peak, math.inf)


def _decode(ref: Ref | None, layers: list[Layer], visit: Visit) -> Chosen | None:
    """Region -> level index per member of the state `ref` names (None for none), walking
    back through its parents."""
    if ref is None:
        return None
    chosen: Chosen = {}
    j, tag_a, tag_b = ref
    while True:
        parent = visit(chosen, j, tag_a, tag_b, layers[j][2])
        if j == 0:
            break
        tags_a, tags_b, _ = layers[j - 1]
        tag_a, tag_b = int(tags_a[parent]), int(tags_b[parent])
        j -= 1
    return chosen


def _search_options(run: Run, beam: int, incumbent: float, budget: int) -> Outcome:
    """Each state of a layer, left out of region j or with each of the region's options.
    A state's tags: its parent, and the option (-1: left out)."""
    data = np_data(run)

    def expand(j: int, x: np.ndarray, cost: np.ndarray, best_cost: float, room: int) -> Expansion:
        add, add_cost = data.opt_add[j], data.opt_cost[j]
        n, m, d = len(cost), len(add_cost), x.shape[1]
        if n * m > room:
            return None
        y = np.concatenate([x, (x[:, None, :] + add[None, :, :]).reshape(n * m, d)])
        cy = np.concatenate([cost, (cost[:, None] + add_cost[None, :]).ravel()])
        par = np.concatenate([np.arange(n), np.repeat(np.arange(n), m)])
        opt = np.concatenate([np.full(n, -1), np.tile(np.arange(m), n)])
        sel = cy < below(best_cost)
        return data.snap(y[sel]), cy[sel], par[sel], opt[sel], None, n * m

    def visit(chosen: Chosen, j: int, par: int, opt: int, _: None) -> int:
        if opt >= 0:
            chosen[run.regs[j].g.r] = list(data.opt_meta[j][opt])
        return par

    return _search_layers(run, beam, incumbent, budget, expand, visit)


def _search_staged(run: Run, beam: int, incumbent: float, budget: int) -> Outcome:
    """The array engine for blocks with survive members: in a region, first the presence
    and routing level (members tied to it), then one member's level per stage, so that
    the members' levels are never multiplied out. Between stages a state carries the
    pending L (levels must reach it) or, with no member tied to L, the least capacity so
    far (the region's L once all are chosen). A state's tags: its state among the region's
    placed ones (-1: left out), and its parent in the layer before (-1: placed)."""
    data = np_data(run)
    blk = run.blk
    n_con, n_sv, tied = blk.n_con, blk.n_sv, blk.ns_tied
    snap = data.snap

    def expand(j: int, x: np.ndarray, cost: np.ndarray, best_cost: float, room: int) -> Expansion:
        rr = run.regs[j]
        g = rr.g
        rowmask = data.rowmask[j]
        cut = below(best_cost)
        n = len(cost)
        if n * len(rr.lopts) > room:
            return None
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
        work = n * len(rr.lopts)
        stages: list[tuple[np.ndarray, np.ndarray]] = [(spar, sch)]
        for s in range(n_sv):
            lev = rr.svlev[s]
            caps = np.asarray([lv[0] for lv in lev])
            routes = np.maximum(caps - g.sv_spare[s], 0.0)  # what each level routes
            lcs = np.asarray([lv[1] for lv in lev])
            qs = np.asarray([lv[2] for lv in lev], dtype=np.int64)
            nz, m = len(cz), len(caps)
            if work + nz * m > room:
                return None
            ii = np.repeat(np.arange(nz), m)
            qq = np.tile(np.arange(m), nz)
            if tied:
                ok = routes[qq] >= extra[ii] - TOL * np.maximum(1.0, extra[ii])
                ii, qq = ii[ok], qq[ok]
            z2 = z[ii].copy()
            z2[:, 1 + n_con + s] += caps[qq]
            cz2 = cz[ii] + lcs[qq]
            extra2 = extra[ii] if tied else np.minimum(extra[ii], routes[qq])
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
            first = first_unique(key)
            key, z2, cz2, extra2, ii, qq = (
                key[first],
                z2[first],
                cz2[first],
                extra2[first],
                ii[first],
                qq[first],
            )
            if work + len(cz2) + dominance_work(len(cz2)) > room:
                return None
            keep = nondominated_np(key, 0)
            work += len(cz2) + dominance_work(len(cz2))
            z, cz, extra = z2[keep], cz2[keep], extra2[keep]
            stages.append((ii[keep], qs[qq[keep]]))
        # the layer: regions left out, and those placed
        y = np.concatenate([x, z])
        cy = np.concatenate([cost, cz])
        kind = np.concatenate([np.full(n, -1), np.arange(len(cz))])
        par = np.concatenate([np.arange(n), np.full(len(cz), -1)])
        return y, cy, kind, par, stages, work

    def visit(
        chosen: Chosen, j: int, kind: int, par: int, stages: list[tuple[np.ndarray, np.ndarray]]
    ) -> int:
        if kind < 0:
            return par
        # placed in region j: its stages, last to first
        g = run.regs[j].g
        lv = [0] * len(blk.members)
        k = kind
        for s in range(blk.n_sv, 0, -1):
            spar, sch = stages[s]
            lv[blk.sv[s - 1]] = int(sch[k])
            k = int(spar[k])
        spar, sch = stages[0]
        li = run.regs[j].lopts[int(sch[k])][2] if blk.ns_tied else 0
        for a, q in zip(blk.ns, g.lopts[li][2], strict=True):
            lv[a] = q
        chosen[g.r] = lv
        return int(spar[k])

    return _search_layers(run, beam, incumbent, budget, expand, visit)
