"""One DP run over a block's regions with the survive members' largest capacities declared,
and its search in plain Python (small runs and the beam searches for incumbents); the array
engine (arrays.py) searches the runs that outgrow it."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable
from typing import cast

import numpy as np

from ipnext.planner.block.bounds import LagTerm, lagrangian, prepare
from ipnext.planner.block.common import TOL, Chosen, Key, Outcome, below
from ipnext.planner.block.dominance import nondominated
from ipnext.planner.block.structure import Block, Region


class Run:
    """One DP over the regions with the survive members' largest capacities declared (their
    levels capped, their sums due at W + M): states are (regions so far, Hall row coverage,
    survive sums), all truncated at what is due, pruned by bounds and dominance."""

    def __init__(self, blk: Block, mvec: tuple[float, ...]) -> None:
        self.blk = blk
        self.mvec = mvec
        regs = prepare(blk, mvec)
        self.regs = regs
        self.targets = [blk.big_w + m for m in mvec]
        self.lag: list[LagTerm] = []
        self.ready = False
        # Told of each multiplier added after them (the array engine keeps its arrays current).
        self.lag_listeners: list[Callable[[LagTerm], None]] = []

    def suffixes(self) -> None:
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
        term, value = lagrangian(self.blk, self.regs, lam, self.targets)
        self.lag.append(term)
        for listener in self.lag_listeners:
            listener(term)
        return value

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

    def search_py(self, beam: int, incumbent: float, budget: int) -> Outcome:
        """The DP in plain Python, a region at a time (with `beam`, a heuristic search that
        keeps that many states a layer, ranked by cost and bound)."""
        self.suffixes()
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
            cut = below(best_cost)
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
                spare = g.sv_spare[s]  # a level routes its capacity less this
                mid2: dict[tuple[Key, float], tuple[float, object]] = {}
                last = s == n_sv - 1
                tgt, tgt_tol = targets[s], ttol[s]
                for (key, ell), (cost, node) in mid.items():
                    cov, cnt, ssum = key
                    have = ssum[s]
                    floor = ell + spare - TOL * max(1.0, ell) if ns_tied else -1.0
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
                        nell = ell if ns_tied else min(ell, max(0.0, cap - spare))
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
                        g: Region = g,
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
                return Outcome(best_cost, self._decode(best_node), work, peak, min(left, best_cost))
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
            cut = below(best_cost)
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
            keep = nondominated([(t[2][1], *t[2][0], *t[2][2]) for t in kept_states])
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
        return Outcome(best_cost, self._decode(best_node), work, peak, math.inf)

    def _decode(self, node: object) -> Chosen | None:
        """Region -> level index per member, from a node chain (None for no node)."""
        if node is None:
            return None
        blk = self.blk
        chosen: Chosen = {}
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
