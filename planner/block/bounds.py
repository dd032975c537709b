"""The Lagrangian side of the block search: a run's regions under its declared largest
capacities, their options and exact region terms under row prices, and the order in which
the declarations are searched (by a bound separable over the survive members)."""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ipnext.planner.block.common import TOL
from ipnext.planner.block.structure import Block, Region

# (multipliers, suffix sums of the region terms under them)
LagTerm = tuple[list[float], list[float]]


@dataclass
class RunRegion:
    """A region under a run's declared largest capacities (survive levels capped)."""

    g: Region
    lopts: list[tuple[float, float, int]]  # (L, cost, index in g.lopts)
    svlev: list[list[tuple[float, float, int]]]  # per survive member: (capacity, cost, level)
    base: float  # cheapest presence
    max_l: float  # most routing capacity
    sv_u: list[float]  # per survive member: most capacity
    sv_unit: list[float]  # per survive member: slope of the convex envelope of its cost


def prepare(blk: Block, mvec: tuple[float, ...]) -> list[RunRegion]:
    """The regions of the run with these declared largest capacities (those where every
    survive member has a level under its declaration), cheapest routing first."""
    out = []
    for g in blk.regions:
        svl = []
        for s, m in enumerate(mvec):
            lim = m + TOL * max(1.0, m)
            lev = [(c, cost, q) for q, (c, cost) in enumerate(g.svlev[s]) if c <= lim]
            if not lev:
                break
            svl.append(lev)
        if len(svl) < len(mvec):
            continue
        # the most each survive member can route here: its top level less its spare
        routes = [lev[-1][0] - spare for lev, spare in zip(svl, g.sv_spare, strict=True)]
        if blk.ns_tied:
            top = min(routes, default=math.inf)
            top += TOL * max(1.0, top)
            lo = [(ell, cost, li) for li, (ell, cost, _) in enumerate(g.lopts) if ell <= top]
            max_l = lo[-1][0]
        else:
            lo = [(0.0, g.zcost, 0)]
            max_l = min(max(0.0, min(routes)), g.wa)
        sv_u = [lev[-1][0] for lev in svl]
        out.append(
            RunRegion(
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


def options_of(blk: Block, rr: RunRegion) -> list[tuple[float, float, list[float]]]:
    """Explicit (cost, L, survive capacities) options of a region, enough to price its rows:
    each L with every survive member's cheapest level at least L (or, with no member tied
    to L, each threshold t with every survive member's cheapest level at least t)."""
    out = []
    spares = rr.g.sv_spare
    if blk.ns_tied:
        for ell, lcost, _ in rr.lopts:
            cost, caps = _cheapest_from(rr.svlev, ell - TOL * max(1.0, ell), lcost, spares)
            if len(caps) == len(rr.svlev):
                out.append((cost, ell, caps))
        if rr.svlev:
            top = [lev[-1] for lev in rr.svlev]
            out.append((rr.lopts[0][1] + sum(t[1] for t in top), rr.lopts[0][0], [t[0] for t in top]))
    else:
        zc = rr.lopts[0][1]
        for t in _thresholds(rr.svlev, spares):
            cost, caps = _cheapest_from(rr.svlev, t - TOL * max(1.0, t), zc, spares)
            if len(caps) < len(rr.svlev):
                break
            out.append((cost, _routed(caps, spares, rr.g.wa), caps))
        top = [lev[-1] for lev in rr.svlev]
        caps = [t[0] for t in top]
        out.append((zc + sum(t[1] for t in top), _routed(caps, spares, rr.g.wa), caps))
    return out


def _thresholds(svlev: list[list[tuple[float, float, int]]], spares: list[float]) -> list[float]:
    """The routing capacities the survive members' levels give (capacity less the spare)."""
    pairs = zip(svlev, spares, strict=True)
    return sorted({max(0.0, cap - spare) for lev, spare in pairs for cap, _, _ in lev})


def _routed(caps: list[float], spares: list[float], wa: float) -> float:
    """What a region routes with the survive members at these capacities and no member tied to
    L: the least of their routing capacities, at most its traffic."""
    return min(max(0.0, min(c - spare for c, spare in zip(caps, spares, strict=True))), wa)


def _cheapest_from(
    svlev: list[list[tuple[float, float, int]]], floor: float, cost: float, spares: list[float]
) -> tuple[float, list[float]]:
    """`cost` plus each survive member's cheapest level that routes at least `floor` (its
    capacity less its spare), and the capacities of those levels (fewer than the members when
    some member has none)."""
    caps = []
    for lev, spare in zip(svlev, spares, strict=True):
        for cap, c, _q in lev:
            if cap >= floor + spare:
                cost += c
                caps.append(cap)
                break
    return cost, caps


def region_term(blk: Block, rr: RunRegion, lam: list[float]) -> float:
    """min(0, least cost - lam . contribution over the region's options): exact over every
    combination of levels (per L, or per threshold, the survive members are independent)."""
    n_con = blk.n_con
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
    spares = rr.g.sv_spare
    if blk.ns_tied:
        for ell, lcost, _ in rr.lopts:
            v = _plus_suffixes(sufs, ell - TOL * max(1.0, ell), lcost - lrow * ell - mu, spares)
            best = min(best, v)
    else:
        zc = rr.lopts[0][1]
        for t in _thresholds(rr.svlev, spares):
            v = _plus_suffixes(sufs, t - TOL * max(1.0, t), zc - lrow * min(t, rr.g.wa) - mu, spares)
            if v == math.inf:
                break
            best = min(best, v)
    return best


def _plus_suffixes(
    sufs: list[tuple[list[float], list[float]]], floor: float, v: float, spares: list[float]
) -> float:
    """`v` plus each survive member's least term over its levels that route at least `floor`
    (capacity less its spare; inf when some member has none)."""
    for (caps, vals), spare in zip(sufs, spares, strict=True):
        q = bisect_left(caps, floor + spare)
        v = v + vals[q] if q < len(caps) else math.inf
    return v


def lagrangian(
    blk: Block, regs: list[RunRegion], lam: list[float], targets: list[float]
) -> tuple[LagTerm, float]:
    """Suffix sums of the region terms under `lam`, and the bound it gives at the start."""
    suf = [0.0] * (len(regs) + 1)
    for j in range(len(regs) - 1, -1, -1):
        suf[j] = suf[j + 1] + region_term(blk, regs[j], lam)
    root = suf[0] + lam[-1] * blk.m_need
    root += sum(lam[c] * blk.con_w[c] for c in range(blk.n_con))
    root += sum(lam[blk.n_con + s] * targets[s] for s in range(blk.n_sv))
    return (lam, suf), root


def screen(
    blk: Block, cands: list[list[float]], lam: list[float]
) -> Iterator[tuple[float, float, tuple[float, ...]]]:
    """Declared vectors under `lam`, in increasing order of a Lagrangian bound separable
    over the survive members (region terms min(0, a + sum b_s) >= min(0, a) + sum
    min(0, b_s)), each with the coupled bound sum over regions of min(0, a + sum b_s)
    (for a lone member both are the exact Lagrangian bound). Declarations under which
    the regions cannot hold W + M are left out."""
    n_con, n_sv, big_w = blk.n_con, blk.n_sv, blk.big_w
    mu = lam[-1]
    const = mu * blk.m_need + sum(lam[c] * blk.con_w[c] for c in range(n_con))
    lone = not blk.ns_tied and len(blk.members) == 1
    lrows = [sum(lam[c] for c in range(n_con) if g.cmask >> c & 1) for g in blk.regions]
    if lone:
        fixed = np.zeros(len(blk.regions))
    elif blk.ns_tied:
        fixed = np.asarray(
            [
                min(lc - lr * ell for ell, lc, _ in g.lopts) - mu
                for g, lr in zip(blk.regions, lrows, strict=True)
            ]
        )
    else:
        fixed = np.asarray([g.zcost - lr * g.wa - mu for g, lr in zip(blk.regions, lrows, strict=True)])
    parts, lins, terms = [], [], []
    for s in range(n_sv):
        grid = np.asarray(cands[s])
        ls = lam[n_con + s]
        lin = ls * (big_w + grid)
        room = np.zeros(len(grid))  # most capacity the regions hold under each declaration
        term = np.full((len(blk.regions), len(grid)), np.inf)  # b_s per region, inf: absent
        for pos, g in enumerate(blk.regions):
            caps = np.asarray([c for c, _ in g.svlev[s]])
            vals = np.asarray([cost for _, cost in g.svlev[s]]) - ls * caps
            if lone:
                routed = np.minimum(np.maximum(caps - g.sv_spare[s], 0.0), g.wa)
                vals = vals - lrows[pos] * routed - mu + g.zcost
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
