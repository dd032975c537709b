"""What a pricing round carries over from earlier ones: the answers of blocks no price change
can affect (Reuse), and bounds proven at lower prices for blocks it did not reach (Rounds)."""

from __future__ import annotations

import math

import numpy as np

from ipnext.planner.instance import Instance
from ipnext.planner.pricing import BlockChoice, price_of

__all__ = ["Reuse", "Rounds"]


class Reuse:
    """Which blocks a pricing round must solve again. A block's last answer stays its answer
    when, since it was found, no price changed on a pool the answer uses and no price fell
    on any pool the block may use: the answer's priced value is the same, every other
    placement's has not fallen, and its bound is still valid. Exact, and it skips most blocks
    of a round when only a few pools are priced (a fleet's congested pools)."""

    def __init__(self, inst: Instance, choices: dict[int, BlockChoice], prices: np.ndarray) -> None:
        self.inst = inst
        h = inst.pool_units.shape[1]
        self.block_pools = [
            np.unique(
                np.concatenate(
                    [inst.opt_r[inst.options_of[i]] * h + inst.opt_h[inst.options_of[i]] for i in members]
                )
            )
            for members in inst.blocks
        ]
        self.last: dict[int, BlockChoice] = {}
        self.used: dict[int, np.ndarray] = {}
        self.at: dict[int, np.ndarray] = {}
        self.update(choices, prices)

    def update(self, solved: dict[int, BlockChoice], prices: np.ndarray) -> None:
        h = self.inst.pool_units.shape[1]
        flat = prices.ravel().copy()
        for b, c in solved.items():
            self.last[b] = c
            self.used[b] = np.fromiter(
                (int(self.inst.opt_r[o]) * h + int(self.inst.opt_h[o]) for o in c.x), dtype=np.int64
            )
            self.at[b] = flat

    def stale(self, prices: np.ndarray) -> list[int]:
        flat = prices.ravel()
        out = []
        for b, pools in enumerate(self.block_pools):
            seen = self.at[b]
            used = self.used[b]
            if (np.abs(flat[used] - seen[used]) > 1e-12).any() or (flat[pools] < seen[pools] - 1e-12).any():
                out.append(b)
        return out

    def unchanged(self, stale: list[int]) -> dict[int, BlockChoice]:
        skip = set(stale)
        return {b: c for b, c in self.last.items() if b not in skip}


class Rounds:
    """The block bounds of every pricing round, to bound a block a later round did not reach.

    A block's priced optimum never falls when prices rise (every placement costs at least as
    much), so a bound proven at prices p' stays valid at any prices p >= p'; the first round
    (zero prices, or the LP's) is below nearly every later one on most pools."""

    def __init__(self, inst: Instance) -> None:
        self.inst = inst
        self.history: list[tuple[np.ndarray, dict[int, float]]] = []

    def add(self, prices: np.ndarray, solved: dict[int, BlockChoice]) -> None:
        self.history.append((prices.copy(), {b: c.bound for b, c in solved.items()}))

    def complete(
        self, solved: dict[int, BlockChoice], prices: np.ndarray, earlier: dict[int, BlockChoice]
    ) -> dict[int, BlockChoice]:
        """`solved`, plus each block it lacks with its earlier placement re-priced at `prices`;
        every block's bound is the best still valid there (minus infinity when none is)."""
        inst = self.inst
        valid = [bounds for seen, bounds in self.history if (seen <= prices + 1e-12).all()]
        out: dict[int, BlockChoice] = {}
        for b, c in earlier.items():
            carried = max((v[b] for v in valid if b in v), default=-math.inf)
            if b in solved:
                c = solved[b]
                out[b] = BlockChoice(b, c.x, c.f, c.priced, min(max(c.bound, carried), c.priced), c.cost)
                continue
            at_prices = c.cost + price_of(inst, c.x, prices)
            out[b] = BlockChoice(b, c.x, c.f, at_prices, min(carried, at_prices), c.cost)
        return out
