"""The ranking model's parts: embedding tables (whole or one hashed shard) and the dense ranker.

Request (the user once, the candidates as a list; `segment` and `latency_budget_ms` are
routing context):

    {"user": {"id": int, "features": [float] * user_features, "history": [item id] * seq_len,
              "segment": str},
     "candidates": [item id, ...], "latency_budget_ms": float}

Answer: one click probability per candidate, in order.

- `TablePart` looks up the rows the request needs from the tables it holds. Its answer is a
  dict of tensors that concatenate along the first dimension (`user_ids`/`user_rows`,
  `item_ids`/`item_rows`), so the router gathers the answers of a table's shards by
  concatenation and the ranker sees one lookup whichever way the table is split.
- `RankerPart` runs the user tower once per request and scores the candidates against it. It
  takes batches (`batch`): the user towers of concurrent requests run as one batch, each
  request's candidates against its own user.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ipnext.errors import PartInputError, SnapshotError
from ipnext.examples.request_ranker.model import RankingConfig, RankingModel

__all__ = [
    "PairRankerPart",
    "RankerPart",
    "RankingRequest",
    "TablePart",
    "parse_request",
    "shard_of",
    "table_shard_weights",
]

MAX_CANDIDATES = 5000
_MASK32 = (1 << 32) - 1


def shard_of(ids: torch.Tensor, shards: int) -> torch.Tensor:
    """The shard (0..shards-1) that holds each id (ids below 2**32): a 32-bit integer mix of the
    id, so neighbouring ids spread evenly. Every product stays below 2**63, so int64 math is
    exact. Trainer, table parts and tests share it."""
    if shards == 1:
        return torch.zeros_like(ids)
    x = ids.to(torch.int64) & _MASK32
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (x >> 16) ^ x
    return torch.remainder(x, shards)


@dataclass(frozen=True)
class RankingRequest:
    user: int
    features: torch.Tensor  # (user_features,)
    history: torch.Tensor  # (seq_len,) item ids
    candidates: torch.Tensor  # (n,) item ids
    segment: str | None
    latency_budget_ms: float | None


def parse_request(
    request: Any, config: RankingConfig, max_candidates: int = MAX_CANDIDATES
) -> RankingRequest:
    """Check a request against the model's sizes; a PartInputError names the field and the fix.

    Nothing reaches a tensor before it is checked: ids are integers in range, features are
    finite numbers, and a request carries at most `max_candidates` candidates (the part's
    config `max_candidates` overrides the default)."""
    if not isinstance(request, dict):
        raise PartInputError(
            f'inputs: expected {{"user": {{...}}, "candidates": [...]}}, got {type(request).__name__}'
        )
    user = request.get("user")
    if not isinstance(user, dict):
        raise PartInputError(
            f'inputs.user: expected {{"id": int, "features": [float], "history": [int]}}, got {user!r:.80}'
        )
    uid = user.get("id")
    if not isinstance(uid, int) or isinstance(uid, bool) or not 0 <= uid < config.num_users:
        raise PartInputError(f"inputs.user.id: {uid!r} is not a user id: users are 0..{config.num_users - 1}")
    features = _floats(user.get("features"), "inputs.user.features", config.user_features)
    history = _ids(user.get("history"), "inputs.user.history", config.num_items)
    if history.shape[0] != config.seq_len:
        raise PartInputError(
            f"inputs.user.history: {history.shape[0]} events; the model reads the latest "
            f"{config.seq_len} (pad a short history by repeating its oldest event)"
        )
    candidates = _ids(request.get("candidates"), "inputs.candidates", config.num_items)
    if not 1 <= candidates.shape[0] <= max_candidates:
        raise PartInputError(
            f"inputs.candidates: {candidates.shape[0]} candidates; send 1 to {max_candidates} per request"
        )
    segment = user.get("segment")
    if segment is not None and not isinstance(segment, str):
        raise PartInputError(f"inputs.user.segment: {segment!r} is not a string")
    budget = request.get("latency_budget_ms")
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, int | float) or budget <= 0
    ):
        raise PartInputError(f"inputs.latency_budget_ms: {budget!r} is not a positive number of milliseconds")
    return RankingRequest(
        uid, features, history, candidates, segment, None if budget is None else float(budget)
    )


def _max_candidates(config: dict[str, Any]) -> int:
    value = config.get("max_candidates", MAX_CANDIDATES)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.max_candidates: {value!r} is not a positive integer")
    return value


def _ids(value: Any, field: str, bound: int) -> torch.Tensor:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise PartInputError(f"{field}: expected a list of item ids (integers), got {value!r:.80}")
    ids = torch.tensor(value, dtype=torch.long)
    bad = ids[(ids < 0) | (ids >= bound)]
    if bad.numel():
        raise PartInputError(f"{field}: {bad[:5].tolist()} are not item ids: items are 0..{bound - 1}")
    return ids


def _floats(value: Any, field: str, length: int) -> torch.Tensor:
    if (
        not isinstance(value, list)
        or len(value) != length
        or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    ):
        raise PartInputError(f"{field}: expected {length} numbers, got {value!r:.80}")
    bad = [i for i, v in enumerate(value) if not math.isfinite(v)]
    if bad:
        raise PartInputError(f"{field}[{bad[0]}]: {value[bad[0]]} is not a finite number")
    return torch.tensor(value, dtype=torch.float32)


def table_shard_weights(model: RankingModel, shard: int, shards: int) -> dict[str, torch.Tensor]:
    """The rows of `model`'s tables that shard `shard` of `shards` holds, with their ids (the
    small category table goes whole to every shard): what a TablePart loads."""
    users = torch.arange(model.config.num_users)
    items = torch.arange(model.config.num_items)
    user_ids = users[shard_of(users, shards) == shard]
    item_ids = items[shard_of(items, shards) == shard]
    with torch.no_grad():
        return {
            "user_ids": user_ids,
            "user_rows": model.user_table.weight[user_ids].clone(),
            "item_ids": item_ids,
            "item_rows": model.item_table.weight[item_ids].clone(),
            "item_category": model.item_category[item_ids].clone(),
            "item_features": model.item_features[item_ids].clone(),
            "category_rows": model.category_table.weight.detach().clone(),
        }


class TablePart:
    """The embedding tables, or the rows of one hashed shard of them (config `shard`, `shards`)."""

    def __init__(self, weights: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        self._config = RankingConfig.from_config(config)
        self._max_candidates = _max_candidates(config)
        self._shards = int(config.get("shards", 1))
        self._shard = int(config.get("shard", 0))
        if not 0 <= self._shard < self._shards:
            raise SnapshotError(f"table part: shard {self._shard} is not one of 0..{self._shards - 1}")
        _check_weights("table part", weights, self.expected_tensors())
        self._user_ids, self._user_rows = weights["user_ids"], weights["user_rows"]
        self._item_ids, self._item_rows = (
            weights["item_ids"],
            torch.cat(
                [
                    weights["item_rows"],
                    weights["category_rows"][weights["item_category"]],
                    weights["item_features"],
                ],
                dim=-1,
            ),
        )
        for name, ids, bound in (
            ("user_ids", self._user_ids, self._config.num_users),
            ("item_ids", self._item_ids, self._config.num_items),
        ):
            if ids.numel() and (
                bool((ids[1:] <= ids[:-1]).any())
                or not bool((shard_of(ids, self._shards) == self._shard).all())
                or int(ids.max()) >= bound
            ):
                raise SnapshotError(
                    f"table part: {name} must rise strictly, stay below {bound} and hold only "
                    f"shard {self._shard}'s ids"
                )

    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Shapes the snapshot must have: a shard holds exactly the ids that hash to it."""
        c = self._config
        users = int((shard_of(torch.arange(c.num_users), self._shards) == self._shard).sum())
        items = int((shard_of(torch.arange(c.num_items), self._shards) == self._shard).sum())
        return {
            "user_ids": ((users,), "int64"),
            "user_rows": ((users, c.dim), "float32"),
            "item_ids": ((items,), "int64"),
            "item_rows": ((items, c.dim), "float32"),
            "item_category": ((items,), "int64"),
            "item_features": ((items, c.item_features), "float32"),
            "category_rows": ((c.num_categories, c.dim), "float32"),
        }

    async def __call__(self, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        request = parse_request(inputs.get("input"), self._config, self._max_candidates)
        users = torch.tensor([request.user])
        items = torch.unique(torch.cat([request.history, request.candidates]))
        users = users[shard_of(users, self._shards) == self._shard]
        items = items[shard_of(items, self._shards) == self._shard]
        return {
            "user_ids": users,
            "user_rows": self._user_rows[torch.searchsorted(self._user_ids, users)],
            "item_ids": items,
            "item_rows": self._item_rows[torch.searchsorted(self._item_ids, items)],
        }


class RankerPart:
    """The dense ranker: user tower once per request, candidates scored against it.

    Config: the model's sizes, plus `max_batch_size` and `batch_wait_ms` for Serve batching.
    """

    def __init__(self, weights: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        self._config = RankingConfig.from_config(config)
        self._max_candidates = _max_candidates(config)
        self._model = RankingModel(self._config, tables=False)
        _check_weights("ranker", weights, self.expected_tensors())
        self._model.load_state_dict(weights)
        self._model.eval()

    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {
            name: (tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for name, t in self._model.state_dict().items()
        }

    async def __call__(self, inputs: dict[str, Any]) -> list[float]:
        (result,) = await self.batch([inputs])
        if isinstance(result, Exception):
            raise result
        return result

    async def batch(self, batch: list[dict[str, Any]]) -> list[list[float] | Exception]:
        """Score many requests: their user towers as one batch, each request's candidates against
        its own user. A bad request answers its own error; the others are scored."""
        results: list[list[float] | Exception] = []
        ready: list[tuple[int, RankingRequest, dict[str, torch.Tensor]]] = []
        for i, inputs in enumerate(batch):
            try:
                request = parse_request(inputs.get("input"), self._config, self._max_candidates)
                ready.append((i, request, inputs["embed"]))
                results.append([])
            except PartInputError as err:
                results.append(err)
        if not ready:
            return results
        with torch.inference_mode():
            users, histories, features, candidates = [], [], [], []
            for _, request, lookups in ready:
                user, history, items = _rows(request, lookups)
                users.append(user)
                histories.append(history)
                features.append(request.features)
                candidates.append(items)
            state = self._model.user_tower(torch.stack(users), torch.stack(histories), torch.stack(features))
            for row, (i, _, _) in enumerate(ready):
                scores = self._model.score_candidates(state, row, candidates[row])
                results[i] = [round(p, 6) for p in scores.tolist()]
        return results


class PairRankerPart(RankerPart):
    """The naive dense part, for comparison: the same weights and scores, but every (user,
    candidate) pair runs the whole model, the user tower included (`score_pairs_rows`)."""

    async def batch(self, batch: list[dict[str, Any]]) -> list[list[float] | Exception]:
        results: list[list[float] | Exception] = []
        for inputs in batch:
            try:
                request = parse_request(inputs.get("input"), self._config, self._max_candidates)
            except PartInputError as err:
                results.append(err)
                continue
            user, history, items = _rows(request, inputs["embed"])
            with torch.inference_mode():
                scores = self._model.score_pairs_rows(user, history, request.features, items)
            results.append([round(p, 6) for p in scores.tolist()])
        return results


def _check_weights(
    part: str, weights: dict[str, torch.Tensor], expected: dict[str, tuple[tuple[int, ...], str]]
) -> None:
    """Every expected tensor present with its shape and dtype, and nothing else; the error names
    the first tensor that does not fit."""
    for name, (shape, dtype) in expected.items():
        got = weights.get(name)
        if got is None:
            raise SnapshotError(f"{part}: tensor {name!r} is missing from the snapshot")
        got_dtype = str(got.dtype).removeprefix("torch.")
        if got_dtype != dtype or tuple(got.shape) != shape:
            raise SnapshotError(
                f"{part}: tensor {name!r} is {got_dtype}{list(got.shape)}, "
                f"the part expects {dtype}{list(shape)}"
            )
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise SnapshotError(f"{part}: unexpected tensors {extra[:5]}")


def _rows(request: RankingRequest, lookups: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The request's user row, history rows and candidate rows, from the table parts' answer. A
    missing id is a serving fault (a shard did not answer for its ids), not the caller's."""
    at_user = (lookups["user_ids"] == request.user).nonzero()
    if at_user.numel() == 0:
        raise RuntimeError("ranker: the table parts returned no row for the user")
    order = torch.argsort(lookups["item_ids"])
    ids, rows = lookups["item_ids"][order], lookups["item_rows"][order]

    def item_rows(wanted: torch.Tensor) -> torch.Tensor:
        at = torch.searchsorted(ids, wanted).clamp(max=max(ids.numel() - 1, 0))
        if ids.numel() == 0 or not bool((ids[at] == wanted).all()):
            raise RuntimeError("ranker: the table parts returned no row for some item ids")
        return rows[at]

    return lookups["user_rows"][at_user[0, 0]], item_rows(request.history), item_rows(request.candidates)
