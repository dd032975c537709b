"""The DAG algorithms alone (the spec's validation through them is in test_model_spec.py)."""

from __future__ import annotations

import re

import pytest

from ipnext.spec.dag import check_graph, find_cycle, node_order, reachable

CHAIN = [("input", "embed"), ("embed", "dense"), ("dense", "output")]


def test_find_cycle_returns_a_closed_walk_or_none() -> None:
    assert find_cycle(CHAIN) is None
    assert find_cycle([*CHAIN, ("dense", "embed")]) == ["dense", "embed", "dense"]


def test_node_order_puts_every_node_after_its_upstream_and_breaks_ties_by_name() -> None:
    edges = [("input", "b"), ("input", "a"), ("a", "c"), ("b", "c"), ("c", "output")]
    assert node_order(["c", "b", "a"], edges) == ["a", "b", "c"]


def test_reachable_both_ways() -> None:
    assert reachable(CHAIN, "embed", forward=True) == {"embed", "dense", "output"}
    assert reachable(CHAIN, "embed", forward=False) == {"embed", "input"}


@pytest.mark.parametrize(
    ("edges", "message"),
    [
        ([("input", "embed"), ("embed", "output")], "part 'dense' is not on any path"),
        ([*CHAIN, ("dense", "embed")], "dag: cycle dense -> embed -> dense"),
        ([("input", "embed"), ("embed", "nope")], "dag.1: edge [embed, nope] names unknown node 'nope'"),
        ([("embed", "input"), *CHAIN], "dag.0: edge [embed, input] runs the wrong way"),
    ],
)
def test_check_graph_names_the_edge_or_node_and_the_fix(edges: list[tuple[str, str]], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        check_graph(["embed", "dense"], {}, edges)


def test_a_node_after_a_choice_must_join_every_variant() -> None:
    edges = [("input", "pick"), ("pick", "small"), ("pick", "large"), ("small", "output")]
    with pytest.raises(ValueError, match=r"'output' takes the output of variant \['a'\] of choice 'pick'"):
        check_graph(["small", "large"], {"pick": {"a": ["small"], "b": ["large"]}}, edges)
