"""fleet.yaml (regions, hardware, pools, latency) and ipnext.yaml settings with environment overrides."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from ipnext.errors import SpecError, StackError
from ipnext.spec.fleet import Fleet, load_fleet
from ipnext.spec.reading import parse_spec
from ipnext.spec.settings import load_settings
from tests.unit.helpers import DEV_FLEET, REPO, fleet_dict


def parse_fleet(data: dict[str, Any]) -> Fleet:
    return parse_spec(Fleet, data, source="fleet.yaml")


# --- fleet ------------------------------------------------------------------------------------


def test_dev_fleet_loads() -> None:
    fleet = load_fleet(DEV_FLEET)
    assert fleet.regions == ["us-east", "eu-west"]
    assert sorted(fleet.hardware) == ["cpu-highmem", "cpu-std"]
    assert {h.kind for h in fleet.hardware.values()} == {"cpu"}
    assert len(fleet.pools) == 4
    assert {(p.region, p.hardware) for p in fleet.pools} == {
        (r, h) for r in ("us-east", "eu-west") for h in ("cpu-std", "cpu-highmem")
    }


def test_pool_lookup() -> None:
    fleet = load_fleet(DEV_FLEET)
    pool = fleet.pool("eu-west", "cpu-highmem")
    assert pool is not None
    assert (pool.units, pool.unit_cost) == (8, 1.7)
    assert fleet.pool("eu-west", "gpu") is None
    assert fleet.pool("ap-south", "cpu-std") is None


def test_latency() -> None:
    fleet = load_fleet(DEV_FLEET)
    assert fleet.latency("us-east", "eu-west") == 40
    assert fleet.latency("eu-west", "us-east") == 40
    assert fleet.latency("us-east", "us-east") == 1  # stated, so not the 0 default


def test_latency_defaults_zero_to_self_and_infinite_elsewhere() -> None:
    data = fleet_dict()
    data["latency_ms"] = {"us-east": {"eu-west": 25}}
    fleet = parse_fleet(data)
    assert fleet.latency("us-east", "eu-west") == 25
    assert fleet.latency("us-east", "us-east") == 0.0
    assert fleet.latency("eu-west", "eu-west") == 0.0
    assert math.isinf(fleet.latency("eu-west", "us-east"))


def test_pool_in_unknown_region_is_rejected() -> None:
    data = fleet_dict()
    data["pools"].append({"region": "ap-south", "hardware": "cpu-std", "units": 4, "unit_cost": 1})
    with pytest.raises(SpecError) as info:
        parse_fleet(data)
    message = str(info.value)
    assert "pools.4.region" in message
    assert "'ap-south'" in message


def test_pool_with_unknown_hardware_is_rejected() -> None:
    data = fleet_dict()
    data["pools"][1]["hardware"] = "gpu-h100"
    with pytest.raises(SpecError) as info:
        parse_fleet(data)
    message = str(info.value)
    assert "pools.1.hardware" in message
    assert "'gpu-h100'" in message


def test_duplicate_pool_is_rejected() -> None:
    data = fleet_dict()
    data["pools"].append({"region": "eu-west", "hardware": "cpu-std", "units": 2, "unit_cost": 1})
    with pytest.raises(SpecError) as info:
        parse_fleet(data)
    message = str(info.value)
    assert "pools.4" in message
    assert "second pool for (eu-west, cpu-std)" in message


def test_duplicate_regions_are_rejected() -> None:
    data = fleet_dict()
    data["regions"] = ["us-east", "eu-west", "us-east"]
    with pytest.raises(SpecError) as info:
        parse_fleet(data)
    message = str(info.value)
    assert "regions: duplicate" in message
    assert "'us-east'" in message


def test_duplicate_region_keys_in_yaml_are_rejected(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(DEV_FLEET.read_text().replace("  cpu-highmem: {kind: cpu}\n", "  cpu-std: {kind: gpu}\n"))
    with pytest.raises(SpecError) as info:
        load_fleet(path)
    assert "duplicate name 'cpu-std'" in str(info.value)


def test_latency_for_unknown_region_is_rejected() -> None:
    data = fleet_dict()
    data["latency_ms"]["us-east"]["mars"] = 3
    with pytest.raises(SpecError) as info:
        parse_fleet(data)
    assert "latency_ms: 'mars'" in str(info.value)


def test_negative_latency_is_rejected() -> None:
    data = fleet_dict()
    data["latency_ms"]["us-east"]["eu-west"] = -1
    with pytest.raises(SpecError) as info:
        parse_fleet(data)
    assert "latency_ms.us-east.eu-west: -1" in str(info.value)


@pytest.mark.parametrize(
    ("field", "value", "where"),
    [("units", 0, "pools.0.units"), ("unit_cost", -1, "pools.0.unit_cost")],
)
def test_pool_bounds(field: str, value: float, where: str) -> None:
    data = fleet_dict()
    data["pools"][0][field] = value
    with pytest.raises(SpecError) as info:
        parse_fleet(data)
    assert where in str(info.value)
    assert f"(got {value!r})" in str(info.value)
    assert info.value.field == where


@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("pools.0.unit_cost", math.inf),
        ("pools.1.unit_cost", math.nan),
        ("latency_ms.us-east.eu-west", math.inf),
    ],
)
def test_inf_and_nan_in_the_fleet_are_refused(where: str, value: float) -> None:
    data = fleet_dict()
    *path, last = where.split(".")
    node: Any = data
    for key in path:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value
    with pytest.raises(SpecError) as info:
        parse_fleet(data)
    assert info.value.field == where
    assert f"{where}: Input should be a finite number" in str(info.value)


def test_hardware_kind_is_checked() -> None:
    data = fleet_dict()
    data["hardware"]["cpu-std"]["kind"] = "tpu"
    with pytest.raises(SpecError) as info:
        parse_fleet(data)
    assert "hardware.cpu-std.kind" in str(info.value)
    assert "'tpu'" in str(info.value)


# --- settings ---------------------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No outside configuration leaks in: no address variables, no IPNEXT_*; cwd is empty."""
    for name in ("TEMPORAL_ADDRESS", "RAY_ADDRESS", "IPNEXT_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    for name in list(os.environ):
        if name.startswith("IPNEXT_"):
            monkeypatch.delenv(name, raising=False)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return monkeypatch


def write_config(folder: Path, data: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "ipnext.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_relative_paths_resolve_against_the_files_folder(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    conf = tmp_path / "conf"
    path = write_config(
        conf,
        {
            "fleet_file": "fleet.yaml",
            "snapshot_roots": ["../snaps", "more"],
            "freeze_calendar": "freeze.yaml",
            "state_dir": "../state",
            "temporal_dev_file": "dev/temporal.yaml",
            "pinned_dir": "../pins",
        },
    )
    settings = load_settings(path)
    assert settings.fleet_file == (conf / "fleet.yaml").resolve()
    assert settings.snapshot_roots == [(tmp_path / "snaps").resolve(), (conf / "more").resolve()]
    assert settings.freeze_calendar == (conf / "freeze.yaml").resolve()
    assert settings.state_dir == (tmp_path / "state").resolve()
    assert settings.temporal_dev_file == (conf / "dev" / "temporal.yaml").resolve()
    assert settings.ray_address_file == (tmp_path / "state" / "ray-address").resolve()
    assert settings.pinned_store() == (tmp_path / "pins").resolve()


def test_absolute_paths_are_kept(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    elsewhere = (tmp_path / "abs" / "fleet.yaml").resolve()
    path = write_config(tmp_path / "conf", {"fleet_file": str(elsewhere)})
    assert load_settings(path).fleet_file == elsewhere


def test_ipnext_config_env_names_the_file(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = write_config(tmp_path / "conf", {"serve": {"port": 8123}})
    clean_env.setenv("IPNEXT_CONFIG", str(path))
    assert load_settings().serve.port == 8123


def test_defaults_without_any_file(clean_env: pytest.MonkeyPatch) -> None:
    settings = load_settings()
    assert settings.serve.port == 8000
    assert settings.serve.host == "127.0.0.1"
    assert settings.temporal_address == "127.0.0.1:7233"
    assert settings.serve_url == "http://127.0.0.1:8000"
    assert settings.pinned_store() == (Path(".ipnext") / "pinned").resolve()  # under the state folder


def test_repo_config_loads(clean_env: pytest.MonkeyPatch) -> None:
    settings = load_settings(REPO / "config" / "ipnext.yaml")
    assert settings.fleet_file == (REPO / "config" / "fleet.dev.yaml").resolve()
    assert settings.snapshot_roots == [(REPO / ".ipnext" / "snapshots").resolve()]
    assert settings.temporal_address == "127.0.0.1:7233"
    assert settings.fleet().regions == ["us-east", "eu-west"]


def test_temporal_address_env_overrides_the_file(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = write_config(tmp_path / "conf", {"temporal": {"address": "file-host:7233"}})
    assert load_settings(path).temporal_address == "file-host:7233"
    clean_env.setenv("TEMPORAL_ADDRESS", "env-host:7999")
    settings = load_settings(path)
    assert settings.temporal.address == "env-host:7999"
    assert settings.temporal_address == "env-host:7999"


def test_ray_address_env_overrides_the_file(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = write_config(tmp_path / "conf", {"ray": {"address": "ray://file:10001"}})
    assert load_settings(path).ray_address() == "ray://file:10001"
    clean_env.setenv("RAY_ADDRESS", "ray://env:10001")
    settings = load_settings(path)
    assert settings.ray.address == "ray://env:10001"
    assert settings.ray_address() == "ray://env:10001"


def test_ray_address_falls_back_to_the_state_file(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = write_config(tmp_path / "conf", {"state_dir": "state"})
    settings = load_settings(path)
    with pytest.raises(StackError, match="RAY_ADDRESS is not set"):
        settings.ray_address()
    (tmp_path / "conf" / "state").mkdir()
    (tmp_path / "conf" / "state" / "ray-address").write_text("10.0.0.5:6379\n")
    assert settings.ray_address() == "10.0.0.5:6379"


def test_serve_port_env_overrides_the_file_and_keeps_other_keys(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = write_config(tmp_path / "conf", {"serve": {"host": "0.0.0.0", "port": 8000}})
    clean_env.setenv("IPNEXT_SERVE__PORT", "8001")
    settings = load_settings(path)
    assert settings.serve.port == 8001
    assert settings.serve.host == "0.0.0.0"
    assert settings.serve_url == "http://0.0.0.0:8001"


def test_temporal_address_defaults_to_the_dev_file(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    (conf / "dev").mkdir(parents=True)
    (conf / "dev" / "temporal.yaml").write_text("ip: 10.1.2.3\nport: 7999\nui_port: 8999\n")
    path = write_config(conf, {"temporal_dev_file": "dev/temporal.yaml", "temporal": {"namespace": "ns"}})
    settings = load_settings(path)
    assert settings.temporal.address is None
    assert settings.temporal_address == "10.1.2.3:7999"
    assert settings.ui_url == "http://10.1.2.3:8999/namespaces/ns"


def test_bad_temporal_dev_file_is_a_spec_error(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "temporal.yaml").write_text("port: 99999\n")
    path = write_config(conf, {"temporal_dev_file": "temporal.yaml"})
    with pytest.raises(SpecError) as info:
        _ = load_settings(path).temporal_address
    assert "port" in str(info.value)
    assert "99999" in str(info.value)


def test_inf_in_ipnext_yaml_is_a_spec_error(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = write_config(tmp_path, {"serve": {"reconcile_seconds": math.inf}})
    with pytest.raises(SpecError) as info:
        load_settings(path)
    assert info.value.field == "serve.reconcile_seconds"
    assert "finite number" in str(info.value)


def test_unknown_key_in_ipnext_yaml_is_a_spec_error(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # BUG: errors.py documents SpecError for a malformed ipnext.yaml, but load_settings
    # builds Settings(**data) directly, so a typo surfaces as a raw pydantic ValidationError.
    path = write_config(tmp_path / "conf", {"serve": {"port": 8000}, "snapshot_root": ["x"]})
    with pytest.raises(SpecError) as info:
        load_settings(path)
    assert "snapshot_root" in str(info.value)
