"""API keys: the keys file, the check every HTTP door makes, the client's key, the writer's
rendering of the doors, and the router and routing app refusing before anything runs."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from starlette.requests import Request

from ipnext.contracts.routing import RoutingDocument, RoutingTable
from ipnext.errors import SpecError
from ipnext.serving import routing_app as routing_module
from ipnext.serving.layout import (
    ROUTER_IMPORT_PATH,
    ROUTING_IMPORT_PATH,
    SET_IMPORT_PATH,
    RouterAppArgs,
    with_keys_file,
    without_keys_file,
)
from ipnext.spec.settings import load_settings
from ipnext.store.keys import API_KEY_ENV, KeyCheck, add_key, client_key, hash_key, read_keys

from . import test_router_doors as doors
from .test_router_doors import reply, request

build = doors.build  # the router with fake parts, as the doors' tests build it (a fixture)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_key_is_shown_once_and_only_its_hash_is_kept_owner_readable(tmp_path: Path) -> None:
    keys = tmp_path / "state" / "api-keys.yaml"
    key = add_key(keys, "ranking-team", ["feed-ranker", "ranking-*"])
    assert key.startswith("ipn_") and len(key) > 40
    text = keys.read_text()
    assert key not in text and hash_key(key) in text
    assert stat.S_IMODE(keys.stat().st_mode) == 0o600
    second = add_key(keys, "ops", ["*"])
    assert [k.name for k in read_keys(keys).keys] == ["ranking-team", "ops"] and second != key
    with pytest.raises(SpecError, match="'ops' is given twice"):
        add_key(keys, "ops", ["*"])
    with pytest.raises(SpecError, match="models"):
        add_key(keys, "bad", ["Not A Model"])
    assert [k.name for k in read_keys(keys).keys] == ["ranking-team", "ops"]  # nothing half-written


def test_the_cli_adds_a_key_shows_it_once_and_lists_names_only(tmp_path: Path) -> None:
    config = tmp_path / "ipnext.yaml"
    config.write_text(yaml.safe_dump({"state_dir": "state"}))

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "ipnext.client.cli", "--config", str(config), "auth", *argv]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    added = cli("add-key", "team", "--models", "feed-*", "m1")
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip().splitlines()[-1]
    assert KeyCheck(tmp_path / "state" / "api-keys.yaml").refuse(f"Bearer {key}", "feed-ranker") is None
    listed = cli("list")
    assert listed.stdout == "team: feed-*, m1\n" and key not in listed.stdout
    again = cli("add-key", "team", "--models", "x")
    assert (
        again.returncode == 2 and "'team' is given twice" in again.stderr and "Traceback" not in again.stderr
    )


def test_a_malformed_keys_file_is_named_with_its_field(tmp_path: Path) -> None:
    keys = tmp_path / "api-keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [{"name": "a", "sha256": "not-hex", "models": ["*"]}]}))
    with pytest.raises(SpecError, match=r"api-keys.yaml is invalid: .*sha256") as raised:
        read_keys(keys)
    assert raised.value.field == "auth.keys_file"
    with pytest.raises(SpecError, match="cannot read"):
        read_keys(tmp_path / "missing.yaml")


def test_the_check_answers_401_403_or_lets_through(tmp_path: Path) -> None:
    keys = tmp_path / "api-keys.yaml"
    team = add_key(keys, "ranking-team", ["feed-ranker", "ranking-*"])
    ops = add_key(keys, "ops", ["*"])
    check = KeyCheck(keys)
    assert check.refuse(None, "feed-ranker") == (
        401,
        "an API key is required: send Authorization: Bearer <key>",
    )
    assert check.refuse(f"Basic {team}", "feed-ranker")[0] == 401  # type: ignore[index]
    assert check.refuse("Bearer ", "feed-ranker")[0] == 401  # type: ignore[index]
    assert check.refuse("Bearer ipn_guessed", "feed-ranker") == (
        401,
        "the API key is not known (revoked, or mistyped)",
    )
    assert check.refuse(f"Bearer {team}", "feed-ranker") is None
    assert check.refuse(f"bearer {team}", "ranking-v2") is None  # a prefix; the scheme in any case
    assert check.refuse(f"Bearer {team}", "ads-ranker") == (
        403,
        "the API key 'ranking-team' may not call model 'ads-ranker'",
    )
    assert check.refuse(f"Bearer {ops}", "ads-ranker") is None


def test_keys_added_or_revoked_take_effect_without_a_restart_and_a_lost_file_closes_the_door(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "api-keys.yaml"
    first = add_key(keys, "first", ["*"])
    clock = Clock()
    check = KeyCheck(keys, recheck_s=1.0, clock=clock)
    assert check.refuse(f"Bearer {first}", "m") is None
    second = add_key(keys, "second", ["*"])
    assert check.refuse(f"Bearer {second}", "m")[0] == 401  # type: ignore[index]  # read at most every second
    clock.now += 1.0
    assert check.refuse(f"Bearer {second}", "m") is None
    data = yaml.safe_load(keys.read_text())
    data["keys"] = [k for k in data["keys"] if k["name"] != "first"]  # revoked
    keys.write_text(yaml.safe_dump(data))
    clock.now += 1.0
    assert check.refuse(f"Bearer {first}", "m")[0] == 401  # type: ignore[index]
    keys.unlink()
    clock.now += 1.0
    status, message = check.refuse(f"Bearer {second}", "m")  # type: ignore[misc]
    assert status == 503 and "cannot be read" in message and check.last_error is not None
    keys.write_text("keys: [")  # not YAML: still closed
    clock.now += 1.0
    assert check.refuse(f"Bearer {second}", "m")[0] == 503  # type: ignore[index]


def test_the_client_key_comes_from_the_environment_then_the_key_file(tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    assert client_key(key_file, {}) is None
    key_file.write_text("ipn_fromfile\n")
    assert client_key(key_file, {}) == "ipn_fromfile"
    assert client_key(key_file, {API_KEY_ENV: "ipn_fromenv"}) == "ipn_fromenv"
    assert client_key(None, {}) is None


def test_settings_put_the_keys_in_the_state_folder_unless_told_and_can_turn_auth_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("IPNEXT_AUTH__ENABLED", raising=False)
    config = tmp_path / "conf" / "ipnext.yaml"
    config.parent.mkdir()
    config.write_text(yaml.safe_dump({"state_dir": "state"}))
    settings = load_settings(config)
    assert settings.keys_file() == (tmp_path / "conf" / "state" / "api-keys.yaml").resolve()
    assert settings.api_key_file() == (tmp_path / "conf" / "state" / "api-key").resolve()
    config.write_text(yaml.safe_dump({"auth": {"keys_file": "secrets/keys.yaml", "api_key_file": "k"}}))
    settings = load_settings(config)
    assert settings.keys_file() == (tmp_path / "conf" / "secrets" / "keys.yaml").resolve()
    assert settings.api_key_file() == (tmp_path / "conf" / "k").resolve()
    config.write_text(yaml.safe_dump({"auth": {"enabled": False}}))
    assert load_settings(config).keys_file() is None


def test_the_writer_tells_every_door_its_keys_file_and_undoes_it_on_adoption() -> None:
    apps: dict[str, dict[str, Any]] = {
        "m.us-east": {
            "name": "m.us-east",
            "import_path": ROUTER_IMPORT_PATH,
            "args": {"model": "m", "region": "us-east"},
        },
        "routing": {"name": "routing", "import_path": ROUTING_IMPORT_PATH, "args": {}},
        "m.us-east.s1.r1": {"name": "m.us-east.s1.r1", "import_path": SET_IMPORT_PATH, "args": {"x": 1}},
    }
    assert with_keys_file(apps, None) is apps  # auth off: the config renders as before
    keyed = with_keys_file(apps, "/keys.yaml")
    assert keyed["m.us-east"]["args"] == {"model": "m", "region": "us-east", "keys_file": "/keys.yaml"}
    assert keyed["routing"]["args"] == {"keys_file": "/keys.yaml"}
    assert keyed["m.us-east.s1.r1"] == apps["m.us-east.s1.r1"]  # not a door: untouched
    assert apps["m.us-east"]["args"] == {"model": "m", "region": "us-east"}  # the held apps: unchanged
    assert {name: without_keys_file(app) for name, app in keyed.items()} == apps
    assert RouterAppArgs.model_validate(keyed["m.us-east"]["args"]).keys_file == "/keys.yaml"


async def test_the_router_refuses_without_a_key_before_anything_and_counts_nothing(
    build: Any, tmp_path: Path
) -> None:
    keys = tmp_path / "api-keys.yaml"
    mine = add_key(keys, "mine", ["m"])
    other = add_key(keys, "other", ["not-m"])
    router, counted, _ = build(reply({"u": 1}), reply([0.5]))
    router._keys = KeyCheck(keys)
    body = b'{"inputs": {"user": 1}}'
    for headers, status in (({}, 401), ({"authorization": f"Bearer {other}"}, 403)):
        response = await router(request(body, headers))
        answer = json.loads(response.body)
        assert response.status_code == status and set(answer) == {"error_id", "message"}, answer
        # The description and the demand are the model's too.
        for path in ("/us-east/models/m", "/us-east/models/m/demand"):
            described = await router(_get(path, headers))
            assert described.status_code == status, described.body
    assert counted.latencies == [] and router._demand == {}
    allowed = await router(request(body, {"authorization": f"Bearer {mine}"}))
    assert allowed.status_code == 200 and len(counted.latencies) == 1


async def test_the_routing_document_needs_a_key_for_its_model(tmp_path: Path) -> None:
    keys = tmp_path / "api-keys.yaml"
    mine = add_key(keys, "mine", ["m"])
    service = routing_module.RoutingService.func_or_class(str(keys))
    document = RoutingDocument(model="m", generation=1, ttl_seconds=5, routes={"us-east": {"us-east": 1.0}})
    service.reconfigure(RoutingTable(documents={"m": document}).model_dump(mode="json"))
    assert (await service(_get("/models/m/routing", {}))).status_code == 401
    assert (
        await service(_get("/models/other/routing", {"authorization": f"Bearer {mine}"}))
    ).status_code == 403
    answer = await service(_get("/models/m/routing", {"authorization": f"Bearer {mine}"}))
    assert answer.status_code == 200 and json.loads(answer.body)["model"] == "m"


def _get(path: str, headers: dict[str, str]) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    scope = {"type": "http", "method": "GET", "path": path, "headers": raw, "query_string": b""}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    return Request(scope, receive)


def _unread(method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[Request, list[bool]]:
    """A request that notes whether its body was read."""
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    scope = {"type": "http", "method": method, "path": path, "headers": raw, "query_string": b""}
    read: list[bool] = []

    async def receive() -> dict[str, Any]:
        read.append(True)
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(scope, receive), read


async def test_every_door_of_the_routing_app_asks_for_the_key_before_reading_or_routing(
    tmp_path: Path,
) -> None:
    """No key, or an unknown one: 401 on every route, the OpenAI door's included, before the body
    is read or the path looked up (a malformed body is not a 400, an unknown path not a 404, and
    GET /v1/models does not answer an empty list). With a known key the same requests get their
    own answers; a key for another model gets its 403 once the body names the model."""
    keys = tmp_path / "api-keys.yaml"
    mine = add_key(keys, "mine", ["m"])
    service = routing_module.RoutingService.func_or_class(str(keys))
    service.reconfigure(RoutingTable(documents={}).model_dump(mode="json"))
    doors = [
        ("POST", "/v1/chat/completions", b"{not json"),
        ("POST", "/us-east/v1/completions", b'{"model": "m", "prompt": "hi"}'),
        ("GET", "/v1/models", b""),
        ("GET", "/metrics", b""),
        ("GET", "/models/m/routing", b""),
        ("GET", "/nowhere", b""),
    ]
    for headers in ({}, {"authorization": "Bearer not-a-key"}, {"authorization": "Basic abc"}):
        for method, path, body in doors:
            request_, read = _unread(method, path, headers, body)
            answer = await service(request_)
            assert answer.status_code == 401, (path, headers, answer.body)
            assert read == [], f"{path}: the body was read before the key was checked"
            if "/v1/" in path:  # OpenAI's shape, so the openai client raises AuthenticationError
                assert json.loads(answer.body)["error"]["code"] == "invalid_api_key"
    known = {"authorization": f"Bearer {mine}"}
    expected = {"/v1/chat/completions": 400, "/v1/models": 200, "/metrics": 403, "/nowhere": 404}
    for method, path, body in doors:
        if path in expected:
            answer = await service(_unread(method, path, known, body)[0])
            assert answer.status_code == expected[path], (path, answer.body)
