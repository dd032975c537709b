"""Train the request-oriented ranker on a synthetic world and write a snapshot folder.

    python -m ipnext.examples.request_ranker.train --root .ipnext/snapshots --model feed-ranking --version v1

The world (fixed by its seed) has users and items with hidden taste factors; items belong to
categories and carry dense features; a user's history is 256 items drawn by taste, and a click
on a candidate happens with probability sigmoid(3 <user, item> - 1). Training is request-shaped
too: each step takes a few users with many candidates each, so the user tower runs once per
user, as in serving. The snapshot holds the parts `embed` (the tables; or `embed-shard0` ..
`embed-shard<k-1>`, one hashed shard each, with `--shards k`) and `dense`.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ipnext import Manifest, write_snapshot
from ipnext.examples.request_ranker.model import RankingConfig, RankingModel
from ipnext.examples.request_ranker.parts import table_shard_weights

__all__ = ["SMALL_CONFIG", "TrainReport", "World", "shard_parts", "train"]

# A world small enough to train in seconds in tests; the bench uses RankingConfig's defaults.
SMALL_CONFIG: dict[str, Any] = {"num_users": 300, "num_items": 2000, "num_categories": 16}
_FACTORS = 8
_SEGMENTS = ("new", "casual", "premium")


class World:
    """The synthetic users and items every version learns, and requests drawn from them."""

    def __init__(self, config: RankingConfig, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        c = config
        self.config = c
        self.users = torch.randn(c.num_users, _FACTORS, generator=g) / _FACTORS**0.5
        centers = torch.randn(c.num_categories, _FACTORS, generator=g) / _FACTORS**0.5
        self.item_category = torch.randint(0, c.num_categories, (c.num_items,), generator=g)
        self.items = (
            centers[self.item_category]
            + 0.5 * torch.randn(c.num_items, _FACTORS, generator=g) / _FACTORS**0.5
        )
        self.item_features = self.items @ torch.randn(
            _FACTORS, c.item_features, generator=g
        ) + 0.1 * torch.randn(c.num_items, c.item_features, generator=g)
        self.user_features = self.users @ torch.randn(
            _FACTORS, c.user_features, generator=g
        ) + 0.1 * torch.randn(c.num_users, c.user_features, generator=g)
        self._seed = seed

    def history(self, user: int) -> torch.Tensor:
        """The user's latest seq_len events: items drawn by taste (fixed per user)."""
        g = torch.Generator().manual_seed(self._seed * 1_000_003 + user)
        taste = (self.items @ self.users[user]) * 4
        return torch.multinomial(taste.softmax(0), self.config.seq_len, replacement=True, generator=g)

    def click_probability(self, user: int, items: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(3 * (self.items[items] @ self.users[user]) * _FACTORS**0.5 - 1)

    def request(self, rng: random.Random, candidates: int, *, segment: str | None = None) -> dict[str, Any]:
        """A serving request of one random user with `candidates` random candidates."""
        user = rng.randrange(self.config.num_users)
        return {
            "user": {
                "id": user,
                "features": [round(v, 5) for v in self.user_features[user].tolist()],
                "history": self.history(user).tolist(),
                "segment": segment or _SEGMENTS[user % len(_SEGMENTS)],
            },
            "candidates": [rng.randrange(self.config.num_items) for _ in range(candidates)],
        }


@dataclass
class TrainReport:
    manifest: Manifest
    folder: Path
    logloss: float
    base_logloss: float
    seconds: float
    model: RankingModel


def shard_parts(model: RankingModel, shards: int) -> dict[str, dict[str, torch.Tensor]]:
    """The table weights as snapshot parts: `embed`, or `embed-shard<i>` for each of `shards`."""
    if shards == 1:
        return {"embed": table_shard_weights(model, 0, 1)}
    return {f"embed-shard{i}": table_shard_weights(model, i, shards) for i in range(shards)}


def train(
    root: Path,
    model: str,
    version: str,
    *,
    seed: int = 1,
    steps: int = 60,
    users_per_step: int = 8,
    candidates_per_user: int = 32,
    config: dict[str, Any] | None = None,
    shards: int = 1,
) -> TrainReport:
    started = time.perf_counter()
    sizes = RankingConfig.from_config(dict(SMALL_CONFIG if config is None else config))
    world = World(sizes)
    torch.manual_seed(seed)
    net = RankingModel(sizes)
    with torch.no_grad():
        net.item_category.copy_(world.item_category)
        net.item_features.copy_(world.item_features)
    histories = torch.stack([world.history(u) for u in range(sizes.num_users)])
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    loss_fn = nn.BCELoss()

    def batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        users = torch.randint(0, sizes.num_users, (users_per_step,), generator=generator)
        items = torch.randint(0, sizes.num_items, (users_per_step, candidates_per_user), generator=generator)
        clicks = torch.stack(
            [
                torch.bernoulli(world.click_probability(int(u), i), generator=generator)
                for u, i in zip(users, items, strict=True)
            ]
        )
        return users, items, clicks

    def scores(users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        state = net.user_tower(
            net.lookup_users(users),
            net.lookup_items(histories[users].reshape(-1)).view(len(users), sizes.seq_len, -1),
            world.user_features[users],
        )
        return torch.stack(
            [net.score_candidates(state, row, net.lookup_items(items[row])) for row in range(len(users))]
        )

    for _ in range(steps):
        users, items, clicks = batch(g)
        loss = loss_fn(scores(users, items), clicks)
        opt.zero_grad()
        loss.backward()
        opt.step()
    held = torch.Generator().manual_seed(seed + 10_000)
    with torch.no_grad():
        users, items, clicks = batch(held)
        for _ in range(3):
            more = batch(held)
            users, items, clicks = (
                torch.cat([users, more[0]]),
                torch.cat([items, more[1]]),
                torch.cat([clicks, more[2]]),
            )
        logloss = float(loss_fn(scores(users, items), clicks))
        rate = clicks.mean().clamp(1e-6, 1 - 1e-6)
        base = float(-(clicks * rate.log() + (1 - clicks) * (1 - rate).log()).mean())
    net.eval()
    folder = root / model / version
    manifest = write_snapshot(
        folder, model, version, {**shard_parts(net, shards), "dense": net.dense_weights()}
    )
    return TrainReport(manifest, folder, logloss, base, time.perf_counter() - started, net)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="snapshot root (one of snapshot_roots)")
    parser.add_argument("--model", default="feed-ranking")
    parser.add_argument("--version", required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--shards", type=int, default=1, help="split the tables into this many hashed shards")
    args = parser.parse_args()
    report = train(args.root, args.model, args.version, seed=args.seed, steps=args.steps, shards=args.shards)
    print(
        f"trained {args.model} {args.version} in {report.seconds:.1f}s: held-out logloss "
        f"{report.logloss:.4f} (click-rate baseline {report.base_logloss:.4f}) -> {report.folder}"
    )


if __name__ == "__main__":
    main()
