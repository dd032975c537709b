"""model.yaml: parsing, DAG checks, field bounds, names, and the checks against fleet and factories.

One file over 600 lines on purpose: the cases share one spec builder and follow the spec's own
order, section by section, as its reference does."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from ipnext.errors import SpecError
from ipnext.spec.fleet import Fleet
from ipnext.spec.model import (
    MAX_IN_FLIGHT,
    MAX_REPLICA_QPS,
    MAX_SECONDS,
    ModelSpec,
    RolloutSpec,
    SnapshotSetRequest,
    check_against_fleet,
    check_factories,
    import_factory,
    load_model_spec,
)
from ipnext.spec.reading import parse_spec
from tests.unit.helpers import EXAMPLE_SPEC, REPO, fleet_dict, spec_dict


def parse(data: dict[str, Any]) -> ModelSpec:
    return parse_spec(ModelSpec, data, source="model.yaml")


def rejected(data: dict[str, Any]) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse(data)
    return info.value


# --- the example ------------------------------------------------------------------------------


def test_example_spec_loads_with_its_values() -> None:
    spec = load_model_spec(EXAMPLE_SPEC)
    assert spec.name == "feed-ranker"
    assert spec.sync == "synchronized"
    assert sorted(spec.parts) == ["dense", "embed"]
    assert spec.parts["embed"].hardware["cpu-highmem"].units == 2
    assert spec.parts["dense"].hardware["cpu-std"].qps == 300
    assert spec.traffic.peak_qps == {"us-east": 60, "eu-west": 30}
    assert spec.latency_budget_ms == 50
    assert spec.rollout.steps == [10, 50, 100] and spec.rollout.bake_seconds == 3  # demo-sized
    assert RolloutSpec().steps == [1, 5, 25, 50, 100] and RolloutSpec().bake_seconds == 60  # defaults


def test_example_topological_order() -> None:
    assert load_model_spec(EXAMPLE_SPEC).topological_order() == ["embed", "dense"]


def test_example_upstream() -> None:
    spec = load_model_spec(EXAMPLE_SPEC)
    assert spec.upstream("dense") == ["embed"]
    assert spec.upstream("embed") == ["input"]
    assert spec.upstream("output") == ["dense"]


def test_topological_order_of_a_diamond_puts_each_part_after_its_upstreams() -> None:
    data = spec_dict()
    part = data["parts"]["dense"]
    data["parts"] = {"a": part, "b": part, "c": part}
    data["dag"] = [["input", "b"], ["input", "a"], ["a", "c"], ["b", "c"], ["c", "output"]]
    order = parse(data).topological_order()
    assert order == ["a", "b", "c"]


def test_topological_order_of_a_chain_ignores_name_order() -> None:
    data = spec_dict()
    part = data["parts"]["dense"]
    data["parts"] = {"zeta": part, "alpha": part}
    data["dag"] = [["input", "zeta"], ["zeta", "alpha"], ["alpha", "output"]]
    assert parse(data).topological_order() == ["zeta", "alpha"]


def test_load_model_spec_of_a_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(SpecError, match="file not found") as info:
        load_model_spec(path)
    assert str(path) in str(info.value)


def test_load_model_spec_names_the_file_of_an_invalid_spec(tmp_path: Path) -> None:
    path = tmp_path / "model.yaml"
    path.write_text(EXAMPLE_SPEC.read_text().replace("latency_budget_ms: 50", "latency_budget_ms: -5"))
    with pytest.raises(SpecError) as info:
        load_model_spec(path)
    assert str(path) in str(info.value)
    assert "latency_budget_ms" in str(info.value)
    assert info.value.field == "latency_budget_ms"
    assert info.value.value == -5


# --- the DAG ----------------------------------------------------------------------------------


def test_cycle_is_rejected() -> None:
    data = spec_dict()
    data["dag"] = [["input", "embed"], ["embed", "dense"], ["dense", "embed"], ["dense", "output"]]
    err = rejected(data)
    assert "cycle" in str(err)
    # The cycle is named edge by edge, starting from whichever node the search met first.
    assert re.search(r"cycle (embed -> dense -> embed|dense -> embed -> dense)", str(err))


def test_edge_to_unknown_part_is_rejected() -> None:
    data = spec_dict()
    data["dag"] = [["input", "embed"], ["embed", "dense"], ["embed", "ghost"], ["dense", "output"]]
    err = rejected(data)
    assert "unknown node 'ghost'" in str(err)
    assert "dag.2" in str(err)


def test_part_off_every_path_is_rejected() -> None:
    data = spec_dict()
    data["parts"]["orphan"] = data["parts"]["dense"]
    err = rejected(data)
    assert "'orphan' is not on any path from input to output" in str(err)


def test_part_reached_from_input_but_not_reaching_output_is_rejected() -> None:
    data = spec_dict()
    data["parts"]["sink"] = data["parts"]["dense"]
    data["dag"].append(["embed", "sink"])
    err = rejected(data)
    assert "'sink' is not on any path" in str(err)


def test_duplicate_part_names_in_yaml_are_rejected(tmp_path: Path) -> None:
    text = EXAMPLE_SPEC.read_text()
    embed_block = (
        "  embed:\n"
        "    factory: ipnext.examples.click_ranker.parts:EmbeddingPart\n"
        "    hardware: {cpu-std: {units: 1, qps: 10}}\n"
    )
    assert "  dense:\n" in text
    path = tmp_path / "model.yaml"
    path.write_text(text.replace("  dense:\n", embed_block + "  dense:\n", 1))
    with pytest.raises(SpecError) as info:
        load_model_spec(path)
    message = str(info.value)
    assert "duplicate" in message
    assert "'embed'" in message
    assert str(path) in message
    assert info.value.field == "embed"


def test_edge_into_input_is_rejected() -> None:
    data = spec_dict()
    data["dag"].append(["dense", "input"])
    err = rejected(data)
    assert "[dense, input]" in str(err)
    assert "wrong way" in str(err)


def test_edge_out_of_output_is_rejected() -> None:
    data = spec_dict()
    data["dag"].append(["output", "embed"])
    assert "wrong way" in str(rejected(data))


def test_self_loop_is_rejected() -> None:
    data = spec_dict()
    data["dag"].append(["dense", "dense"])
    err = rejected(data)
    assert "self-loop" in str(err)
    assert "[dense, dense]" in str(err)


def test_duplicate_edge_is_rejected() -> None:
    data = spec_dict()
    data["dag"].append(["embed", "dense"])
    assert "listed twice" in str(rejected(data))


def test_no_path_from_input_to_output_is_rejected() -> None:
    data = spec_dict()
    data["parts"] = {"embed": data["parts"]["embed"]}
    data["dag"] = [["input", "output"]]
    # input -> output directly is a path, but the part is then on none.
    assert "'embed' is not on any path" in str(rejected(data))


def test_part_named_input_is_rejected() -> None:
    data = spec_dict()
    data["parts"]["input"] = data["parts"].pop("embed")
    data["dag"] = [["input", "dense"], ["dense", "output"]]
    assert "reserved" in str(rejected(data))


# --- bounds on numbers ------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, -0.5])
def test_non_positive_latency_budget_is_rejected(value: float) -> None:
    data = spec_dict()
    data["latency_budget_ms"] = value
    err = rejected(data)
    assert f"latency_budget_ms: Input should be greater than 0 (got {value!r})" in str(err)
    assert err.field == "latency_budget_ms"
    assert err.value == value


@pytest.mark.parametrize("value", [0, -10])
def test_non_positive_peak_qps_is_rejected(value: float) -> None:
    data = spec_dict()
    data["traffic"]["peak_qps"]["eu-west"] = value
    err = rejected(data)
    assert f"traffic.peak_qps.eu-west: Input should be greater than 0 (got {value!r})" in str(err)
    assert err.field == "traffic.peak_qps.eu-west"
    assert err.value == value


def test_empty_peak_qps_is_rejected() -> None:
    data = spec_dict()
    data["traffic"]["peak_qps"] = {}
    err = rejected(data)
    assert "traffic.peak_qps" in str(err)


@pytest.mark.parametrize("value", [0, -2])
def test_non_positive_units_are_rejected(value: int) -> None:
    data = spec_dict()
    data["parts"]["embed"]["hardware"]["cpu-highmem"]["units"] = value
    err = rejected(data)
    assert f"parts.embed.hardware.cpu-highmem.units: Input should be greater than 0 (got {value!r})" in str(
        err
    )
    assert err.field == "parts.embed.hardware.cpu-highmem.units"


@pytest.mark.parametrize("value", [0, -3.5])
def test_non_positive_qps_is_rejected(value: float) -> None:
    data = spec_dict()
    data["parts"]["dense"]["hardware"]["cpu-std"]["qps"] = value
    err = rejected(data)
    assert f"parts.dense.hardware.cpu-std.qps: Input should be greater than 0 (got {value!r})" in str(err)
    assert err.field == "parts.dense.hardware.cpu-std.qps"


def test_every_bad_field_is_named() -> None:
    data = spec_dict()
    data["latency_budget_ms"] = 0
    data["parts"]["dense"]["hardware"]["cpu-std"]["qps"] = 0
    message = str(rejected(data))
    assert "latency_budget_ms" in message
    assert "parts.dense.hardware.cpu-std.qps" in message


def test_unknown_field_is_rejected() -> None:
    data = spec_dict()
    data["latency_budget"] = 10
    err = rejected(data)
    assert "latency_budget: Extra inputs are not permitted" in str(err)


# --- rollout ----------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [[1, 5, 50], [10, 20], [100, 50], [5, 1, 100], [1, 1, 100]])
def test_rollout_steps_must_rise_to_100(steps: list[int]) -> None:
    data = spec_dict()
    data["rollout"] = {"steps": steps}
    err = rejected(data)
    assert "rollout.steps" in str(err)
    assert str(steps) in str(err)
    assert "end at 100" in str(err)


def test_rollout_step_over_100_is_rejected() -> None:
    data = spec_dict()
    data["rollout"] = {"steps": [50, 150]}
    err = rejected(data)
    assert "rollout.steps.1" in str(err)
    assert "150" in str(err)


def test_empty_rollout_steps_are_a_spec_error() -> None:
    # BUG: RolloutSpec._steps_rise_to_100 reads self.steps[-1] of an empty list; the
    # IndexError escapes pydantic and parse_spec instead of becoming a SpecError.
    data = spec_dict()
    data["rollout"] = {"steps": []}
    err = rejected(data)
    assert "rollout" in str(err)


def test_rollout_accepts_custom_steps() -> None:
    data = spec_dict()
    data["rollout"] = {"steps": [10, 100]}
    assert parse(data).rollout.steps == [10, 100]


def test_gate_needs_a_bound() -> None:
    data = spec_dict()
    data["rollout"] = {"gates": [{"metric": "error_rate"}]}
    err = rejected(data)
    assert "gate on error_rate" in str(err)
    assert "max or max_ratio_to_old" in str(err)


# --- names ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Feed-Ranker", "feed#ranker", "1feed", "feed_ranker", ""])
def test_bad_model_name_is_rejected(name: str) -> None:
    data = spec_dict()
    data["name"] = name
    err = rejected(data)
    assert "name: String should" in str(err)
    assert f"(got {name!r})" in str(err)
    assert err.field == "name"


@pytest.mark.parametrize("name", ["Embed", "em#bed"])
def test_bad_part_name_is_rejected(name: str) -> None:
    data = spec_dict()
    data["parts"][name] = data["parts"].pop("embed")
    data["dag"] = [[name if n == "embed" else n for n in edge] for edge in data["dag"]]
    err = rejected(data)
    assert f"parts.{name}" in str(err)
    assert f"(got {name!r})" in str(err)


def test_bad_hardware_name_is_rejected() -> None:
    data = spec_dict()
    data["parts"]["dense"]["hardware"] = {"CPU_STD": {"units": 1, "qps": 10}}
    err = rejected(data)
    assert "parts.dense.hardware.CPU_STD" in str(err)
    assert "(got 'CPU_STD')" in str(err)


def test_bad_factory_string_is_rejected() -> None:
    data = spec_dict()
    data["parts"]["dense"]["factory"] = "not a factory"
    err = rejected(data)
    assert "parts.dense.factory" in str(err)
    assert "'not a factory'" in str(err)


# --- against the fleet ------------------------------------------------------------------------


def test_example_fits_the_dev_fleet(example_spec: ModelSpec, dev_fleet: Fleet) -> None:
    check_against_fleet(example_spec, dev_fleet)  # raises if not


def test_hardware_not_in_fleet_is_rejected(dev_fleet: Fleet) -> None:
    data = spec_dict()
    data["parts"]["dense"]["hardware"] = {"gpu-a100": {"units": 1, "qps": 10}}
    spec = parse(data)
    with pytest.raises(SpecError) as info:
        check_against_fleet(spec, dev_fleet)
    assert info.value.field == "parts.dense.hardware"
    assert info.value.value == "gpu-a100"
    assert "parts.dense.hardware" in str(info.value)
    assert "'gpu-a100'" in str(info.value)
    assert "cpu-std" in str(info.value)  # the fix lists the fleet's classes


def test_traffic_source_not_a_region_is_rejected(dev_fleet: Fleet) -> None:
    data = spec_dict()
    data["traffic"]["peak_qps"]["ap-south"] = 5
    spec = parse(data)
    with pytest.raises(SpecError) as info:
        check_against_fleet(spec, dev_fleet)
    assert info.value.field == "traffic.peak_qps"
    assert info.value.value == "ap-south"
    assert "traffic.peak_qps" in str(info.value)
    assert "'ap-south'" in str(info.value)


def test_min_regions_above_fleet_is_rejected(dev_fleet: Fleet) -> None:
    data = spec_dict()
    data["availability"]["min_regions"] = 3
    spec = parse(data)
    with pytest.raises(SpecError) as info:
        check_against_fleet(spec, dev_fleet)
    assert info.value.field == "availability.min_regions"
    assert info.value.value == 3
    assert "availability.min_regions: 3" in str(info.value)


def peak_at(total: float, survive_region_loss: bool = False) -> dict[str, Any]:
    """The example (dev fleet: embed runs on cpu-highmem, 8 units per region, 2 units and 400 qps
    per replica, so 4 replicas = 1600 qps per region; headroom 0.2) with `total` qps, all us-east."""
    data = spec_dict()
    data["traffic"]["peak_qps"] = {"us-east": total}
    data["availability"]["survive_region_loss"] = survive_region_loss
    return data


@pytest.mark.parametrize(
    "path", sorted(str(p.relative_to(REPO)) for p in REPO.glob("examples/*/model*.yaml"))
)
def test_every_example_spec_fits_the_dev_fleet(path: str, dev_fleet: Fleet) -> None:
    check_against_fleet(load_model_spec(REPO / path), dev_fleet)  # raises if not


def test_traffic_up_to_what_the_whole_fleet_serves_passes_and_above_it_is_refused(dev_fleet: Fleet) -> None:
    # embed is the tighter part: 2 regions x 1600 qps x (1 - 0.2) = 2560 qps.
    check_against_fleet(parse(peak_at(2560)), dev_fleet)
    for total in (2561, 1e9):
        with pytest.raises(SpecError) as info:
            check_against_fleet(parse(peak_at(total)), dev_fleet)
        err = info.value
        assert err.field == "traffic.peak_qps.us-east" and err.value == total
        message = str(err)
        assert message.startswith(f"traffic.peak_qps.us-east: {total:g} qps is more than the whole fleet")
        assert "part embed serves at most 2560 qps" in message, message
        assert "Fix: lower traffic.peak_qps to at most 2560 qps" in message, message


def test_the_part_that_serves_least_bounds_the_model_whatever_its_place(dev_fleet: Fleet) -> None:
    data = peak_at(1e9)
    data["parts"]["dense"]["hardware"]["cpu-std"]["qps"] = 50  # 32 replicas x 50 x 0.8 = 1280 < embed's 2560
    with pytest.raises(SpecError) as info:
        check_against_fleet(parse(data), dev_fleet)
    assert "part dense serves at most 1280 qps" in str(info.value), str(info.value)
    check_against_fleet(parse({**data, "traffic": {"peak_qps": {"us-east": 1280}}}), dev_fleet)


def test_traffic_over_several_regions_names_the_largest_and_the_total(dev_fleet: Fleet) -> None:
    data = spec_dict()
    data["traffic"]["peak_qps"] = {"us-east": 1000, "eu-west": 2000}
    with pytest.raises(SpecError) as info:
        check_against_fleet(parse(data), dev_fleet)
    assert info.value.field == "traffic.peak_qps.eu-west" and info.value.value == 2000
    assert "2000 qps; 3000 qps in all regions" in str(info.value)


def test_surviving_a_region_loss_counts_only_what_the_other_regions_serve(dev_fleet: Fleet) -> None:
    check_against_fleet(parse(peak_at(1280, survive_region_loss=True)), dev_fleet)  # 1600 x 0.8
    with pytest.raises(SpecError) as info:
        check_against_fleet(parse(peak_at(1281, survive_region_loss=True)), dev_fleet)
    assert info.value.field == "traffic.peak_qps.us-east"
    # The dev fleet is symmetric: losing either region leaves the same.
    assert re.search(r"whole fleet can serve once (us-east|eu-west) is lost", str(info.value)), str(
        info.value
    )
    assert "at most 1280 qps" in str(info.value)


def test_surviving_a_region_loss_is_bounded_by_the_loss_that_hurts_most() -> None:
    fleet = fleet_dict()
    for pool in fleet["pools"]:
        if pool["region"] == "eu-west" and pool["hardware"] == "cpu-highmem":
            pool["units"] = 4  # eu-west holds 2 embed replicas (800 qps), us-east 4 (1600 qps)
    smaller = parse_spec(Fleet, fleet)
    check_against_fleet(parse(peak_at(640, survive_region_loss=True)), smaller)  # 800 x 0.8
    with pytest.raises(SpecError) as info:
        check_against_fleet(parse(peak_at(641, survive_region_loss=True)), smaller)
    assert "can serve once us-east is lost: part embed serves at most 640 qps" in str(info.value)


def test_a_replica_that_fits_in_no_pool_is_refused(dev_fleet: Fleet) -> None:
    data = spec_dict()
    data["parts"]["embed"]["hardware"]["cpu-highmem"]["units"] = 9  # the dev pools have 8
    with pytest.raises(SpecError) as info:
        check_against_fleet(parse(data), dev_fleet)
    assert info.value.field == "parts.embed.hardware.cpu-highmem.units" and info.value.value == 9
    assert "the largest cpu-highmem pool has 8" in str(info.value)
    data["parts"]["embed"]["hardware"]["cpu-std"] = {"units": 1, "qps": 100}  # another class fits
    check_against_fleet(parse(data), dev_fleet)


# --- finite and bounded -----------------------------------------------------------------------

INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("traffic.peak_qps.us-east", INF),
        ("traffic.peak_qps.eu-west", NAN),
        ("latency_budget_ms", INF),
        ("parts.dense.hardware.cpu-std.qps", INF),
        ("availability.headroom", NAN),
        ("rollout.bake_seconds", INF),
        ("rollout.gates.0.max", NAN),
        ("rollout.gates.1.floor", INF),
    ],
)
def test_inf_and_nan_are_refused_with_the_field_named(where: str, value: float) -> None:
    data = spec_dict()
    *path, last = where.split(".")
    node: Any = data
    for key in path:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[int(last) if isinstance(node, list) else last] = value
    err = rejected(data)
    assert err.field == where
    assert f"{where}: Input should be a finite number" in str(err)


def test_yaml_inf_in_the_spec_file_is_refused(tmp_path: Path) -> None:
    text = EXAMPLE_SPEC.read_text().replace("peak_qps: {us-east: 60,", "peak_qps: {us-east: .inf,")
    assert ".inf" in text
    path = tmp_path / "model.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_model_spec(path)
    assert info.value.field == "traffic.peak_qps.us-east"
    assert "finite number (got inf)" in str(info.value)


@pytest.mark.parametrize("value", [INF, -INF, NAN])
def test_inf_anywhere_in_a_parts_config_is_refused(value: float) -> None:
    data = spec_dict()
    data["parts"]["dense"]["config"]["schedule"] = {"steps": [1.0, value]}
    err = rejected(data)
    assert err.field == "parts.dense.config"
    assert "config.schedule.steps.1 is not a finite number" in str(err)


@pytest.mark.parametrize(
    ("where", "ceiling"),
    [
        ("rollout.bake_seconds", MAX_SECONDS),
        ("rollout.check_interval_seconds", MAX_SECONDS),
        ("watch.interval_seconds", MAX_SECONDS),
        ("parts.dense.hardware.cpu-std.qps", MAX_REPLICA_QPS),
        ("router.max_ongoing_requests", MAX_IN_FLIGHT),
    ],
)
def test_absurd_values_are_refused_above_their_ceiling(where: str, ceiling: float) -> None:
    def with_value(value: float) -> dict[str, Any]:
        data = spec_dict()
        *path, last = where.split(".")
        node: Any = data
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
        return data

    typed = int if where == "router.max_ongoing_requests" else float
    parse(with_value(typed(ceiling)))  # the ceiling itself is allowed
    err = rejected(with_value(typed(ceiling * 1000)))
    assert err.field == where
    assert f"is above the ceiling of {ceiling:g}" in str(err), str(err)


def test_a_breaker_cooldown_and_a_choices_bound_have_ceilings_too() -> None:
    data = spec_dict()
    data["parts"]["small"] = data["parts"]["dense"]
    data["choices"] = {
        "pick": {
            "variants": {"a": ["dense"], "b": ["small"]},
            "fallback": "a",
            "breaker": {"cooldown_seconds": 1e12},
        }
    }
    data["dag"] = [["input", "embed"], ["embed", "pick"], ["pick", "output"]]
    err = rejected(data)
    assert err.field == "choices.pick.breaker.cooldown_seconds"
    data["choices"]["pick"]["breaker"] = {}
    data["choices"]["pick"]["max_in_flight"] = 10**12
    err = rejected(data)
    assert err.field == "choices.pick.max_in_flight"


# --- versions ---------------------------------------------------------------------------------

REF = {"uri": "file:///s/e", "sha256": "a" * 64, "snapshot_id": "feed-ranker/embed@v1"}


@pytest.mark.parametrize("version", ["v1", "2", "2024-06-01.1", "run_7.final-b", "v" * 128])
def test_versions_of_the_grammar_are_accepted(version: str) -> None:
    request = SnapshotSetRequest(model="feed-ranker", version=version, parts={"embed": REF})
    assert request.version == version


@pytest.mark.parametrize(
    "version",
    [
        "v2\u00e9",
        "\u0432\u0435\u0440\u0441\u0438\u044f",
        "v\uff11",
        "",
        "-v1",
        ".v1",
        "v 1",
        "v1/x",
        "v1\n",
        "v" * 129,
    ],
)
def test_versions_outside_the_grammar_are_refused_with_the_field_named(version: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(SnapshotSetRequest, {"model": "feed-ranker", "version": version, "parts": {"embed": REF}})
    assert info.value.field == "version" and info.value.value == version


# --- factories --------------------------------------------------------------------------------


def test_example_factories_import(example_spec: ModelSpec) -> None:
    check_factories(example_spec)
    from ipnext.examples.click_ranker.parts import DensePart

    assert import_factory("ipnext.examples.click_ranker.parts:DensePart") is DensePart


def test_factory_module_that_does_not_import_is_rejected() -> None:
    data = spec_dict()
    data["parts"]["dense"]["factory"] = "ipnext_no_such_module.sub:Part"
    spec = parse(data)
    with pytest.raises(SpecError) as info:
        check_factories(spec)
    message = str(info.value)
    assert info.value.field == "parts.dense.factory"
    assert info.value.value == "ipnext_no_such_module.sub:Part"
    assert "parts.dense.factory" in message
    assert "'ipnext_no_such_module.sub' does not import" in message
    assert "ModuleNotFoundError" in message


def test_factory_missing_attribute_is_rejected() -> None:
    data = spec_dict()
    data["parts"]["embed"]["factory"] = "ipnext.examples.click_ranker.parts:NoSuchPart"
    spec = parse(data)
    with pytest.raises(SpecError) as info:
        check_factories(spec)
    message = str(info.value)
    assert info.value.field == "parts.embed.factory"
    assert "parts.embed.factory" in message
    assert "no callable 'NoSuchPart'" in message


def test_factory_attribute_that_is_not_callable_is_rejected() -> None:
    with pytest.raises(SpecError, match="no callable '__all__'"):
        import_factory("ipnext.examples.click_ranker.parts:__all__")
