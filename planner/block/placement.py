"""From the levels the search chose to the block's placement: replicas per option, routing
fractions by max flow within the regions' capacities, and the priced objective."""

from __future__ import annotations

from ipnext.planner.block.common import Chosen
from ipnext.planner.block.structure import Block
from ipnext.planner.instance import Instance


def placement(blk: Block, chosen: Chosen) -> tuple[dict[int, int], dict[int, float]] | None:
    """Replicas per option and fractions per route of the chosen levels (None if the traffic
    cannot be routed within their capacities)."""
    inst, members = blk.inst, blk.members
    by_r = {g.r: g for g in blk.regions}
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
            if blk.k[a] > 0:  # what it routes: its capacity less its spare
                caps.append(max(0.0, c - float(inst.spare[i, r])) / float(blk.k[a]))
        cap_of[r] = min(caps) if caps else 0.0
    f = _route(inst, blk.block, blk.src, blk.ws, cap_of)
    if f is None:
        return None
    return x, f


def objective(blk: Block, x: dict[int, int]) -> float:
    """The placement's cost at the block's pool prices, with churn when it is priced."""
    inst = blk.inst
    obj = 0.0
    for o, nrep in x.items():
        p = float(inst.opt_cost[o] + inst.opt_units[o] * blk.prices[inst.opt_r[o], inst.opt_h[o]])
        obj += p * nrep
        if blk.use_churn:
            obj += blk.churn * float(inst.opt_units[o]) * max(0.0, nrep - float(inst.opt_current[o]))
    return obj


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
