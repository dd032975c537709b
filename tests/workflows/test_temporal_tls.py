"""The Temporal TLS path end to end, through a mutual-TLS terminator of the test's own in front of
the dev server: a worker, the SDK and the CLI connect with the configured CA, client certificate
and key, and server name (and the FleetWorkflow they reach records each sender's identity header
beside `who`, a raw client's change as unattributed); a client without the certificate, trusting
another CA, or not naming the server is refused, and `ipnext model publish` without credentials
exits 2 in one line."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import yaml
from temporalio.client import Client
from temporalio.worker import Worker

from ipnext.activities.regions import RegionActivities
from ipnext.client.fleet import ensure_fleet_workflow, mark_region
from ipnext.client.sdk import Client as IpnextClient
from ipnext.client.temporal import connect_client
from ipnext.client.worker import INTERCEPTORS, WORKFLOWS
from ipnext.contracts.fleet import RegionDownInput, RegionHealth
from ipnext.contracts.identity import UNATTRIBUTED
from ipnext.errors import TemporalConnectionError
from ipnext.names import poll_until
from ipnext.spec.settings import RegionSettings, Settings, TemporalSettings, TemporalTLSSettings

from .fakes import SPEC
from .test_fleet_workflow import FakeRegions, region, until
from .tls_terminator import SERVER_NAME, Authority, Pem, TlsTerminator

pytestmark = pytest.mark.timeout(120)

DEV_FLEET = Path(__file__).resolve().parents[2] / "config" / "fleet.dev.yaml"  # has eu-west


class Credentials:
    """The test's PKI: the CA the terminator's certificate and the client's chain to, a client
    certificate of it, and another CA that signed neither."""

    def __init__(self, folder: Path) -> None:
        self.ca = Authority(folder, "ipnext-test-ca")
        self.server: Pem = self.ca.issue(SERVER_NAME, server=True)
        self.client: Pem = self.ca.issue("ipnext-test-operator", server=False)
        self.other_ca = Authority(folder, "some-other-ca")


@pytest_asyncio.fixture(loop_scope="session")
async def terminator(temporal: Client, tmp_path: Path) -> AsyncIterator[tuple[TlsTerminator, Credentials]]:
    credentials = Credentials(tmp_path)
    proxy = TlsTerminator(
        upstream=temporal.service_client.config.target_host,
        server=credentials.server,
        client_ca=credentials.ca.pem.cert,
    )
    await proxy.start()
    try:
        yield proxy, credentials
    finally:
        await proxy.stop()


def _temporal(address: str, queue: str, **tls: object) -> TemporalSettings:
    return TemporalSettings(address=address, task_queue=queue, tls=TemporalTLSSettings(**tls))  # type: ignore[arg-type]


def _mutual(address: str, queue: str, pki: Credentials, ca: Path) -> TemporalSettings:
    """Mutual TLS with the client's certificate, trusting `ca`, naming the server's certificate."""
    return _temporal(
        address,
        queue,
        ca_file=ca,
        cert_file=pki.client.cert,
        key_file=pki.client.key,
        server_name=SERVER_NAME,
    )


def _config_file(folder: Path, temporal: dict[str, object]) -> Path:
    """An ipnext.yaml for the CLI: the `temporal` section (paths relative to the file), and a
    fleet file naming eu-west (the CLI checks a region against it before sending anything)."""
    path = folder / f"ipnext-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump({"temporal": temporal, "fleet_file": str(DEV_FLEET)}))
    return path


async def _cli(config: Path, *args: str, identity: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("IPNEXT_") and k != "TEMPORAL_ADDRESS"}
    env["IPNEXT_CONFIG"] = str(config)
    if identity:
        env["IPNEXT_TEMPORAL__IDENTITY"] = identity
    argv = [sys.executable, "-m", "ipnext.client.cli", *args]
    return await asyncio.to_thread(subprocess.run, argv, env=env, capture_output=True, text=True, timeout=90)


async def test_worker_sdk_and_cli_connect_through_mutual_tls_and_identities_are_recorded(
    temporal: Client, terminator: tuple[TlsTerminator, Credentials], tmp_path: Path
) -> None:
    proxy, pki = terminator
    queue = f"tls-{uuid.uuid4().hex[:8]}"
    temporal_settings = _mutual(proxy.address, queue, pki, pki.ca.pem.cert)
    settings = Settings(temporal=temporal_settings, regions=RegionSettings(check_seconds=0.5))
    started = time.monotonic()
    fake = FakeRegions()
    worker_client = await connect_client(settings)  # as run_worker connects
    worker = Worker(
        worker_client,
        task_queue=queue,
        workflows=WORKFLOWS,
        activities=[
            fake.check,
            fake.route,
            fake.collect,
            fake.solve,
            RegionActivities(worker_client).cancel_scheduled_replan,
        ],
        interceptors=INTERCEPTORS,
    )
    async with worker:
        await ensure_fleet_workflow(worker_client, settings)  # as the worker starts it, through TLS
        await until(temporal, lambda s: len(s.regions) == 3)
        # The SDK, through TLS, with an identity of its own.
        async with await IpnextClient.connect(settings, identity="sdk-operator") as ipn:
            await ipn.region_down("eu-west", reason="drill over TLS", who="alice")
        # The CLI, through TLS, its settings from a config file (certificate paths relative to it).
        config = _config_file(
            tmp_path,
            {
                "address": proxy.address,
                "task_queue": queue,
                "tls": {
                    "ca_file": pki.ca.pem.cert.name,
                    "cert_file": pki.client.cert.name,
                    "key_file": pki.client.key.name,
                    "server_name": SERVER_NAME,
                },
            },
        )
        up = await _cli(config, "fleet", "region", "up", "eu-west", "--who", "bob", identity="cli-operator")
        assert up.returncode == 0, up.stderr
        # A raw Temporal client (as the Temporal UI or the `temporal` CLI send): no identity header.
        await mark_region(temporal, RegionDownInput(region="us-west", reason="raw client", who="carol"))
        listed = await _cli(config, "fleet", "regions")
        status = await until(temporal, lambda s: len(s.events) == 3)
    print(f"TLS path: worker, SDK and 2 CLI commands in {time.monotonic() - started:.1f} s")
    assert listed.returncode == 0, listed.stderr
    assert [(e.region, e.health, e.who, e.identity) for e in status.events] == [
        ("eu-west", RegionHealth.DOWN, "alice", "sdk-operator"),
        ("eu-west", RegionHealth.UP, "bob", "cli-operator"),
        ("us-west", RegionHealth.DOWN, "carol", UNATTRIBUTED),
    ]
    assert region(status, "us-west").identity == UNATTRIBUTED
    assert "by carol [unattributed]: raw client" in listed.stdout, listed.stdout
    assert "by bob [sent as cli-operator]" in listed.stdout, listed.stdout
    # Every connection through the terminator presented the configured client certificate.
    assert proxy.accepted and set(proxy.accepted) == {"ipnext-test-operator"}, proxy.accepted
    assert proxy.refused == [], proxy.refused


async def test_a_client_without_the_certificate_or_trusting_another_ca_is_refused(
    terminator: tuple[TlsTerminator, Credentials], tmp_path: Path
) -> None:
    proxy, pki = terminator
    queue = f"tls-{uuid.uuid4().hex[:8]}"
    refusals = {
        "no client certificate": _temporal(
            proxy.address, queue, ca_file=pki.ca.pem.cert, server_name=SERVER_NAME
        ),
        "another CA trusted": _mutual(proxy.address, queue, pki, pki.other_ca.pem.cert),
        "no server name (the certificate does not carry 127.0.0.1)": _temporal(
            proxy.address, queue, ca_file=pki.ca.pem.cert, cert_file=pki.client.cert, key_file=pki.client.key
        ),
        "plaintext": TemporalSettings(address=proxy.address, task_queue=queue),
    }

    async def refusals_seen() -> int:
        return len(proxy.refused)

    for what, temporal_settings in refusals.items():
        started, seen = time.monotonic(), len(proxy.refused)
        with pytest.raises(TemporalConnectionError) as refused:
            await connect_client(Settings(temporal=temporal_settings))
        print(f"{what}: refused in {time.monotonic() - started:.1f} s: {refused.value}")
        assert f"cannot connect to Temporal at {proxy.address}" in str(refused.value)
        # The terminator saw this handshake fail (by its own check, or by the client's alert),
        # a moment after the client gave up.
        await poll_until(
            refusals_seen, lambda n, seen=seen: n > seen, timeout_s=20, interval_s=0.05, what=what
        )
        if what == "no client certificate":  # the server's own requirement refused it
            assert proxy.refused[seen] == "PEER_DID_NOT_RETURN_A_CERTIFICATE", proxy.refused
    print("the terminator refused:", proxy.refused)
    assert proxy.accepted == [], proxy.accepted
    # Publish without credentials: one line, exit 2, before anything is sent.
    spec = tmp_path / "model.yaml"
    spec.write_text(yaml.safe_dump(SPEC.model_dump(mode="json", exclude_defaults=True)))
    config = _config_file(
        tmp_path,
        {
            "address": proxy.address,
            "task_queue": queue,
            "tls": {"ca_file": str(pki.ca.pem.cert), "server_name": SERVER_NAME},
        },
    )
    published = await _cli(config, "model", "publish", str(spec))
    assert published.returncode == 2, published.stderr
    assert "Traceback" not in published.stderr and len(published.stderr.strip().splitlines()) == 1
    assert published.stderr.startswith("ipnext: cannot connect to Temporal at")
    assert proxy.accepted == []
