"""Parts split into hashed shards: how a spec's `shards: k` becomes k parts, and how their answers join.

A part with `shards: k` (an embedding table larger than one replica's memory) becomes the parts
`<part>-shard0` .. `<part>-shard<k-1>`: each its own planner deployment, snapshot, Serve
deployment and replicas, each built with `config.shard` = i and `config.shards` = k so it loads
and answers only its own rows. Every DAG edge into or out of the part is wired to every shard.
The router calls the shards of a part in parallel with the same inputs and gathers their answers
back into one value under the part's name, so parts downstream see the part as if it were whole.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_SHARDS", "expand_shards", "gather_shards", "shard_name"]

MAX_SHARDS = 64


def shard_name(part: str, index: int) -> str:
    return f"{part}-shard{index}"


def expand_shards(data: Any) -> Any:
    """A raw model spec (as read from YAML) with every part of `shards: k` (k >= 2) replaced by its
    k shard parts and the DAG and choice variants rewired to them. Anything malformed is left as
    it is, for the spec's validation to report with its field; an expanded spec passes unchanged."""
    if not isinstance(data, dict) or not isinstance(data.get("parts"), dict):
        return data
    counts = {
        name: part["shards"]
        for name, part in data["parts"].items()
        if isinstance(part, dict)
        and isinstance(part.get("shards"), int)
        and not isinstance(part.get("shards"), bool)
        and 2 <= part["shards"] <= MAX_SHARDS
    }
    if not counts:
        return data
    members = {name: [shard_name(name, i) for i in range(k)] for name, k in counts.items()}
    parts: dict[str, Any] = {}
    for name, part in data["parts"].items():
        if name not in counts:
            parts[name] = part
            continue
        for i, member in enumerate(members[name]):
            if member in data["parts"]:
                raise ValueError(
                    f"parts.{name}.shards: its shard {member!r} would replace the part of that name; "
                    "rename that part"
                )
            config = part.get("config") or {}
            if not isinstance(config, dict):
                return data  # the spec's validation names the field
            body = {key: value for key, value in part.items() if key != "shards"}
            parts[member] = {
                **body,
                "config": {**config, "shard": i, "shards": counts[name]},
                "shard_of": name,
            }
    out = dict(data, parts=parts)

    def wired(node: Any) -> list[Any]:
        return list(members[node]) if isinstance(node, str) and node in members else [node]

    dag = data.get("dag")
    if isinstance(dag, list):
        edges: list[Any] = []
        for edge in dag:
            if isinstance(edge, list | tuple) and len(edge) == 2:
                edges.extend([src, dst] for src in wired(edge[0]) for dst in wired(edge[1]))
            else:
                edges.append(edge)
        out["dag"] = edges
    choices = data.get("choices")
    if isinstance(choices, dict):
        rewired: dict[str, Any] = {}
        for name, choice in choices.items():
            if isinstance(choice, dict) and isinstance(choice.get("variants"), dict):
                variants = {
                    variant: [m for p in listed for m in wired(p)] if isinstance(listed, list) else listed
                    for variant, listed in choice["variants"].items()
                }
                choice = dict(choice, variants=variants)
            rewired[name] = choice
        out["choices"] = rewired
    return out


def gather_shards(answers: list[Any]) -> Any:
    """One value from the answers of a part's shards, in shard order: dicts key by key, tensors
    concatenated along their first dimension, lists concatenated. A shard part answers in a
    shape that joins this way (rows with their ids), so downstream parts cannot tell."""
    first = answers[0]
    if isinstance(first, dict):
        keys = list(first)
        for i, answer in enumerate(answers):
            if not isinstance(answer, dict) or list(answer) != keys:
                raise ValueError(f"shard {i} answered {answer!r:.80}; shard 0 answered the keys {keys}")
        return {key: gather_shards([answer[key] for answer in answers]) for key in keys}
    if isinstance(first, list):
        return [item for answer in answers for item in answer]
    if hasattr(first, "shape") and hasattr(first, "dim"):
        import torch

        return torch.cat(answers, dim=0)
    raise ValueError(
        f"shards answered {type(first).__name__}; a sharded part answers dicts, lists or tensors, "
        "which join along their first dimension"
    )
