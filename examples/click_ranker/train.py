"""Train the demo ranker on synthetic click data and write a snapshot folder.

    python -m ipnext.examples.click_ranker.train --root .ipnext/snapshots --model feed-ranker --version v1

Clicks come from hidden user and item factors: P(click) = sigmoid(4 u.v - 1). The
trainer fits embeddings and the MLP jointly for a few seconds and writes the two
parts' weights as safetensors plus the manifest (see ipnext.store.snapshots). With
`--dense-parts small=16,large=128` it trains one MLP per named part (of that hidden size)
on the shared embeddings and writes each as its own part, for model-variants.yaml.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ipnext import Manifest, write_snapshot
from ipnext.examples.click_ranker.parts import build_modules

__all__ = ["DEFAULT_CONFIG", "TrainReport", "favourite", "parse_dense_parts", "train"]

DEFAULT_CONFIG: dict[str, Any] = {"num_users": 200, "num_items": 500, "dim": 16, "hidden": 32}
_FACTORS = 8


class TrainReport:
    def __init__(
        self,
        manifest: Manifest,
        folder: Path,
        logloss: float,
        base_logloss: float,
        seconds: float,
        loglosses: dict[str, float] | None = None,
    ) -> None:
        self.manifest = manifest
        self.folder = folder
        self.logloss = logloss  # the first MLP part's
        self.base_logloss = base_logloss
        self.seconds = seconds
        self.loglosses = loglosses or {}  # MLP part -> held-out logloss


def _world(config: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden user and item factors. Fixed (seed 0) so every version learns the same world."""
    world = torch.Generator().manual_seed(0)
    users_f = torch.randn(config["num_users"], _FACTORS, generator=world) / _FACTORS**0.5
    items_f = torch.randn(config["num_items"], _FACTORS, generator=world) / _FACTORS**0.5
    return users_f, items_f


def favourite(user: int, items: list[int], config: dict[str, Any] | None = None) -> int:
    """The item of `items` this user is likeliest to click (the world's truth, not a model's)."""
    users_f, items_f = _world(dict(config or DEFAULT_CONFIG))
    affinity = (users_f[user] * items_f[torch.tensor(items)]).sum(-1)
    return items[int(affinity.argmax())]


def _clicks(
    config: dict[str, Any], n: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    users_f, items_f = _world(config)
    users = torch.randint(0, config["num_users"], (n,), generator=generator)
    items = torch.randint(0, config["num_items"], (n,), generator=generator)
    p = torch.sigmoid(4 * (users_f[users] * items_f[items]).sum(-1) * _FACTORS**0.5 - 1)
    clicks = torch.bernoulli(p, generator=generator)
    return users, items, clicks


def train(
    root: Path,
    model: str,
    version: str,
    *,
    seed: int = 1,
    steps: int = 300,
    batch: int = 512,
    config: dict[str, Any] | None = None,
    dense_parts: dict[str, int] | None = None,
) -> TrainReport:
    """`dense_parts` (part name -> hidden size) trains one MLP part each on the shared
    embeddings; by default one part `dense` of the config's hidden size."""
    config = dict(config or DEFAULT_CONFIG)
    started = time.perf_counter()
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    heads = dense_parts or {"dense": int(config.get("hidden", 32))}
    rankers = {name: build_modules({**config, "hidden": hidden}) for name, hidden in heads.items()}
    modules = next(iter(rankers.values()))
    for ranker in rankers.values():  # one pair of embedding tables, shared by every MLP
        ranker.user, ranker.item = modules.user, modules.item
    parameters = list({id(p): p for r in rankers.values() for p in r.parameters()}.values())
    users, items, clicks = _clicks(config, steps * batch, generator)
    opt = torch.optim.Adam(parameters, lr=0.03)
    loss_fn = nn.BCEWithLogitsLoss()
    for step in range(steps):
        sl = slice(step * batch, (step + 1) * batch)
        u, i = modules.embed(users[sl], items[sl])
        loss = sum((loss_fn(r.score(u, i), clicks[sl]) for r in rankers.values()), torch.tensor(0.0))
        opt.zero_grad()
        loss.backward()
        opt.step()
    held_u, held_i, held_c = _clicks(config, 20_000, torch.Generator().manual_seed(seed + 10_000))
    with torch.no_grad():
        u, i = modules.embed(held_u, held_i)
        loglosses = {name: float(loss_fn(r.score(u, i), held_c)) for name, r in rankers.items()}
        rate = held_c.mean().clamp(1e-6, 1 - 1e-6)
        base = float(-(held_c * rate.log() + (1 - held_c) * (1 - rate).log()).mean())
    state = modules.state_dict()
    folder = root / model / version
    weights = {"embed": {k: v for k, v in state.items() if k.startswith(("user.", "item."))}}
    for name, ranker in rankers.items():
        weights[name] = {k: v for k, v in ranker.state_dict().items() if k.startswith("mlp.")}
    manifest = write_snapshot(folder, model, version, weights)
    logloss = next(iter(loglosses.values()))
    return TrainReport(manifest, folder, logloss, base, time.perf_counter() - started, loglosses)


def parse_dense_parts(text: str) -> dict[str, int]:
    """`small=16,large=128` -> {"small": 16, "large": 128}."""
    parts: dict[str, int] = {}
    for item in text.split(","):
        name, _, hidden = item.partition("=")
        if not name or not hidden.isdigit() or int(hidden) < 1:
            raise argparse.ArgumentTypeError(
                f"--dense-parts: {item!r} is not name=hidden_size, e.g. small=16"
            )
        parts[name.strip()] = int(hidden)
    return parts


def poisoned_copy(root: Path, model: str, version: str, good: Path) -> Path:
    """A bad snapshot for rollout drills, bad deterministically: `good`'s weights with every even
    user's embedding set to NaN, so those requests score NaN (a failed request) and odd users
    still answer. Returns its folder under `root`."""
    from safetensors.torch import load_file

    embed = load_file(str(good / "embed.safetensors"))
    embed["user.weight"][0::2] = torch.nan
    dense = load_file(str(good / "dense.safetensors"))
    folder = root / model / version
    write_snapshot(folder, model, version, {"embed": embed, "dense": dense})
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="snapshot root (one of snapshot_roots)")
    parser.add_argument("--model", default="feed-ranker")
    parser.add_argument("--version", required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--dense-parts",
        type=parse_dense_parts,
        default=None,
        help="MLP parts to write, name=hidden_size, comma-separated (default: one part `dense`)",
    )
    args = parser.parse_args()
    report = train(
        args.root, args.model, args.version, seed=args.seed, steps=args.steps, dense_parts=args.dense_parts
    )
    losses = ", ".join(f"{name} {loss:.4f}" for name, loss in report.loglosses.items())
    print(
        f"trained {args.model} {args.version} in {report.seconds:.1f}s: held-out logloss "
        f"{losses} (click-rate baseline {report.base_logloss:.4f}) -> {report.folder}"
    )


if __name__ == "__main__":
    main()
