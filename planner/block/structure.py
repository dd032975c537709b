"""A block's data for the search, built whole by `build_block`: its proportional demand, the
Hall rows of its routing, and per region the members' Pareto levels and the options they make
(or None, with the reason logged, for a block the search does not handle)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from ipnext.planner.block.common import TOL, Level
from ipnext.planner.instance import Instance

log = logging.getLogger(__name__)

MAX_SOURCES = 8  # Hall rows are subsets of the sources: 2^8 of them at most

RoutingLevel = tuple[float, float, tuple[int, ...]]  # (L, cost of the members tied to L, their levels)


@dataclass
class Region:
    r: int
    wa: float  # traffic of the sources routed to it
    smask: int  # those sources
    cmask: int  # Hall rows its routing capacity counts in
    oids: list[list[int]]  # per member: option ids, aligned with the counts of its levels
    levels: list[list[Level]]  # per member
    lopts: list[RoutingLevel]
    svlev: list[list[tuple[float, float]]]  # per survive member: (capacity, cost)
    # per survive member: its spare here (its levels' capacity counts whole in the survive sums,
    # less this in routing); the other members' levels are net of their spare already
    sv_spare: list[float]
    zcost: float  # presence of the members without demand
    rate_l: float  # cost per unit of routing capacity, at least
    rate_sv: list[float]  # per survive member: cost per unit of its capacity, at least


@dataclass(frozen=True, eq=False)
class Block:
    """A block's data for the search: proportional demand (member a's is k[a] times the
    traffic vector w, whose total is big_w), Hall rows, and the candidate regions."""

    inst: Instance
    block: int
    prices: np.ndarray
    churn: float
    use_churn: bool  # churn is priced (a current plan exists)
    members: list[int]
    k: np.ndarray  # per member: its demand over w
    big_w: float
    src: list[int]  # traffic sources
    ws: list[float]  # their traffic
    n_src: int
    m_need: int  # min_regions
    sub_w: list[float]  # per source subset: its traffic
    comp_rows: list[list[int]]  # per source subset: the Hall rows of its connected parts
    con_w: list[float]  # per Hall row: the traffic it covers
    n_con: int
    sv: list[int]  # members that must survive a region loss (with demand)
    ns: list[int]  # the other members with demand: tied to the region's routing level L
    n_sv: int
    ns_tied: bool  # some member is tied to L (else L is the survive members' least capacity)
    regions: list[Region]


@dataclass
class _HallRows:
    sub_w: list[float]  # per source subset: its traffic
    comp_rows: list[list[int]]  # per source subset: the rows of its connected parts
    con_w: list[float]  # per row: the traffic it covers
    con_n: list[int]  # per row: the regions its sources reach (bitmask)


def build_block(
    inst: Instance, block: int, prices: np.ndarray, churn: float, caps: dict[int, int] | None = None
) -> Block | None:
    """The block's data at these pool prices, or None for a block the search does not handle
    (members whose demand is not proportional, more than MAX_SOURCES traffic sources, an
    option with no capacity or a negative price). `caps` (per option, optional) bounds the
    replicas of each option below what its pool holds: an option capped at 0 is left out, and
    a region where a member has no option left is no candidate."""
    members = [int(i) for i in inst.blocks[block]]
    n_mem = len(members)
    dem = inst.demand[members]
    tot = dem.sum(axis=1)
    big_w = float(tot.max())
    if big_w > 0:
        w = dem[int(np.argmax(tot))]
        k = tot / big_w
        if np.abs(dem - k[:, None] * w[None, :]).max() > TOL * big_w:
            log.debug("block %d is left to the MIP: its members' demand is not proportional", block)
            return None
    else:
        w = np.zeros(dem.shape[1])
        k = np.zeros(n_mem)
    n_regions = len(inst.regions)
    routes = inst.routes_of[block]
    src = sorted({int(s) for s in inst.route_s[routes]})
    if any(w[s] <= 0 for s in src) or len(src) > MAX_SOURCES or (big_w > 0 and not src):
        log.debug(
            "block %d is left to the MIP: %d traffic sources (at most %d, each with traffic)",
            block,
            len(src),
            MAX_SOURCES,
        )
        return None
    s_index = {s: j for j, s in enumerate(src)}
    reach = [0] * n_regions  # region -> bitmask of sources routed to it
    for t in routes:
        reach[int(inst.route_r[t])] |= 1 << s_index[int(inst.route_s[t])]
    ws = [float(w[s]) for s in src]
    n_src = len(src)
    hall = _hall_rows(reach, ws)
    n_con = len(hall.con_w)

    opts_at: list[dict[int, list[int]]] = []
    for i in members:
        by_r: dict[int, list[int]] = {}
        for o in inst.options_of[i]:
            if caps is None or caps[o] >= 1:
                by_r.setdefault(int(inst.opt_r[o]), []).append(int(o))
        opts_at.append(by_r)
    cand_regions = [r for r in range(n_regions) if all(r in by_r for by_r in opts_at)]

    use_churn = churn > 0 and inst.problem.current is not None
    mplus = [a for a in range(n_mem) if k[a] > 0]
    sv = [a for a in mplus if inst.survive[members[a]]]
    ns = [a for a in mplus if not inst.survive[members[a]]]
    zero = [a for a in range(n_mem) if k[a] <= 0]
    ns_tied = bool(ns) or not sv

    regions: list[Region] = []
    for r in cand_regions:
        wa = sum(ws[j] for j in range(n_src) if reach[r] >> j & 1)
        lv: list[list[Level]] = []
        rates: list[float] = []
        oids: list[list[int]] = []
        sv_spare: list[float] = []
        for a, i in enumerate(members):
            olist = opts_at[a][r]
            oids.append(olist)
            data = []
            rate = math.inf
            # the spare in the member's capacity units (those of its demand, k[a] w)
            spare = float(inst.spare[i, r])
            spare_n = spare / float(k[a]) if k[a] > 0 else spare
            for o in olist:
                p = float(inst.opt_cost[o] + inst.opt_units[o] * prices[r, inst.opt_h[o]])
                q = float(inst.usable[i] * inst.opt_qps[o])
                if q <= 0 or p < 0:
                    log.debug(
                        "block %d is left to the MIP: option %d has capacity %g at price %g", block, o, q, p
                    )
                    return None
                qn = q / float(k[a]) if k[a] > 0 else (q if spare > 0 else 1.0)
                cap = inst.opt_cap[o] if caps is None else min(inst.opt_cap[o], caps[o])
                ub = int(min(cap, max(inst.opt_enough[o], 1)))
                cur = float(inst.opt_current[o]) if use_churn else 0.0
                cu = churn * float(inst.opt_units[o]) if use_churn else 0.0
                data.append((qn, [p * n + cu * max(0.0, n - cur) for n in range(ub + 1)]))
                rate = min(rate, p / qn)
            limit = 0.0 if k[a] <= 0 else (big_w if a in sv else wa)
            levels = _levels(data, limit + spare_n)
            if spare > 0:
                levels = _spared(levels, spare_n, keep_whole=a in sv)
                if not levels:
                    break  # no level holds the spare here: no candidate region
            if a in sv:
                sv_spare.append(spare_n)
            lv.append(levels)
            rates.append(rate if k[a] > 0 else 0.0)
        if len(lv) < n_mem:
            continue
        zcost = sum((lv[a][0][1] for a in zero), 0.0)
        lopts: list[RoutingLevel] = [(0.0, zcost, ())]
        if ns_tied and mplus:
            lopts = _routing_levels(lv, wa, zcost, mplus, ns, sv, sv_spare)
        regions.append(
            Region(
                r=r,
                wa=wa,
                smask=reach[r],
                cmask=sum(1 << c for c in range(n_con) if hall.con_n[c] >> r & 1),
                oids=oids,
                levels=lv,
                lopts=lopts,
                svlev=[[(c, cost) for c, cost, _ in lv[a]] for a in sv],
                sv_spare=sv_spare,
                zcost=zcost,
                rate_l=sum(rates[a] for a in mplus),
                rate_sv=[rates[a] for a in sv],
            )
        )
    return Block(
        inst=inst,
        block=block,
        prices=prices,
        churn=churn,
        use_churn=use_churn,
        members=members,
        k=k,
        big_w=big_w,
        src=src,
        ws=ws,
        n_src=n_src,
        m_need=int(inst.min_regions[block]),
        sub_w=hall.sub_w,
        comp_rows=hall.comp_rows,
        con_w=hall.con_w,
        n_con=n_con,
        sv=sv,
        ns=ns,
        n_sv=len(sv),
        ns_tied=ns_tied,
        regions=regions,
    )


def _hall_rows(reach: list[int], ws: list[float]) -> _HallRows:
    """For each closed, connected set T of sources, a row: the routing capacity of the regions
    reachable from T covers the traffic of T (`reach`: per region, the sources routed to it)."""
    n_src = len(ws)
    nmask = [0] * n_src
    for r, sources in enumerate(reach):
        for j in range(n_src):
            if sources >> j & 1:
                nmask[j] |= 1 << r
    sub_n = [0] * (1 << n_src)
    sub_w = [0.0] * (1 << n_src)
    for u in range(1, 1 << n_src):
        low = (u & -u).bit_length() - 1
        sub_n[u] = sub_n[u & (u - 1)] | nmask[low]
        sub_w[u] = sub_w[u & (u - 1)] + ws[low]

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
    return _HallRows(sub_w, comp_rows, [sub_w[c] for c in row_sets], [sub_n[c] for c in row_sets])


def _routing_levels(
    lv: list[list[Level]],
    wa: float,
    zcost: float,
    mplus: list[int],
    ns: list[int],
    sv: list[int],
    sv_spare: list[float],
) -> list[RoutingLevel]:
    """A region's routing levels L, each with the cheapest levels of the members tied to it
    (those at least L), up to the least top routing capacity of the survive members."""
    lopts: list[RoutingLevel] = []
    spare_of = dict(zip(sv, sv_spare, strict=True))
    lset = sorted({min(max(0.0, c - spare_of.get(a, 0.0)), wa) for a in mplus for c, _, _ in lv[a]})
    svtop = min((lv[a][-1][0] - spare_of[a] for a in sv), default=math.inf)
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
    return lopts


def _spared(levels: list[Level], spare: float, keep_whole: bool) -> list[Level]:
    """The levels that hold `spare` beside what they route: the others are no placement. A
    survive member's keep their whole capacity (the survive sums count it; routing takes the
    spare off), the other members' are net of the spare (all they are used for is routing)."""
    floor = spare - TOL * max(1.0, spare)
    if keep_whole:
        return [lev for lev in levels if lev[0] >= floor]
    return [(max(0.0, c - spare), cost, x) for c, cost, x in levels if c >= floor]


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
