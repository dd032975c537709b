"""A request-oriented ranking model: the user side runs once per request, the candidates share it.

A ranking request carries one user and many candidates. The user tower (the user's id, dense
features and a sequence of recent events through a transformer block) depends on the user only,
so it runs once and its results are broadcast into the per-candidate work: the user's share of
every expert's first layer, the keys and values the candidates attend to, the expert gate. The
naive per-pair model (`score_pairs`) computes the same function for every (user, candidate)
pair, recomputing the user side each time; it is here as the reference and the baseline.

The per-feature and per-expert MLPs are many small GEMMs of different shapes and run through
`ipnext.kernels.grouped_gemm` (Triton on GPU tensors, a loop of matmuls on CPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ipnext.errors import SpecError
from ipnext.kernels import attention, grouped_gemm

__all__ = [
    "DENSE_PREFIXES",
    "TABLE_PREFIXES",
    "RankingConfig",
    "RankingModel",
    "UserState",
]

# Which tensors live in which part: the tables (memory-bound, sharded by id when large) and the
# dense network (compute-bound).
TABLE_PREFIXES = ("user_table.", "item_table.", "category_table.", "item_category", "item_features")
DENSE_PREFIXES = (
    "position",
    "block.",
    "user_dense.",
    "user_mlp.",
    "target_",
    "gate.",
    "feature_",
    "expert_",
    "head.",
)


@dataclass(frozen=True)
class RankingConfig:
    """Sizes of one model of the family (the issue's: 256 events, embedding dim 64)."""

    num_users: int = 2000
    num_items: int = 20000
    num_categories: int = 64
    dim: int = 64
    seq_len: int = 256
    heads: int = 4
    user_features: int = 16
    item_features: int = 8
    feature_hidden: int = 32
    experts: tuple[int, ...] = (64, 64, 128, 128)
    expert_out: int = 32

    @classmethod
    def from_config(cls, config: dict[str, Any], *, where: str = "config") -> RankingConfig:
        """Read a part's `config` (unknown keys that are not sizes are left to the part)."""
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for name, value in config.items():
            if name not in known:
                continue
            if name == "experts":
                if (
                    not isinstance(value, list | tuple)
                    or not value
                    or not all(_positive_int(v) for v in value)
                ):
                    raise SpecError(
                        f"{where}.experts: {value!r} is not a list of expert widths.",
                        field=f"{where}.experts",
                        value=value,
                        fix="give one positive hidden width per expert, e.g. [64, 64, 128, 128]",
                    )
                values[name] = tuple(int(v) for v in value)
            elif not _positive_int(value):
                raise SpecError(
                    f"{where}.{name}: {value!r} is not a positive integer.",
                    field=f"{where}.{name}",
                    value=value,
                    fix=f"give a positive integer (default {getattr(cls(), name)})",
                )
            else:
                values[name] = int(value)
        made = cls(**values)
        if made.dim % made.heads:
            raise SpecError(
                f"{where}.heads: dim {made.dim} does not split into {made.heads} heads.",
                field=f"{where}.heads",
                value=made.heads,
                fix="choose heads that divide dim",
            )
        head_dim = made.dim // made.heads
        if head_dim not in (16, 32, 64, 128):
            raise SpecError(
                f"{where}.heads: head size dim/heads = {head_dim}; "
                "the attention kernel takes 16, 32, 64 or 128.",
                field=f"{where}.heads",
                value=made.heads,
                fix="choose dim and heads so that dim/heads is 16, 32, 64 or 128",
            )
        return made

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["experts"] = list(self.experts)
        return out

    @property
    def item_width(self) -> int:
        """Width of a looked-up item row: its embedding, its category's embedding, its features."""
        return 2 * self.dim + self.item_features

    @property
    def expert_in(self) -> int:
        """Width of an expert's input: user vector, feature MLP outputs, user x item, attended history."""
        return self.dim + 3 * self.feature_hidden + 2 * self.dim


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass
class UserState:
    """What the user tower computes once per request (B users stacked): everything the
    per-candidate work needs from the user side."""

    vector: torch.Tensor  # (B, dim)
    keys: torch.Tensor  # (B, seq_len, dim): the history the candidates attend to
    values: torch.Tensor  # (B, seq_len, dim)
    gate: torch.Tensor  # (B, experts): how the experts are mixed for this user
    expert_bias: list[torch.Tensor]  # per expert (B, width): the user's share of its first layer


class _Block(nn.Module):
    """One pre-norm transformer block over the event sequence."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.norm_out = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = (
            self.qkv(self.norm1(x))
            .view(batch, length, 3, self.heads, dim // self.heads)
            .permute(2, 0, 3, 1, 4)
            .unbind(0)
        )
        mixed = attention(q, k, v).transpose(1, 2).reshape(batch, length, dim)
        x = x + self.proj(mixed)
        x = x + self.down(F.gelu(self.up(self.norm2(x))))
        return self.norm_out(x)


class RankingModel(nn.Module):
    """The whole model: the tables (`lookup_*`) and the dense network.

    Two ways to score, equal up to float rounding:
    - `score_request(user, history_ids, user_features, candidate_rows)`: the user tower once,
      broadcast to every candidate (what serving runs);
    - `score_pairs(...)`: every (user, candidate) pair on its own, the user side recomputed
      for each (the naive path, the reference and the bench baseline).
    """

    item_category: torch.Tensor  # buffers: the catalogue's facts, saved with the tables
    item_features: torch.Tensor

    def __init__(self, config: RankingConfig, *, tables: bool = True) -> None:
        super().__init__()
        c = config
        self.config = c
        # Tables (the dense part is built without them: its lookups arrive from the table parts).
        if tables:
            self.user_table = nn.Embedding(c.num_users, c.dim)
            self.item_table = nn.Embedding(c.num_items, c.dim)
            self.category_table = nn.Embedding(c.num_categories, c.dim)
            self.register_buffer("item_category", torch.zeros(c.num_items, dtype=torch.long))
            self.register_buffer("item_features", torch.zeros(c.num_items, c.item_features))
        # User tower.
        self.position = nn.Parameter(torch.randn(c.seq_len, c.dim) * 0.02)
        self.block = _Block(c.dim, c.heads)
        self.user_dense = nn.Linear(c.user_features, c.dim)
        self.user_mlp = nn.Linear(3 * c.dim, c.dim)
        self.target_key = nn.Linear(c.dim, c.dim)
        self.target_value = nn.Linear(c.dim, c.dim)
        self.target_query = nn.Linear(c.dim, c.dim)
        self.gate = nn.Linear(c.dim, len(c.experts))
        # Per-feature MLPs (item id, category, dense features): weights stored (k, n) for grouped_gemm.
        h = c.feature_hidden
        self.feature_weights = nn.ParameterList(
            [_weight(c.dim, h), _weight(c.dim, h), _weight(c.item_features, h)]
        )
        self.feature_bias = nn.Parameter(torch.zeros(3, h))
        # Experts: first layer (expert_in -> width_e), second (width_e -> expert_out).
        self.expert_in_weights = nn.ParameterList([_weight(c.expert_in, w) for w in c.experts])
        self.expert_in_bias = nn.ParameterList([nn.Parameter(torch.zeros(w)) for w in c.experts])
        self.expert_out_weights = nn.ParameterList([_weight(w, c.expert_out) for w in c.experts])
        self.expert_out_bias = nn.Parameter(torch.zeros(len(c.experts), c.expert_out))
        self.head = nn.Linear(c.expert_out, 1)

    # -- tables ------------------------------------------------------------------------------

    def lookup_items(self, ids: torch.Tensor) -> torch.Tensor:
        """(n,) item ids -> (n, item_width) rows: embedding, category embedding, features."""
        return torch.cat(
            [self.item_table(ids), self.category_table(self.item_category[ids]), self.item_features[ids]],
            dim=-1,
        )

    def lookup_users(self, ids: torch.Tensor) -> torch.Tensor:
        return self.user_table(ids)

    # -- the request-oriented path -----------------------------------------------------------

    def user_tower(
        self, user_rows: torch.Tensor, history_rows: torch.Tensor, user_features: torch.Tensor
    ) -> UserState:
        """B users at once: (B, dim) id rows, (B, seq_len, item_width) history rows, (B, user_features)."""
        d = self.config.dim
        events, vector = self._encode_user(user_rows, history_rows, user_features)
        # The user's share of each expert's first layer: rows [0, dim) of its weight see the user vector.
        expert_bias = [
            vector @ w[:d] + b for w, b in zip(self.expert_in_weights, self.expert_in_bias, strict=True)
        ]
        return UserState(
            vector=vector,
            keys=self.target_key(events),
            values=self.target_value(events),
            gate=self.gate(vector).softmax(dim=-1),
            expert_bias=expert_bias,
        )

    def _encode_user(
        self, user_rows: torch.Tensor, history_rows: torch.Tensor, user_features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The history through the transformer block (B, seq_len, dim) and the user vector (B, dim)."""
        events = self.block(history_rows[..., : self.config.dim] + self.position)
        vector = F.relu(
            self.user_mlp(torch.cat([user_rows, events.mean(dim=1), self.user_dense(user_features)], dim=-1))
        )
        return events, vector

    def score_candidates(self, state: UserState, index: int, candidate_rows: torch.Tensor) -> torch.Tensor:
        """Scores (n,) of one user's (row `index` of `state`) candidates, given their (n, item_width)
        rows. The user's results are broadcast, never recomputed or copied per candidate."""
        d, h = self.config.dim, self.config.feature_hidden
        item, category, features = candidate_rows.split([d, d, self.config.item_features], dim=-1)
        per_feature = grouped_gemm([item, category, features], list(self.feature_weights))
        feature_out = F.relu(torch.cat(per_feature, dim=-1) + self.feature_bias.view(1, 3 * h))
        user = state.vector[index]
        attended = _target_attention(self.target_query(item), state.keys[index], state.values[index])
        rest = torch.cat([feature_out, user * item, attended], dim=-1)  # the user vector broadcasts
        first = grouped_gemm([rest] * len(self.config.experts), [w[d:] for w in self.expert_in_weights])
        hidden = [F.relu(x + bias[index]) for x, bias in zip(first, state.expert_bias, strict=True)]
        return self._mix(hidden, state.gate[index])

    def score_request(
        self,
        user_ids: torch.Tensor,
        history_ids: torch.Tensor,
        user_features: torch.Tensor,
        candidate_ids: torch.Tensor,
    ) -> torch.Tensor:
        """One request straight from ids: (1,) user, (seq_len,) history, (user_features,), (n,) candidates."""
        state = self.user_tower(
            self.lookup_users(user_ids.view(1)),
            self.lookup_items(history_ids).unsqueeze(0),
            user_features.view(1, -1),
        )
        return self.score_candidates(state, 0, self.lookup_items(candidate_ids))

    # -- the naive per-pair path -------------------------------------------------------------

    def score_pairs(
        self,
        user_ids: torch.Tensor,
        history_ids: torch.Tensor,
        user_features: torch.Tensor,
        candidate_ids: torch.Tensor,
        *,
        chunk: int = 16,
    ) -> torch.Tensor:
        """The same scores, each (user, candidate) pair computed on its own: the user's lookups and
        tower are repeated per pair and the expert layers see the concatenated pair features.
        Pairs run `chunk` at a time so memory stays bounded."""

        def pairs(start: int, m: int) -> torch.Tensor:
            histories = history_ids.view(1, -1).expand(m, -1)
            return self._pairs(
                self.lookup_users(user_ids.view(1).expand(m)),
                self.lookup_items(histories.reshape(-1)).view(*histories.shape, -1),
                user_features.view(1, -1).expand(m, -1),
                self.lookup_items(candidate_ids[start : start + m]),
            )

        return _chunked(pairs, candidate_ids.shape[0], chunk)

    def score_pairs_rows(
        self,
        user_row: torch.Tensor,
        history_rows: torch.Tensor,
        user_features: torch.Tensor,
        candidate_rows: torch.Tensor,
        *,
        chunk: int = 16,
    ) -> torch.Tensor:
        """`score_pairs` from looked-up rows ((dim,), (seq_len, item_width), (user_features,),
        (n, item_width)): the user's rows are repeated per pair (the naive dense part)."""

        def pairs(start: int, m: int) -> torch.Tensor:
            return self._pairs(
                user_row.view(1, -1).expand(m, -1),
                history_rows.unsqueeze(0).expand(m, -1, -1),
                user_features.view(1, -1).expand(m, -1),
                candidate_rows[start : start + m],
            )

        return _chunked(pairs, candidate_rows.shape[0], chunk)

    def _pairs(
        self,
        user_rows: torch.Tensor,
        history_rows: torch.Tensor,
        user_features: torch.Tensor,
        candidate_rows: torch.Tensor,
    ) -> torch.Tensor:
        """m pairs, row i of each argument belonging to pair i: the whole model per pair."""
        d, h = self.config.dim, self.config.feature_hidden
        events, user = self._encode_user(user_rows, history_rows, user_features)
        keys, values = self.target_key(events), self.target_value(events)
        gate = self.gate(user).softmax(dim=-1)
        item, category, features = candidate_rows.split([d, d, self.config.item_features], dim=-1)
        per_feature = grouped_gemm([item, category, features], list(self.feature_weights))
        feature_out = F.relu(torch.cat(per_feature, dim=-1) + self.feature_bias.view(1, 3 * h))
        query = self.target_query(item).unsqueeze(1)  # (m, 1, dim): one query per pair
        scores = (query @ keys.transpose(1, 2)) / math.sqrt(d)
        attended = (scores.softmax(dim=-1) @ values).squeeze(1)
        pair = torch.cat([user, feature_out, user * item, attended], dim=-1)
        first = grouped_gemm([pair] * len(self.config.experts), list(self.expert_in_weights))
        hidden = [F.relu(x + b) for x, b in zip(first, self.expert_in_bias, strict=True)]
        return self._mix(hidden, gate)

    # -- shared tail -------------------------------------------------------------------------

    def _mix(self, hidden: Sequence[torch.Tensor], gate: torch.Tensor) -> torch.Tensor:
        """Experts' second layers in one grouped GEMM, mixed by the gate, then the head: (n,) scores.
        `gate` is (experts,) for one user broadcast to all candidates, or (n, experts) per pair."""
        outs = grouped_gemm(list(hidden), list(self.expert_out_weights))
        stacked = torch.stack(outs, dim=-2) + self.expert_out_bias  # (n, experts, expert_out)
        mixed = (gate.unsqueeze(-1) * stacked).sum(dim=-2)
        return torch.sigmoid(self.head(F.relu(mixed)).squeeze(-1))

    # -- weights -----------------------------------------------------------------------------

    def table_weights(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if k.startswith(TABLE_PREFIXES)}

    def dense_weights(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if k.startswith(DENSE_PREFIXES)}


def _chunked(score: Any, n: int, chunk: int) -> torch.Tensor:
    """score(start, m) over [0, n) in chunks of at most `chunk` pairs, concatenated."""
    parts = [score(start, min(chunk, n - start)) for start in range(0, n, chunk)]
    return torch.cat(parts) if parts else torch.zeros(0)


def _weight(k: int, n: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(k, n) * (2.0 / k) ** 0.5 * 0.5)


def _target_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Each candidate's query (n, dim) attends over one user's history (seq_len, dim): one matmul
    for all candidates against the keys computed once."""
    scores = (query @ keys.T) / math.sqrt(query.shape[-1])
    return scores.softmax(dim=-1) @ values
