"""Temporal client credentials: the `temporal.tls` and API key settings are checked where they are
read (a certificate without its key, an unreadable file, a key that would travel in plaintext),
and the one client factory really sends the API key: a plain local gRPC server stands in for
Temporal and records each call's metadata (the dev server ignores API keys, so it cannot show it)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from temporalio.api.workflowservice.v1 import GetSystemInfoResponse

from ipnext.client.temporal import API_KEY_ENV, connect_client, temporal_connection
from ipnext.errors import SpecError, TemporalConnectionError
from ipnext.spec.settings import Settings, TemporalSettings, TemporalTLSSettings, load_settings

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _no_key_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("IPNEXT_") or name == "TEMPORAL_ADDRESS":
            monkeypatch.delenv(name, raising=False)


def _config(tmp_path: Path, temporal: dict[str, Any]) -> Path:
    path = tmp_path / "conf" / "ipnext.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"temporal": temporal}))
    return path


def test_a_client_certificate_without_its_key_is_refused_naming_both_fields(tmp_path: Path) -> None:
    for given, missing in (("cert_file", "key_file"), ("key_file", "cert_file")):
        path = _config(tmp_path, {"address": "temporal.example:7233", "tls": {given: "client.pem"}})
        with pytest.raises(SpecError) as refused:
            load_settings(path)
        message = str(refused.value)
        assert f"temporal.tls.{given} is set but temporal.tls.{missing} is not" in message, message
        assert f"Fix: set temporal.tls.{missing} too" in message, message
        assert refused.value.field is not None and refused.value.field.startswith("temporal.tls")


def test_tls_files_are_relative_to_the_config_file_and_read_at_connect(tmp_path: Path) -> None:
    path = _config(
        tmp_path,
        {
            "address": "temporal.example:7233",
            "tls": {"ca_file": "ca.pem", "cert_file": "tls/client.pem", "key_file": "tls/client.key"},
            "api_key_file": "temporal.key",
        },
    )
    settings = load_settings(path)
    tls = settings.temporal.tls
    assert tls is not None and tls.ca_file == (path.parent / "ca.pem").resolve()
    assert tls.cert_file == (path.parent / "tls" / "client.pem").resolve()
    assert settings.temporal.api_key_file == (path.parent / "temporal.key").resolve()
    # None of them exists yet: the first one read is named, with the fix.
    with pytest.raises(SpecError) as refused:
        temporal_connection(settings, environ={})
    assert refused.value.field == "temporal.tls.ca_file"
    assert "cannot read" in str(refused.value) and "Fix: point temporal.tls.ca_file" in str(refused.value)
    (path.parent / "tls").mkdir()
    for name, text in {"ca.pem": "CA", "tls/client.pem": "CERT", "tls/client.key": "KEY"}.items():
        (path.parent / name).write_text(f"-----BEGIN {text}-----\n")
    (path.parent / "temporal.key").write_text("")
    with pytest.raises(SpecError) as empty:
        temporal_connection(settings, environ={})
    assert empty.value.field == "temporal.api_key_file"
    (path.parent / "temporal.key").write_text("key-from-file\n")
    connection = temporal_connection(settings, environ={})
    assert connection.tls is not None and connection.tls.client_cert == b"-----BEGIN CERT-----\n"
    assert connection.api_key == "key-from-file"
    # The environment's key wins over the file's; neither appears in what is logged.
    overridden = temporal_connection(settings, environ={API_KEY_ENV: "key-from-env"})
    assert overridden.api_key == "key-from-env"
    assert "key-from" not in overridden.describe() and "with an API key" in overridden.describe()


def test_an_api_key_never_crosses_the_network_in_plaintext() -> None:
    remote = Settings(temporal=TemporalSettings(address="temporal.example:7233"))
    with pytest.raises(SpecError) as refused:
        temporal_connection(remote, environ={API_KEY_ENV: "secret"})
    assert refused.value.field == "temporal.tls" and "plaintext" in str(refused.value)
    assert "secret" not in str(refused.value)
    # Over TLS (system roots: `tls: {}`), or to this machine, it may be sent.
    over_tls = remote.model_copy(
        update={"temporal": TemporalSettings(address="temporal.example:7233", tls=TemporalTLSSettings())}
    )
    assert temporal_connection(over_tls, environ={API_KEY_ENV: "secret"}).api_key == "secret"
    for address in ("127.0.0.1:7233", "localhost:7233", "[::1]:7233"):
        local = Settings(temporal=TemporalSettings(address=address))
        assert temporal_connection(local, environ={API_KEY_ENV: "secret"}).api_key == "secret"
    # Without a key the dev server's loopback plaintext default is untouched; TLS to it is refused.
    assert temporal_connection(Settings(), environ={}).tls is None
    with pytest.raises(SpecError) as dev_server:
        temporal_connection(Settings(temporal=TemporalSettings(tls=TemporalTLSSettings())), environ={})
    assert dev_server.value.field == "temporal.address" and "without TLS" in str(dev_server.value)


class _RecordingTemporal(grpc.GenericRpcHandler):
    """Answers `GetSystemInfo` (what a client calls as it connects) and records every call's
    metadata; any other call is refused as unimplemented."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str | bytes]]] = []

    def service(self, handler_call_details: Any) -> Any:
        self.calls.append((handler_call_details.method, dict(handler_call_details.invocation_metadata)))
        if handler_call_details.method.endswith("/GetSystemInfo"):
            return grpc.unary_unary_rpc_method_handler(
                lambda request, context: GetSystemInfoResponse().SerializeToString()
            )
        return None


@pytest.fixture
def recording_temporal() -> Iterator[tuple[str, _RecordingTemporal]]:
    recorder = _RecordingTemporal()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[recorder])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", recorder
    finally:
        server.stop(grace=None)


async def test_the_client_sends_the_api_key_as_a_bearer_token(
    recording_temporal: tuple[str, _RecordingTemporal], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    address, recorder = recording_temporal
    key_file = tmp_path / "temporal.key"
    key_file.write_text("key-from-file\n")
    settings = Settings(temporal=TemporalSettings(address=address, api_key_file=key_file))
    await connect_client(settings)
    monkeypatch.setenv(API_KEY_ENV, "key-from-env")
    await connect_client(settings)
    monkeypatch.delenv(API_KEY_ENV)
    await connect_client(Settings(temporal=TemporalSettings(address=address)))
    system_info = [metadata for method, metadata in recorder.calls if method.endswith("/GetSystemInfo")]
    print("calls seen:", [method for method, _ in recorder.calls])
    assert [m.get("authorization") for m in system_info] == [
        "Bearer key-from-file",
        "Bearer key-from-env",
        None,
    ], system_info


async def test_a_refused_connection_is_a_temporal_connection_error_naming_the_fix(
    recording_temporal: tuple[str, _RecordingTemporal],
) -> None:
    address, _ = recording_temporal
    # A plaintext server where TLS is configured: the handshake fails.
    tls = Settings(temporal=TemporalSettings(address=address, tls=TemporalTLSSettings()))
    with pytest.raises(TemporalConnectionError) as refused:
        await connect_client(tls)
    message = str(refused.value)
    print(message)
    assert f"cannot connect to Temporal at {address} (namespace default, TLS)" in message, message
    assert "temporal.tls.ca_file" in message and refused.value.field == "temporal"
