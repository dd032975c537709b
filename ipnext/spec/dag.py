"""A model's DAG as a graph: the checks a spec's edges must pass (known nodes, no loops, every
part between input and output, choice nodes wired so only the chosen variant runs) and the
orders the router and the rollouts walk it in.

Pure functions over node names and edges, so the spec (`ipnext.spec.model`) and its tests share
them; errors are `ValueError`s naming the `dag.<i>` edge or the node and the fix (pydantic
turns them into the spec's validation error).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

__all__ = [
    "DAG_INPUT",
    "DAG_OUTPUT",
    "RESERVED_NODES",
    "check_graph",
    "find_cycle",
    "node_order",
    "reachable",
    "upstream",
]

DAG_INPUT = "input"
DAG_OUTPUT = "output"
RESERVED_NODES = frozenset({DAG_INPUT, DAG_OUTPUT})

Edge = tuple[str, str]
Variants = Mapping[str, Sequence[str]]  # variant -> its parts, for one choice node


def check_graph(parts: Collection[str], choices: Mapping[str, Variants], edges: Sequence[Edge]) -> None:
    """Every rule a model's DAG obeys; the first broken one raises ValueError."""
    _check_edges(parts, choices, edges)
    cycle = find_cycle(edges)
    if cycle:
        raise ValueError(
            f"dag: cycle {' -> '.join(cycle)}; a model's DAG must not loop back, remove one of these edges"
        )
    order = node_order([*parts, *choices], edges)
    for name, variants in choices.items():
        _check_choice_wiring(name, variants, parts, edges, order)
    from_input = reachable(edges, DAG_INPUT, forward=True)
    to_output = reachable(edges, DAG_OUTPUT, forward=False)
    for name in parts:
        if name not in from_input or name not in to_output:
            raise ValueError(
                f"dag: part {name!r} is not on any path from input to output; "
                "add edges to it and from it, or remove the part"
            )
    for name in choices:
        if name not in from_input:
            raise ValueError(
                f"dag: choice {name!r} is not on any path from input; "
                "feed it from input or from a part that input reaches"
            )
    if DAG_OUTPUT not in from_input:
        raise ValueError("dag: no path from input to output; connect them through the parts")


def _check_edges(parts: Collection[str], choices: Mapping[str, Variants], edges: Sequence[Edge]) -> None:
    nodes = set(parts) | RESERVED_NODES | set(choices)
    seen: set[Edge] = set()
    for i, (src, dst) in enumerate(edges):
        for end in (src, dst):
            if end not in nodes:
                named = f" and the choices {sorted(choices)}" if choices else ""
                raise ValueError(
                    f"dag.{i}: edge [{src}, {dst}] names unknown node {end!r}; "
                    f"known nodes are input, output, the parts {sorted(parts)}{named}"
                )
        if dst == DAG_INPUT or src == DAG_OUTPUT:
            raise ValueError(
                f"dag.{i}: edge [{src}, {dst}] runs the wrong way; edges leave input and enter output"
            )
        if src == dst:
            raise ValueError(f"dag.{i}: edge [{src}, {dst}] is a self-loop; remove it")
        if (src, dst) in seen:
            raise ValueError(f"dag.{i}: edge [{src}, {dst}] is listed twice; remove one")
        seen.add((src, dst))


def _check_choice_wiring(
    name: str, variants: Variants, parts: Collection[str], edges: Sequence[Edge], order: list[str]
) -> None:
    """The choice node feeds only its variants' entry parts; a variant's parts are reached only
    through it; every node after the variants joins all of them."""
    variant_of = {part: v for v, members in variants.items() for part in members}
    if name not in {dst for _, dst in edges}:
        raise ValueError(
            f"choices.{name}: nothing feeds the choice node {name!r}; add an edge into it, "
            f"e.g. [input, {name}], and edges from it to each variant's first part"
        )
    for i, (src, dst) in enumerate(edges):
        if src == name and dst not in variant_of:
            raise ValueError(
                f"dag.{i}: edge [{src}, {dst}] leaves choice {name!r} for {dst!r}, which is in none "
                f"of its variants; a choice node feeds only its variants' parts "
                f"(add {dst!r} to a variant, or feed it from a part)"
            )
        if dst in variant_of and src != name and variant_of.get(src) != variant_of[dst]:
            raise ValueError(
                f"dag.{i}: edge [{src}, {dst}] enters variant {variant_of[dst]} of choice {name!r} "
                f"around the choice node; a variant's parts are fed only by {name!r} and by parts "
                f"of the same variant (feed {src!r} into {name!r} instead: the choice passes it on)"
            )
    entered = {variant_of[dst] for src, dst in edges if src == name}
    for variant, members in variants.items():
        if variant not in entered:
            raise ValueError(
                f"choices.{name}.variants.{variant}: no edge from {name!r} enters this variant; "
                f"add one to its first part, e.g. [{name}, {members[0]}]"
            )
    joined: dict[str, set[str]] = {}  # node after the variants -> the variants feeding it
    for src, dst in edges:
        if src in variant_of and dst not in variant_of:
            joined.setdefault(dst, set()).add(variant_of[src])
    position = {node: i for i, node in enumerate(order)}
    for node in sorted(joined, key=lambda n: position.get(n, len(position))):  # nearest first
        missing = sorted(set(variants) - joined[node])
        if missing:
            belong = (
                f", or add {node!r} to variant {sorted(joined[node])[0]}"
                if node in parts and len(joined[node]) == 1
                else ""
            )
            raise ValueError(
                f"dag: {node!r} takes the output of variant {sorted(joined[node])} of choice "
                f"{name!r} but not of {missing}; only the chosen variant runs, so a node after "
                f"a choice must join all its variants (add edges from {missing} to {node!r}{belong})"
            )


def node_order(nodes: Sequence[str], edges: Sequence[Edge]) -> list[str]:
    """`nodes` (parts and choice nodes) each after its upstream nodes; input and output are
    left out, and ties are broken by name so the order never depends on dict order."""
    order: list[str] = []
    indegree = {n: 0 for n in nodes}
    for src, dst in edges:
        if src in indegree and dst in indegree:  # input feeds everyone at the start
            indegree[dst] += 1
    ready = sorted(n for n, d in indegree.items() if d == 0)
    while ready:
        node = ready.pop(0)
        order.append(node)
        for src, dst in edges:
            if src == node and dst in indegree:
                indegree[dst] -= 1
                if indegree[dst] == 0:
                    ready.append(dst)
    return order


def upstream(edges: Sequence[Edge], node: str) -> list[str]:
    return [src for src, dst in edges if dst == node]


def find_cycle(edges: Sequence[Edge]) -> list[str] | None:
    """One cycle as a closed walk (`[a, b, a]`), or None for an acyclic graph."""
    graph: dict[str, list[str]] = {}
    for src, dst in edges:
        graph.setdefault(src, []).append(dst)
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def reachable(edges: Sequence[Edge], start: str, *, forward: bool) -> set[str]:
    """The nodes reachable from `start` along the edges (against them when not `forward`)."""
    seen = {start}
    frontier = [start]
    while frontier:
        node = frontier.pop()
        for src, dst in edges:
            a, b = (src, dst) if forward else (dst, src)
            if a == node and b not in seen:
                seen.add(b)
                frontier.append(b)
    return seen
