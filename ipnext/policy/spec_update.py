"""What a model update changes, and the lightest way that applies it: a pure comparison of two specs.

`diff_specs(old, new)` lists every changed field as one readable line (its dotted path, the old
value and the new one) and sorts the update into one kind:

- `in_place`: the owner, rollout settings and gates, the watch, the router section, choices, a
  part's batching or queue bound. The spec is replaced and the serving check re-renders the
  serving set's apps from it (Serve restarts only the deployments whose options changed; the set,
  its snapshots and its placement stay). Gates and rollout settings apply from the next rollout.
- `capacity`: traffic, the latency budget, availability. A new placement for the same set,
  moved to through a capacity move when it differs from the current one.
- `new_set`: parts (added, removed, their factory, config, hardware or shards), the DAG, `sync`,
  `serving` (pooled or dedicated).
  The serving set's snapshots (or the ones the update brings) become a new set under the new spec,
  which rolls out through the normal steps; the new spec takes effect when that set serves.

A change in more than one group takes the heaviest kind. The model's name cannot change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ipnext.spec.model import ModelSpec

__all__ = ["SpecDiff", "UpdateKind", "diff_specs"]


class UpdateKind(StrEnum):
    NONE = "none"
    IN_PLACE = "in_place"
    CAPACITY = "capacity"
    NEW_SET = "new_set"


_WEIGHT = {UpdateKind.NONE: 0, UpdateKind.IN_PLACE: 1, UpdateKind.CAPACITY: 2, UpdateKind.NEW_SET: 3}
# Top-level fields by the kind of update they need (anything not named: in place).
_NEW_SET_FIELDS = {"parts", "dag", "sync", "serving"}
_CAPACITY_FIELDS = {"traffic", "latency_budget_ms", "availability"}
# A part's own fields that its set's apps take in place.
_PART_IN_PLACE = {"batching", "max_queued_requests"}
VALUE_WIDTH = 120  # a changed value is shown up to this many characters


@dataclass(frozen=True)
class SpecDiff:
    kind: UpdateKind
    changes: list[str]  # "rollout.bake_seconds: 60 -> 5", in field order

    def fields(self) -> list[str]:
        """The changed fields' dotted paths."""
        return [line.split(": ", 1)[0] for line in self.changes]


def diff_specs(old: ModelSpec, new: ModelSpec) -> SpecDiff:
    """Every changed field of `new` against `old`, and the update kind that applies them.

    Raises ValueError when the names differ (an update changes a model, never which one)."""
    if old.name != new.name:
        raise ValueError(f"name: an update keeps the model's name {old.name!r}, got {new.name!r}")
    before, after = old.model_dump(mode="json"), new.model_dump(mode="json")
    changes: list[tuple[str, UpdateKind]] = []
    for field in after:
        if before.get(field) == after[field]:
            continue
        if field == "parts":
            changes.extend(_part_changes(before["parts"], after["parts"]))
        else:
            for path, line in _lines(field, before.get(field), after[field]):
                changes.append((line, _kind_of(path)))
    kind = max((k for _, k in changes), key=_WEIGHT.__getitem__, default=UpdateKind.NONE)
    return SpecDiff(kind=kind, changes=[line for line, _ in changes])


def _part_changes(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, UpdateKind]]:
    changes: list[tuple[str, UpdateKind]] = []
    for part in sorted(set(before) | set(after)):
        if part not in after:
            changes.append((f"parts.{part}: removed", UpdateKind.NEW_SET))
        elif part not in before:
            changes.append((f"parts.{part}: added ({_show(after[part])})", UpdateKind.NEW_SET))
        else:
            for key in after[part]:
                if before[part].get(key) == after[part][key]:
                    continue
                kind = UpdateKind.IN_PLACE if key in _PART_IN_PLACE else UpdateKind.NEW_SET
                for _, line in _lines(f"parts.{part}.{key}", before[part].get(key), after[part][key]):
                    changes.append((line, kind))
    return changes


def _lines(path: str, before: Any, after: Any) -> list[tuple[str, str]]:
    """(path, line) for each changed leaf under `path`; lists and scalars are one leaf each."""
    if isinstance(before, dict) and isinstance(after, dict):
        found = []
        for key in [*before, *(k for k in after if k not in before)]:
            if before.get(key) != after.get(key):
                found.extend(_lines(f"{path}.{key}", before.get(key), after.get(key)))
        return found
    return [(path, f"{path}: {_show(before)} -> {_show(after)}")]


def _kind_of(path: str) -> UpdateKind:
    top = path.split(".", 1)[0]
    if top in _NEW_SET_FIELDS:
        return UpdateKind.NEW_SET
    if top in _CAPACITY_FIELDS:
        return UpdateKind.CAPACITY
    return UpdateKind.IN_PLACE


def _show(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= VALUE_WIDTH else text[: VALUE_WIDTH - 3] + "..."
