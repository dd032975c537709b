"""The routing document: built from a plan's fractions, its generations, the choice of a serving
region for a caller, its route, and how the serving layer renders and answers it."""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ray.serve.schema import ServeDeploySchema
from starlette.requests import Request

from ipnext.contracts.plan import DeploymentPlacement, Plan
from ipnext.contracts.routing import (
    RoutingDocument,
    RoutingTable,
    fallback_order,
    pick_region,
    predict_path,
    routes_from_plan,
    routing_document,
    routing_model_of,
    routing_path,
    succeed,
)
from ipnext.serving.layout import (
    HEAD_NODE_RESOURCE,
    ROUTING_APP,
    deployed_routing,
    render_routing_app,
    render_serve_config,
)
from ipnext.serving.routing_app import RoutingService

MODEL = "feed-ranker"


def placement(
    replicas: dict[str, dict[str, int]], fractions: dict[str, dict[str, float]]
) -> DeploymentPlacement:
    return DeploymentPlacement(replicas=replicas, fractions=fractions)


def two_region_plan(
    fractions: dict[str, dict[str, float]] | None = None, revision: int = 1, model: str = MODEL
) -> Plan:
    rows = fractions or {"us-east": {"us-east": 1.0}, "eu-west": {"eu-west": 0.75, "us-east": 0.25}}
    both = {"us-east": {"cpu-std": 2}, "eu-west": {"cpu-std": 1}}
    return Plan(
        deployments={
            f"{model}/embed": placement({r: {"cpu-highmem": n["cpu-std"]} for r, n in both.items()}, rows),
            f"{model}/dense": placement(both, rows),
        },
        cost=1.0,
        solver="test",
        revision=revision,
    )


def document(routes: dict[str, dict[str, float]], generation: int = 1) -> RoutingDocument:
    return RoutingDocument(model=MODEL, generation=generation, ttl_seconds=5, routes=routes)


# ---- built from a plan ------------------------------------------------------------------------


def test_routes_are_the_plans_fractions_per_source() -> None:
    assert routes_from_plan(MODEL, two_region_plan()) == {
        "eu-west": {"eu-west": 0.75, "us-east": 0.25},
        "us-east": {"us-east": 1.0},
    }


def test_routes_drop_empty_shares_and_regions_missing_a_part_and_sum_to_one_per_source() -> None:
    plan = two_region_plan(
        {"us-east": {"us-east": 0.6, "eu-west": 0.0}, "eu-west": {"eu-west": 0.3, "ap-south": 0.7}}
    )
    embed = plan.deployments[f"{MODEL}/embed"]
    plan = plan.model_copy(
        update={
            "deployments": {
                **plan.deployments,
                # dense alone in ap-south: a request runs the whole DAG in one region, so it does not count
                f"{MODEL}/dense": embed.model_copy(
                    update={"replicas": {**embed.replicas, "ap-south": {"cpu-std": 1}}}
                ),
            }
        }
    )
    routes = routes_from_plan(MODEL, plan)
    assert routes == {"us-east": {"us-east": 1.0}, "eu-west": {"eu-west": 1.0}}


def test_routes_ignore_other_models_in_the_plan_and_are_empty_without_the_model() -> None:
    other = two_region_plan({"us-east": {"eu-west": 1.0}}, model="other")
    merged = Plan(
        deployments={**two_region_plan().deployments, **other.deployments}, cost=2.0, solver="merged"
    )
    assert routes_from_plan(MODEL, merged) == routes_from_plan(MODEL, two_region_plan())
    assert routes_from_plan("absent", merged) == {}


def test_generation_counts_up_only_when_the_document_changes() -> None:
    first = routing_document(MODEL, two_region_plan(), ttl_seconds=5)
    assert first.generation == 1 and first.plan_revision == 1 and first.ttl_seconds == 5
    same = routing_document(MODEL, two_region_plan(), ttl_seconds=5, previous=first)
    assert same is first
    moved = routing_document(
        MODEL, two_region_plan({"us-east": {"eu-west": 1.0}}, revision=2), ttl_seconds=5, previous=same
    )
    assert (
        moved.generation == 2 and moved.routes == {"us-east": {"eu-west": 1.0}} and moved.plan_revision == 2
    )
    slower = routing_document(
        MODEL, two_region_plan({"us-east": {"eu-west": 1.0}}, revision=2), ttl_seconds=30, previous=moved
    )
    assert slower.generation == 3
    # A draft's own generation never matters: the previous one decides.
    assert succeed(slower, document({"us-east": {"us-east": 1.0}}, generation=99)).generation == 4


def test_a_table_adds_replaces_and_drops_documents() -> None:
    a = document({"us-east": {"us-east": 1.0}})
    b = a.model_copy(update={"model": "other"})
    table = RoutingTable().with_document(a).with_document(b)
    assert sorted(table.documents) == [MODEL, "other"]
    newer = succeed(a, document({"us-east": {"eu-west": 1.0}}))
    assert table.with_document(newer).documents[MODEL].generation == 2
    assert sorted(table.without(MODEL).documents) == ["other"]
    assert table.without("absent") == table


# ---- a region for a caller --------------------------------------------------------------------


def test_a_source_with_one_region_always_gets_it() -> None:
    doc = document({"us-east": {"us-east": 1.0}, "eu-west": {"eu-west": 0.5, "us-east": 0.5}})
    rng = random.Random(0)
    assert {pick_region(doc, "us-east", rng=rng) for _ in range(50)} == {"us-east"}


def test_regions_are_drawn_in_proportion_to_the_fractions() -> None:
    doc = document({"eu-west": {"eu-west": 0.75, "us-east": 0.25}})
    rng = random.Random(7)
    drawn = Counter(pick_region(doc, "eu-west", rng=rng) for _ in range(4000))
    assert abs(drawn["eu-west"] / 4000 - 0.75) < 0.03 and set(drawn) == {"eu-west", "us-east"}
    keyed = Counter(pick_region(doc, "eu-west", key=f"user-{i}") for i in range(4000))
    assert abs(keyed["eu-west"] / 4000 - 0.75) < 0.03


def test_a_key_always_gets_the_same_region_and_differs_from_the_set_draw() -> None:
    doc = document({"eu-west": {"eu-west": 0.5, "us-east": 0.5}})
    for i in range(20):
        picks = {pick_region(doc, "eu-west", key=f"user-{i}", rng=random.Random(j)) for j in range(5)}
        assert len(picks) == 1
    # Salted: the region draw is not the router's sticky set draw (the first 8 bytes of the
    # bare key's sha256), so the keys sent to one region still split 50/50 over two sets there.
    keys = [f"user-{i}" for i in range(2000)]
    east = [k for k in keys if pick_region(doc, "eu-west", key=k) == "us-east"]
    first_set = [k for k in east if int.from_bytes(hashlib.sha256(k.encode()).digest()[:8], "big") < 2**63]
    assert abs(len(first_set) / len(east) - 0.5) < 0.06


def test_an_unknown_or_missing_source_draws_from_every_source_pooled() -> None:
    doc = document({"us-east": {"us-east": 1.0}, "eu-west": {"eu-west": 1.0}})
    rng = random.Random(3)
    assert Counter(pick_region(doc, None, rng=rng) for _ in range(400)).keys() == {"us-east", "eu-west"}
    assert pick_region(doc, "ap-south", key="k") in {"us-east", "eu-west"}
    one = document({"us-east": {"eu-west": 1.0}})
    assert pick_region(one, None) == "eu-west" and pick_region(one, "mars") == "eu-west"


def test_a_document_that_routes_nowhere_picks_nothing() -> None:
    assert pick_region(document({}), "us-east") is None
    assert pick_region(document({}), None, key="k") is None


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.dictionaries(
        st.sampled_from(["us-east", "eu-west", "ap-south"]),
        st.dictionaries(
            st.sampled_from(["us-east", "eu-west", "ap-south"]),
            st.floats(min_value=0.01, max_value=1.0),
            min_size=1,
        ),
        min_size=1,
    ),
    st.sampled_from(["us-east", "eu-west", "ap-south", None]),
    st.one_of(st.none(), st.text(max_size=8)),
)
def test_the_picked_region_is_one_the_source_is_routed_to(
    routes: dict[str, dict[str, float]], source: str | None, key: str | None
) -> None:
    doc = document(routes)
    region = pick_region(doc, source, key, random.Random(0))
    allowed = set(routes[source]) if source in routes else {r for row in routes.values() for r in row}
    assert region in allowed


def test_the_fallback_order_is_the_draw_then_the_sources_row_then_the_other_sources_regions() -> None:
    """A caller whose region is lost tries its own row's other regions by fraction first, then
    the regions the plan gives other sources (by pooled fraction): a source routed only to its
    own region still has somewhere to go."""
    doc = document(
        {
            "us-east": {"us-east": 0.6, "eu-west": 0.1, "ap-south": 0.3},
            "eu-west": {"eu-west": 1.0},
            "sa-east": {"sa-east": 1.0},
        }
    )
    for key in ("user-1", "user-2", "user-3"):
        first = pick_region(doc, "us-east", key=key)
        order = fallback_order(doc, "us-east", key=key)
        assert order[0] == first
        rest = [r for r in ["us-east", "ap-south", "eu-west"] if r != first]
        assert order == [first, *rest, "sa-east"]
    local = document({"us-east": {"us-east": 1.0}, "eu-west": {"eu-west": 0.5, "ap-south": 0.5}})
    assert fallback_order(local, "us-east") == ["us-east", "ap-south", "eu-west"]  # ties by name
    assert fallback_order(document({}), "us-east") == []


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.dictionaries(
        st.sampled_from(["us-east", "eu-west", "ap-south"]),
        st.dictionaries(
            st.sampled_from(["us-east", "eu-west", "ap-south"]),
            st.floats(min_value=0.01, max_value=1.0),
            min_size=1,
        ),
        min_size=1,
    ),
    st.sampled_from(["us-east", "eu-west", "ap-south", None]),
    st.one_of(st.none(), st.text(max_size=8)),
)
def test_the_fallback_order_lists_every_serving_region_once_starting_with_the_pick(
    routes: dict[str, dict[str, float]], source: str | None, key: str | None
) -> None:
    doc = document(routes)
    order = fallback_order(doc, source, key, random.Random(0))
    assert sorted(order) == sorted({r for row in doc.routes.values() for r in row})
    assert order[0] == pick_region(doc, source, key, random.Random(0))


# ---- its route --------------------------------------------------------------------------------


def test_the_routing_path_is_built_and_parsed_in_one_place() -> None:
    assert routing_path(MODEL) == "/models/feed-ranker/routing"
    assert routing_model_of(routing_path(MODEL)) == MODEL
    # Serve keeps the full path and puts the app's route prefix in root_path.
    assert routing_model_of("/models/feed-ranker/routing", "/models") == MODEL
    assert routing_model_of("/models/models/routing", "/models") == "models"
    for other in (
        "/models/feed-ranker",
        "/models//routing",
        "/us-east/models/x/routing",
        "/models/a/b/routing",
    ):
        assert routing_model_of(other, "/models") is None, other
    assert predict_path(MODEL, "eu-west") == "/eu-west/models/feed-ranker/predict"


# ---- rendered into the Serve config and answered ----------------------------------------------


def test_the_routing_app_renders_into_a_valid_serve_config_and_reads_back() -> None:
    table = RoutingTable().with_document(routing_document(MODEL, two_region_plan(), ttl_seconds=5))
    app = render_routing_app(table)
    assert app["name"] == ROUTING_APP and app["route_prefix"] == "/"  # routing documents and the OpenAI door
    assert not app["name"].startswith(f"{MODEL}.")  # a model's teardown removes `<model>.*` apps
    ServeDeploySchema.model_validate(render_serve_config({ROUTING_APP: app}, "127.0.0.1", 8000))
    assert deployed_routing(app) == table
    assert deployed_routing(None) == RoutingTable()


def test_the_routing_app_runs_on_the_head_node_and_a_per_region_cluster_has_a_proxy_per_node() -> None:
    """The one global ingress must outlive any region's node: it asks for the resource Ray gives
    the head alone; and a cluster of region nodes answers through each node's proxy."""
    app = render_routing_app(RoutingTable())
    [deployment] = app["deployments"]
    assert deployment["ray_actor_options"]["resources"] == {HEAD_NODE_RESOURCE: pytest.approx(0.001)}
    assert not any(key.startswith("region:") for key in deployment["ray_actor_options"]["resources"])
    every_node = render_serve_config({ROUTING_APP: app}, "127.0.0.1", 8000, proxy_location="EveryNode")
    assert ServeDeploySchema.model_validate(every_node).proxy_location == "EveryNode"
    assert render_serve_config({}, "127.0.0.1", 8000)["proxy_location"] == "HeadOnly"


async def _get(service: RoutingService, path: str, method: str = "GET") -> tuple[int, dict[str, object]]:
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": "/models",
        "query_string": b"",
        "headers": [],
    }
    response = await service(Request(scope))
    return response.status_code, json.loads(bytes(response.body))


async def test_the_routing_service_answers_a_document_and_404_naming_an_unknown_model() -> None:
    service = RoutingService.func_or_class()  # type: ignore[attr-defined]
    doc = routing_document(MODEL, two_region_plan(), ttl_seconds=5)
    service.reconfigure(RoutingTable().with_document(doc).model_dump(mode="json"))
    status, body = await _get(service, "/models/feed-ranker/routing")
    assert status == 200 and RoutingDocument.model_validate(body) == doc
    assert service.generation(MODEL) == 1 and service.generation("absent") == 0
    status, body = await _get(service, "/models/absent/routing")
    assert status == 404 and "'absent'" in str(body["message"])
    assert (await _get(service, "/models/feed-ranker"))[0] == 404
    assert (await _get(service, "/models/feed-ranker/routing", method="POST"))[0] == 405
    service.reconfigure(RoutingTable().model_dump(mode="json"))  # in place: the model's doc is gone
    assert (await _get(service, "/models/feed-ranker/routing"))[0] == 404


@pytest.mark.parametrize("ttl", [0, -1])
def test_a_document_needs_a_positive_ttl(ttl: float) -> None:
    with pytest.raises(ValueError, match="ttl_seconds"):
        RoutingDocument(model=MODEL, generation=1, ttl_seconds=ttl, routes={})
