"""The ranker's two parts, following the part contract: `factory(weights, config) -> part`.

- EmbeddingPart (sparse, memory-bound: wants high-memory hosts) looks up the user
  and candidate item embeddings.
- DensePart (compute-bound) scores each (user, item) pair with an MLP over the
  two embeddings and their elementwise product, returning click probabilities. Its config's
  `hidden` sizes the MLP (model-variants.yaml serves a small and a large one); `delay_ms`,
  `max_items` and `hang_on_non_finite` are drill knobs (a slow part, a part that fails on big
  batches, a part that hangs on a poisoned snapshot's users), off by default.

Request: {"user": int, "items": [int, ...]} with at most `max_candidates` (the embed part's
config, default 1000) items; response: one probability per item.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from torch import nn

from ipnext.errors import PartInputError, SnapshotError

__all__ = ["MAX_CANDIDATES", "DensePart", "EmbeddingPart", "RankerModules", "build_modules"]

MAX_CANDIDATES = 1000  # items per request, unless the embed part's config says `max_candidates`


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class RankerModules(nn.Module):
    """Both parts' modules together, as the trainer trains them."""

    def __init__(self, num_users: int, num_items: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.user = nn.Embedding(num_users, dim)
        self.item = nn.Embedding(num_items, dim)
        self.mlp = nn.Sequential(nn.Linear(3 * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def embed(self, user: torch.Tensor, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.user(user), self.item(items)

    def score(self, user_vec: torch.Tensor, item_vecs: torch.Tensor) -> torch.Tensor:
        user_b = user_vec.expand_as(item_vecs)
        features = torch.cat([user_b, item_vecs, user_b * item_vecs], dim=-1)
        return self.mlp(features).squeeze(-1)


def build_modules(config: dict[str, Any]) -> RankerModules:
    return RankerModules(
        num_users=int(config["num_users"]),
        num_items=int(config["num_items"]),
        dim=int(config["dim"]),
        hidden=int(config.get("hidden", 32)),
    )


def _load(module: nn.Module, prefix: str, weights: dict[str, torch.Tensor], part: str) -> None:
    """Strictly load `weights` into the submodule, naming the first tensor that does not fit."""
    expected = {k: v for k, v in module.state_dict().items()}
    for name, tensor in expected.items():
        got = weights.get(prefix + name)
        if got is None:
            raise SnapshotError(f"{part}: tensor {prefix + name!r} is missing from the snapshot")
        if tuple(got.shape) != tuple(tensor.shape) or got.dtype != tensor.dtype:
            raise SnapshotError(
                f"{part}: tensor {prefix + name!r} is {str(got.dtype).removeprefix('torch.')}"
                f"{list(got.shape)}, the part expects "
                f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"
            )
    extra = sorted(set(weights) - {prefix + n for n in expected})
    if extra:
        raise SnapshotError(f"{part}: unexpected tensors {extra}")
    module.load_state_dict({k.removeprefix(prefix): v for k, v in weights.items()})


def _expected(module: nn.Module, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    return {
        prefix + name: (tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for name, t in module.state_dict().items()
    }


class EmbeddingPart:
    def __init__(self, weights: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        modules = build_modules(config)
        self._user, self._item = modules.user, modules.item
        self._num_users, self._num_items = modules.user.num_embeddings, modules.item.num_embeddings
        tables = nn.ModuleDict({"user": self._user, "item": self._item})
        _load(tables, "", weights, "embed")
        self._tables = tables.eval()
        self._max_candidates = int(config.get("max_candidates", MAX_CANDIDATES))

    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return _expected(self._tables, "")

    async def __call__(self, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        request: Any = inputs.get("input")
        user: Any = request.get("user") if isinstance(request, dict) else None
        items: Any = request.get("items") if isinstance(request, dict) else None
        # Integers only: int() would take 3.7, "5" and True, and raise OverflowError on inf.
        if not _is_int(user) or not isinstance(items, list) or not all(_is_int(i) for i in items):
            raise PartInputError(
                f'inputs: expected {{"user": int, "items": [int, ...]}}, got {request!r:.120}'
            )
        if len(items) > self._max_candidates:
            raise PartInputError(
                f"inputs.items: {len(items)} items; send at most {self._max_candidates} per request "
                "(the embed part's config max_candidates)"
            )
        if not 0 <= user < self._num_users:
            raise PartInputError(f"inputs.user: {user} is out of range: users are 0..{self._num_users - 1}")
        bad = [i for i in items if not 0 <= i < self._num_items]
        if bad:
            raise PartInputError(
                f"inputs.items: {bad[:5]} are out of range: items are 0..{self._num_items - 1}"
            )
        with torch.inference_mode():
            return {
                "user": self._user(torch.tensor([user])),
                "items": self._item(torch.tensor(items, dtype=torch.long)),
            }


class DensePart:
    def __init__(self, weights: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        self._modules = build_modules(config)
        _load(self._modules.mlp, "mlp.", weights, "dense")
        self._modules.eval()
        # Drills: a sleep per call (a part slower than its callers' rate saturates), and a batch
        # size over which the part fails as the server's fault (as running out of memory would).
        self._delay_s = float(config.get("delay_ms", 0)) / 1000
        self._max_items = config.get("max_items")
        # A hung part: never answers a request whose embeddings are not finite (a poisoned
        # snapshot's users), as a part stuck on some inputs would; the router's deadline ends it.
        self._hang_on_non_finite = bool(config.get("hang_on_non_finite", False))

    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return _expected(self._modules.mlp, "mlp.")

    async def __call__(self, inputs: dict[str, Any]) -> list[float]:
        vectors = inputs["embed"]
        if self._delay_s:
            await asyncio.sleep(self._delay_s)
        if self._hang_on_non_finite and not all(bool(torch.isfinite(v).all()) for v in vectors.values()):
            await asyncio.Event().wait()  # forever, until the caller cancels it
        if self._max_items is not None and len(vectors["items"]) > int(self._max_items):
            raise RuntimeError(
                f"{len(vectors['items'])} items are over this part's max_items {self._max_items}"
            )
        with torch.inference_mode():
            logits = self._modules.score(vectors["user"], vectors["items"])
            return [round(p, 6) for p in torch.sigmoid(logits).tolist()]
