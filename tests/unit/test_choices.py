"""Choice nodes (adaptive routing between variants): the spec's checks, DAG order through choice
nodes, rule matching per request context, fallback decisions, and the DAG one request runs.

One file over 600 lines on purpose: these cases share one spec builder and read as one story
from the spec to the request; split, each half would need the other's fixtures."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import pytest
import yaml

from ipnext.contracts.plan import PlanningProblem, demand_from_model
from ipnext.errors import SpecError
from ipnext.planner import solve
from ipnext.serving.choices import (
    RequestContext,
    VariantHealth,
    VariantRouter,
    fallback_reason,
    lookup,
    matched_variant,
    request_context,
    resolve_dag,
    variant_label,
)
from ipnext.serving.layout import render_set_app, set_app_plan
from ipnext.spec.fleet import Fleet
from ipnext.spec.model import (
    BreakerSpec,
    ChoiceSpec,
    ContextPaths,
    ModelSpec,
    SnapshotRef,
    SnapshotSet,
    load_model_spec,
)
from ipnext.spec.reading import parse_spec
from tests.unit.helpers import REPO

VARIANTS_SPEC = REPO / "examples" / "click_ranker" / "model-variants.yaml"


def variants_dict() -> dict[str, Any]:
    """A fresh, mutable copy of examples/click_ranker/model-variants.yaml as plain data."""
    return copy.deepcopy(yaml.safe_load(VARIANTS_SPEC.read_text()))


def parse(data: dict[str, Any]) -> ModelSpec:
    return parse_spec(ModelSpec, data, source="model.yaml")


def rejected(data: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as info:
        parse(data)
    return str(info.value)


def edges(*pairs: str) -> list[list[str]]:
    """ "a>b" -> ["a", "b"]."""
    return [pair.split(">") for pair in pairs]


EXAMPLE_DAG = ("input>embed", "embed>ranker", "ranker>small", "ranker>large", "small>output", "large>output")


# --- the example --------------------------------------------------------------------------------


def test_example_variants_spec_loads_with_its_values() -> None:
    spec = load_model_spec(VARIANTS_SPEC)
    assert sorted(spec.parts) == ["embed", "large", "small"]
    choice = spec.choices["ranker"]
    assert choice.variants == {"small": ["small"], "large": ["large"]}
    assert (choice.fallback, choice.default_variant, choice.max_in_flight) == ("small", "small", 4)
    assert choice.rules[0].variant == "large" and choice.rules[0].segment == ["premium", "new"]
    assert choice.context == ContextPaths(
        segment="segment", candidates="items", latency_budget_ms="latency_budget_ms"
    )
    assert spec.topological_order() == ["embed", "small", "large"]


def test_choice_defaults() -> None:
    choice = ChoiceSpec.model_validate({"variants": {"a": ["a"], "b": ["b"]}, "fallback": "a"})
    assert choice.default_variant == "a" and choice.rules == []
    assert choice.context == ContextPaths(segment="user.segment", candidates="candidates")
    assert choice.breaker == BreakerSpec(failures=5, cooldown_seconds=10)


def test_a_model_without_choices_has_none(example_spec: ModelSpec) -> None:
    assert example_spec.choices == {}
    assert "choices" not in yaml.safe_load((REPO / "examples" / "click_ranker" / "model.yaml").read_text())


# --- topological order through choice nodes ------------------------------------------------------


def test_topological_order_puts_variants_after_what_feeds_their_choice() -> None:
    # Name order would run the variants (alpha, beta) before the part feeding the choice (zeta),
    # and the join (aaa) first of all.
    data = variants_dict()
    dense = data["parts"]["small"]
    data["parts"] = {"zeta": data["parts"]["embed"], "alpha": dense, "beta": dense, "aaa": dense}
    data["dag"] = edges(
        "input>zeta", "zeta>pick", "pick>alpha", "pick>beta", "alpha>aaa", "beta>aaa", "aaa>output"
    )
    data["choices"] = {"pick": {"variants": {"a": ["alpha"], "b": ["beta"]}, "fallback": "a"}}
    assert parse(data).topological_order() == ["zeta", "alpha", "beta", "aaa"]


def test_topological_order_with_a_variant_of_two_parts() -> None:
    data = variants_dict()
    dense = data["parts"]["small"]
    data["parts"] = {"embed": data["parts"]["embed"], "b2": dense, "b1": dense, "small": dense}
    data["dag"] = edges(
        "input>embed",
        "embed>ranker",
        "input>ranker",
        "ranker>small",
        "ranker>b1",
        "b1>b2",
        "small>output",
        "b2>output",
    )
    data["choices"]["ranker"]["variants"] = {"small": ["small"], "large": ["b1", "b2"]}
    order = parse(data).topological_order()
    assert order.index("embed") < order.index("b1") < order.index("b2")
    assert order.index("embed") < order.index("small")


# --- what the spec rejects -----------------------------------------------------------------------


def with_choice(**changes: Any) -> dict[str, Any]:
    data = variants_dict()
    data["choices"]["ranker"].update(changes)
    return data


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"fallback": "huge"},
            "choices.ranker: fallback 'huge' is not a variant of this choice; use one of ['large', 'small']",
        ),
        ({"default": "huge"}, "choices.ranker: default 'huge' is not a variant"),
        ({"rules": [{"variant": "huge", "segment": ["premium"]}]}, "rules.0.variant 'huge' is not a variant"),
        (
            {"variants": {"small": ["small"]}},
            "choices.ranker.variants: Dictionary should have at least 2 items",
        ),
        (
            {"variants": {"small": ["small"], "large": []}},
            "choices.ranker.variants.large: List should have at least 1 item",
        ),
        (
            {"variants": {"small": ["small"], "large": ["large", "small"]}},
            "variants.large: part 'small' is also in variant 'small'; variants are alternatives",
        ),
        ({"variants": {"small": ["small", "small"], "large": ["large"]}}, "part 'small' is listed twice"),
        ({"rules": [{"variant": "large"}]}, "rule for variant 'large' has no condition; give segment"),
        (
            {"rules": [{"variant": "large", "min_candidates": 10, "max_candidates": 5}]},
            "min_candidates 10 is above max_candidates 5",
        ),
        (
            {"rules": [{"variant": "large", "segment": []}]},
            "choices.ranker.rules.0.segment: List should have at least 1 item",
        ),
        (
            {"context": {"segment": "user..segment"}},
            "choices.ranker.context.segment: String should match pattern",
        ),
        ({"max_in_flight": 0}, "choices.ranker.max_in_flight: Input should be greater than or equal to 1"),
        (
            {"breaker": {"failures": 0}},
            "choices.ranker.breaker.failures: Input should be greater than or equal to 1",
        ),
        ({"weights": {"small": 1}}, "choices.ranker.weights: Extra inputs are not permitted"),
    ],
)
def test_a_bad_choice_is_rejected_naming_the_field(change: dict[str, Any], message: str) -> None:
    assert message in rejected(with_choice(**change))


def test_a_higher_router_bound_allows_a_higher_max_in_flight() -> None:
    data = with_choice(max_in_flight=150)
    data["router"] = {"max_ongoing_requests": 151}
    spec = parse(data)
    assert (spec.choices["ranker"].max_in_flight, spec.router.max_ongoing_requests) == (150, 151)
    data["router"] = {"max_ongoing_requests": 0}
    assert "router.max_ongoing_requests: Input should be greater than or equal to 1" in rejected(data)


def test_a_max_in_flight_at_the_router_bound_given_is_rejected() -> None:
    data = with_choice(max_in_flight=100)
    data["router"] = {"max_ongoing_requests": 100}
    assert (
        "choices.ranker.max_in_flight: 100 is not below router.max_ongoing_requests (100), so the "
        "variants would never saturate; lower max_in_flight or raise router.max_ongoing_requests"
    ) in rejected(data)


def test_a_router_bound_not_given_stays_above_every_max_in_flight() -> None:
    # A spec stored before router existed, with a max_in_flight meant as "never saturate", stays valid.
    spec = parse(with_choice(max_in_flight=1000))
    assert spec.router.max_ongoing_requests == 1001
    assert parse(with_choice(max_in_flight=7)).router.max_ongoing_requests == 100
    again = ModelSpec.model_validate(spec.model_dump(mode="json"))  # as a workflow payload round-trips
    assert again.router.max_ongoing_requests == 1001


def test_choice_name_must_be_a_name() -> None:
    data = variants_dict()
    data["choices"]["Ranker"] = data["choices"].pop("ranker")
    message = rejected(data)
    assert "choices.Ranker.[key]: String should match pattern" in message and "(got 'Ranker')" in message


def test_choice_named_like_a_part_is_rejected() -> None:
    data = variants_dict()
    data["choices"]["embed"] = data["choices"].pop("ranker")
    assert "choices.embed: 'embed' is also a part; a choice node is not a part" in rejected(data)


def test_choice_named_input_is_rejected() -> None:
    data = variants_dict()
    data["choices"]["input"] = data["choices"].pop("ranker")
    assert "choices.input: 'input' is reserved for the DAG; rename the choice" in rejected(data)


def test_variant_naming_an_unknown_part_is_rejected() -> None:
    message = rejected(with_choice(variants={"small": ["small"], "large": ["huge"]}))
    assert (
        "choices.ranker.variants.large: 'huge' is not a part; list parts of ['embed', 'large', 'small']"
        in message
    )


def test_a_part_in_two_choices_is_rejected() -> None:
    data = variants_dict()
    data["choices"]["second"] = {"variants": {"a": ["small"], "b": ["embed"]}, "fallback": "a"}
    message = rejected(data)
    assert "choices.second.variants.a: part 'small' is also in variant small of choice ranker" in message


def test_choice_not_in_the_dag_is_rejected() -> None:
    data = variants_dict()
    data["dag"] = edges("input>embed", "embed>small", "embed>large", "small>output", "large>output")
    assert "choices.ranker: nothing feeds the choice node 'ranker'; add an edge into it" in rejected(data)


def test_edge_to_unknown_node_lists_the_choices() -> None:
    data = variants_dict()
    data["dag"].append(["ranker", "ghost"])
    message = rejected(data)
    assert "dag.6: edge [ranker, ghost] names unknown node 'ghost'" in message
    assert "and the choices ['ranker']" in message


def test_choice_feeding_a_part_of_no_variant_is_rejected() -> None:
    data = variants_dict()
    data["parts"]["extra"] = data["parts"]["small"]
    data["dag"] += edges("ranker>extra", "extra>output")
    assert (
        "edge [ranker, extra] leaves choice 'ranker' for 'extra', which is in none of its variants"
        in rejected(data)
    )


def test_choice_feeding_output_is_rejected() -> None:
    data = variants_dict()
    data["dag"].append(["ranker", "output"])
    assert "edge [ranker, output] leaves choice 'ranker'" in rejected(data)


def test_variant_reached_around_the_choice_is_rejected() -> None:
    data = variants_dict()
    data["dag"].append(["embed", "large"])
    message = rejected(data)
    assert (
        "dag.6: edge [embed, large] enters variant large of choice 'ranker' around the choice node" in message
    )
    assert "feed 'embed' into 'ranker' instead" in message


def test_edge_between_two_variants_is_rejected() -> None:
    data = variants_dict()
    data["dag"].append(["small", "large"])
    assert "edge [small, large] enters variant large of choice 'ranker' around the choice node" in rejected(
        data
    )


def test_variant_the_choice_does_not_enter_is_rejected() -> None:
    data = variants_dict()
    data["dag"] = edges("input>embed", "embed>ranker", "ranker>small", "small>output", "large>output")
    message = rejected(data)
    assert "choices.ranker.variants.large: no edge from 'ranker' enters this variant; add one" in message
    assert "[ranker, large]" in message


def test_node_after_one_variant_only_is_rejected() -> None:
    data = variants_dict()
    data["parts"]["rerank"] = data["parts"]["small"]
    data["dag"] = edges(
        "input>embed", "embed>ranker", "ranker>small", "ranker>large", "small>output", "large>rerank"
    )
    data["dag"] += edges("rerank>output")
    message = rejected(data)
    assert (
        "dag: 'rerank' takes the output of variant ['large'] of choice 'ranker' but not of ['small']"
        in message
    )
    assert (
        "must join all its variants (add edges from ['small'] to 'rerank', or add 'rerank' to variant large)"
        in message
    )


def test_cycle_through_a_choice_is_rejected() -> None:
    data = variants_dict()
    data["dag"].append(["small", "embed"])
    assert "cycle" in rejected(data)


def test_variant_that_never_reaches_the_output_is_rejected() -> None:
    data = variants_dict()
    data["dag"] = edges("input>embed", "embed>ranker", "ranker>small", "ranker>large", "small>output")
    message = rejected(data)
    assert (
        "dag: 'output' takes the output of variant ['small'] of choice 'ranker' but not of ['large']"
        in message
    )
    assert "(add edges from ['large'] to 'output')" in message


def test_part_in_a_variant_off_every_path_is_still_rejected() -> None:
    data = variants_dict()
    data["parts"]["dead-end"] = data["parts"]["large"]
    data["dag"].append(["ranker", "dead-end"])
    data["choices"]["ranker"]["variants"]["large"].append("dead-end")
    assert "part 'dead-end' is not on any path from input to output" in rejected(data)


# --- rule matching per context -------------------------------------------------------------------


def example_choice() -> ChoiceSpec:
    return load_model_spec(VARIANTS_SPEC).choices["ranker"]


def request(segment: Any = "premium", items: int = 3, budget: Any = 40.0) -> dict[str, Any]:
    body: dict[str, Any] = {"user": 1, "items": list(range(items))}
    if segment is not None:
        body["segment"] = segment
    if budget is not None:
        body["latency_budget_ms"] = budget
    return body


@pytest.mark.parametrize(
    ("body", "variant"),
    [
        (request(), "large"),
        (request(segment="new"), "large"),
        (request(segment="free"), "small"),  # segment not in the rule
        (request(segment=None), "small"),  # no segment: the condition does not hold
        (request(segment=7), "small"),  # not a string: as if absent
        (request(items=400), "large"),  # bounds are inclusive
        (request(items=401), "small"),  # too many candidates for the large ranker
        (request(items=0), "large"),
        (request(budget=30), "large"),
        (request(budget=29.9), "small"),  # a tight latency budget gets the small one
        (request(budget=None), "small"),
        (request(budget=True), "small"),  # a bool is not a number
        (request(budget="40"), "small"),
    ],
)
def test_rule_matching_per_context(body: dict[str, Any], variant: str) -> None:
    choice = example_choice()
    assert matched_variant(choice, request_context(body, choice.context)) == variant


def test_first_matching_rule_wins_and_default_is_not_the_fallback() -> None:
    choice = ChoiceSpec.model_validate(
        {
            "variants": {"small": ["s"], "mid": ["m"], "large": ["l"]},
            "fallback": "small",
            "default": "mid",
            "rules": [
                {"variant": "large", "segment": ["premium"], "min_candidates": 100},
                {"variant": "small", "max_latency_budget_ms": 10},
                {"variant": "large", "segment": ["premium"]},
            ],
        }
    )

    def pick(body: dict[str, Any]) -> str:
        return matched_variant(choice, request_context(body, choice.context))

    premium = {"user": {"segment": "premium"}}
    assert pick({**premium, "candidates": list(range(100))}) == "large"  # rule 0
    assert pick({**premium, "candidates": [1], "latency_budget_ms": 5}) == "small"  # rule 1 before rule 2
    assert pick({**premium, "candidates": [1]}) == "large"  # rule 2
    assert pick({"user": {"segment": "free"}}) == "mid"  # no rule: the default
    assert pick({}) == "mid"


def test_request_context_follows_dotted_paths() -> None:
    paths = ContextPaths(
        segment="user.profile.segment", candidates="request.items", latency_budget_ms="slo.ms"
    )
    body = {"user": {"profile": {"segment": "new"}}, "request": {"items": [1, 2]}, "slo": {"ms": 25}}
    assert request_context(body, paths) == RequestContext(segment="new", candidates=2, latency_budget_ms=25.0)
    assert request_context({"user": 3}, paths) == RequestContext()
    assert request_context([1, 2], paths) == RequestContext()
    assert request_context({"request": {"items": "abc"}}, paths).candidates is None
    assert lookup({"a": {"b": 0}}, "a.b") == 0 and lookup({"a": 1}, "a.b") is None


# --- fallback decisions --------------------------------------------------------------------------


def test_saturated_variant_falls_back_and_the_fallback_never_does() -> None:
    choice = example_choice()  # max_in_flight 4
    assert fallback_reason(choice, "large", VariantHealth(in_flight=3), now=0) is None
    assert fallback_reason(choice, "large", VariantHealth(in_flight=4), now=0) == "saturated"
    assert fallback_reason(choice, "small", VariantHealth(in_flight=1000), now=0) is None


def test_breaker_opens_after_failures_in_a_row_for_the_cooldown() -> None:
    choice = example_choice()
    breaker = BreakerSpec(failures=3, cooldown_seconds=10)
    health = VariantHealth()
    health.failed(breaker, now=100)
    health.failed(breaker, now=101)
    assert fallback_reason(choice, "large", health, now=101) is None  # 2 in a row: still closed
    health.succeeded()
    health.failed(breaker, now=102)
    health.failed(breaker, now=103)
    assert fallback_reason(choice, "large", health, now=103) is None  # the success reset the count
    health.failed(breaker, now=104)
    assert fallback_reason(choice, "large", health, now=104) == "breaker_open"
    assert fallback_reason(choice, "large", health, now=113.9) == "breaker_open"
    assert fallback_reason(choice, "large", health, now=114) is None  # cooldown over: tried again
    health.failed(breaker, now=115)  # and one more failure opens it at once
    assert fallback_reason(choice, "large", health, now=115) == "breaker_open"
    health.succeeded()
    assert health.failures_in_a_row == 0


def test_breaker_wins_over_saturation() -> None:
    health = VariantHealth(in_flight=10, open_until=50)
    assert fallback_reason(example_choice(), "large", health, now=0) == "breaker_open"


def router(choices: dict[str, ChoiceSpec] | None = None, observed: list[Any] | None = None) -> VariantRouter:
    spec = load_model_spec(VARIANTS_SPEC)
    chosen = spec.choices if choices is None else choices

    def observe(choice: str, variant: str, reason: str | None) -> None:
        if observed is not None:
            observed.append((choice, variant, reason))

    return VariantRouter([(s, d) for s, d in spec.dag], spec.topological_order(), dict(chosen), observe)


def test_router_sends_what_saturates_the_large_variant_to_the_small_one() -> None:
    observed: list[Any] = []
    variants = router(observed=observed)
    picks = [variants.choose(request(), now=0)["ranker"] for _ in range(6)]
    assert picks == ["large"] * 4 + ["small"] * 2
    assert observed[-1] == ("ranker", "small", "saturated")
    report = variants.report(now=0)["ranker"]
    assert report["requests"] == {"small": 2, "large": 4}
    assert report["fallbacks"] == {"saturated": 2, "breaker_open": 0, "failed": 0}
    assert report["in_flight"] == {"small": 2, "large": 4}
    variants.finish({"ranker": "large"}, {"embed", "large"}, None, now=0)
    assert variants.choose(request(), now=0) == {"ranker": "large"}  # room again
    assert variants.choose(request(segment="free"), now=0) == {"ranker": "small"}  # no fallback counted
    assert variants.report(now=0)["ranker"]["fallbacks"]["saturated"] == 2


def test_router_retries_a_failed_variant_once_on_the_fallback_and_opens_the_breaker() -> None:
    variants = router()  # breaker: 5 failures, 10 s
    for i in range(5):
        chosen = variants.choose(request(), now=i)
        assert chosen == {"ranker": "large"}
        variants.finish(chosen, {"embed"}, "large", now=i)
        retry = variants.retry_on_fallback(chosen, "large")
        assert retry == {"ranker": "small"}
        variants.finish(retry, {"embed", "small"}, None, now=i)
    report = variants.report(now=4)["ranker"]
    assert report["fallbacks"] == {"saturated": 0, "breaker_open": 0, "failed": 5}
    assert report["breaker_open"] == ["large"] and report["in_flight"] == {"small": 0, "large": 0}
    assert variants.choose(request(), now=5) == {"ranker": "small"}
    assert variants.report(now=5)["ranker"]["fallbacks"]["breaker_open"] == 1
    assert variants.choose(request(), now=14.5) == {"ranker": "large"}  # 10 s after the last failure


def test_no_retry_for_a_part_outside_the_chosen_non_fallback_variant() -> None:
    variants = router()
    large = variants.choose(request(), now=0)
    assert variants.retry_on_fallback(large, "embed") is None  # not a variant's part
    assert variants.retry_on_fallback(large, None) is None
    small = variants.choose(request(segment="free"), now=0)
    assert variants.retry_on_fallback(small, "small") is None  # the fallback has nothing to fall to


def test_a_failure_before_the_variant_ran_does_not_judge_it() -> None:
    variants = router()
    for _ in range(10):
        chosen = variants.choose(request(), now=0)
        variants.finish(chosen, set(), "embed", now=0)  # embed failed; large never ran
    assert variants.choose(request(), now=0) == {"ranker": "large"}


def test_carry_over_keeps_in_flight_counts_and_open_breakers() -> None:
    old = router()
    old.choose(request(), now=0)
    new = router()
    new.carry_over(old)
    assert new.report(now=0)["ranker"]["in_flight"] == {"small": 0, "large": 1}


def test_without_choices_the_router_hands_out_the_whole_dag() -> None:
    variants = VariantRouter(
        [("input", "embed"), ("embed", "dense"), ("dense", "output")], ["embed", "dense"], {}
    )
    chosen = variants.choose({"user": 1}, now=0)
    assert chosen == {} and variant_label(chosen) is None
    plan = variants.plan(chosen)
    assert plan.upstream == {"embed": ["input"], "dense": ["embed"], "output": ["dense"]}
    assert plan.order == ["embed", "dense"]
    assert variants.report(now=0) == {}


# --- the DAG one request runs --------------------------------------------------------------------


def test_resolve_dag_wires_the_chosen_variant_in_place_of_the_choice() -> None:
    spec = load_model_spec(VARIANTS_SPEC)
    dag = [(s, d) for s, d in spec.dag]
    assert resolve_dag(dag, dict(spec.choices), {"ranker": "large"}) == [
        ("input", "embed"),
        ("embed", "large"),
        ("large", "output"),
    ]
    assert resolve_dag(dag, {}, {}) == dag


def test_resolve_dag_passes_every_upstream_of_the_choice_to_each_entry_part() -> None:
    dag = [
        ("input", "embed"),
        ("embed", "pick"),
        ("input", "pick"),
        ("pick", "b1"),
        ("pick", "b2"),
        ("b1", "b3"),
        ("b2", "b3"),
        ("pick", "a1"),
        ("a1", "join"),
        ("b3", "join"),
        ("input", "join"),
        ("join", "output"),
    ]
    choices = {"pick": ChoiceSpec(variants={"a": ["a1"], "b": ["b1", "b2", "b3"]}, fallback="a")}
    assert resolve_dag(dag, choices, {"pick": "b"}) == [
        ("input", "embed"),
        ("embed", "b1"),
        ("input", "b1"),
        ("embed", "b2"),
        ("input", "b2"),
        ("b1", "b3"),
        ("b2", "b3"),
        ("b3", "join"),
        ("input", "join"),
        ("join", "output"),
    ]
    plan = VariantRouter(dag, ["embed", "a1", "b1", "b2", "b3", "join"], choices).plan({"pick": "a"})
    assert plan.order == ["embed", "a1", "join"]
    assert plan.upstream["a1"] == ["embed", "input"] and plan.upstream["join"] == ["a1", "input"]


def test_two_choices_in_a_row() -> None:
    data = variants_dict()
    dense = data["parts"]["small"]
    data["parts"].update({"rerank-a": dense, "rerank-b": dense})
    data["dag"] = edges(
        "input>embed",
        "embed>ranker",
        "ranker>small",
        "ranker>large",
        "small>rerank",
        "large>rerank",
        "rerank>rerank-a",
        "rerank>rerank-b",
        "rerank-a>output",
        "rerank-b>output",
    )
    data["choices"]["rerank"] = {"variants": {"a": ["rerank-a"], "b": ["rerank-b"]}, "fallback": "a"}
    spec = parse(data)
    assert spec.topological_order() == ["embed", "small", "large", "rerank-a", "rerank-b"]
    chosen = {"ranker": "small", "rerank": "b"}
    assert resolve_dag([(s, d) for s, d in spec.dag], dict(spec.choices), chosen) == [
        ("input", "embed"),
        ("embed", "small"),
        ("small", "rerank-b"),
        ("rerank-b", "output"),
    ]
    assert variant_label(chosen) == "ranker=small,rerank=b"
    assert variant_label({"ranker": "large"}) == "large"


# --- the choices travel with the set app ---------------------------------------------------------


def test_set_app_carries_the_choices_and_a_model_without_renders_as_before(
    example_spec: ModelSpec, dev_fleet: Fleet
) -> None:
    spec = load_model_spec(VARIANTS_SPEC)
    plan = solve(PlanningProblem(fleet=dev_fleet, deployments=demand_from_model(spec)))
    assert sorted(plan.deployments) == [f"{spec.name}/{p}" for p in ("embed", "large", "small")]
    refs = {
        p: SnapshotRef(uri=f"file:///srv/{p}.safetensors", sha256="a" * 64, snapshot_id=f"{spec.name}/{p}@v1")
        for p in spec.parts
    }
    snapshot_set = SnapshotSet(
        id=f"{spec.name}@1",
        number=1,
        version="v1",
        parts=refs,
        status="validated",
        published_at=datetime.now(UTC),
    )
    app = set_app_plan(spec, snapshot_set, plan, "us-east", "/srv/pinned")
    assert app.args.choices == spec.choices
    assert app.args.order == ["embed", "small", "large"]
    rendered = render_set_app(app, 0)
    assert rendered["args"]["choices"]["ranker"]["fallback"] == "small"
    assert sorted(d["name"] for d in rendered["deployments"]) == [
        "embed-cpu-highmem",
        "large-cpu-std",
        "set",
        "small-cpu-std",
    ]
    plain_plan = solve(PlanningProblem(fleet=dev_fleet, deployments=demand_from_model(example_spec)))
    plain_refs = {p: refs["embed"] for p in example_spec.parts}
    plain_set = snapshot_set.model_copy(update={"parts": plain_refs})
    plain = render_set_app(set_app_plan(example_spec, plain_set, plain_plan, "us-east", "/srv/pinned"), 0)
    assert "choices" not in plain["args"]
