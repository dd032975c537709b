"""Ray's token authentication on the running stack (issue 19): a Ray client with a wrong token,
and one with authentication off, are refused by the cluster itself; the stack's token connects;
the dashboard agent's job API (which would run a shell command) answers 401 without the token.
Each client is a process of its own: Ray reads its token once per process."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from ipnext.client.devstack.stack import stack_processes
from ipnext.spec.settings import Settings
from ipnext.store.ray_token import LOOPBACK_ENV, MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV, loopback_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# How long a connected probe waits for a node's dashboard agent to register its port.
AGENT_PORT_WITHIN_S = 60.0
# A Ray driver that connects, or says how it was refused; connected, it names the node's
# dashboard agent (the job API's HTTP port).
_PROBE = """
import json, sys
import ray
from ipnext.names import PollTimeoutError, wait_until
try:
    ray.init(address=sys.argv[1], log_to_driver=False)
except BaseException as err:
    print(json.dumps({"ok": False, "error": f"{type(err).__name__}: {err}"[-1500:]}))
    sys.exit(0)
# A node's agent port is known once its agent registered: a fresh run once read it too early
# (no valid port: "Servname not supported").
def registered():
    return [n for n in ray.nodes() if n["Alive"] and (n.get("DashboardAgentListenPort") or 0) > 0]
try:
    nodes = wait_until(registered, bool, timeout_s=float(sys.argv[2]), interval_s=0.5, what="an agent's port")
except PollTimeoutError:
    print(json.dumps({"ok": True, "agent": None, "nodes": repr(ray.nodes())[-1500:]}))
    sys.exit(0)
node = nodes[0]
print(json.dumps({"ok": True, "agent": [node["NodeManagerAddress"], node["DashboardAgentListenPort"]]}))
"""


def _probe(address: str, auth: dict[str, str], home: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != LOOPBACK_ENV}
    # Its own home: a client must never find (or write) a ~/.ray/auth_token of this machine.
    env.update(auth, HOME=str(home))
    env.update(loopback_env(address))  # what any driver of a loopback cluster needs (ray_token.py)
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, address, str(AGENT_PORT_WITHIN_S)],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, (done.returncode, done.stdout[-1500:], done.stderr[-1500:])
    answer: dict[str, Any] = json.loads(lines[-1])
    answer["stderr"] = done.stderr[-3000:]
    return answer


def _said(answer: dict[str, Any]) -> str:
    """The line of a refused client's output that names the authentication failure."""
    lines = (answer["error"] + "\n" + answer["stderr"]).splitlines()
    return next((line.strip()[:200] for line in lines if "uthenticat" in line), answer["error"][:200])


def test_ray_refuses_clients_without_the_stacks_token(stack: Settings, tmp_path: Path) -> None:
    address = stack.ray_address()
    token_file = stack.ray_token_file()
    assert token_file is not None and token_file.stat().st_mode & 0o077 == 0, token_file
    # The three clients at once: a refused one spends most of its time in Ray's own retries
    # before it gives up, waiting, not working (one after another they took 43 s of the suite).
    auths = [
        {MODE_ENV: "token", TOKEN_PATH_ENV: str(token_file)},
        {MODE_ENV: "token", TOKEN_ENV: "0" * 64},
        {MODE_ENV: "disabled"},
    ]
    with ThreadPoolExecutor(len(auths)) as pool:
        right, wrong, off = pool.map(lambda auth: _probe(address, auth, tmp_path), auths)
    assert right["ok"], right
    for name, answer in (("wrong token", wrong), ("auth disabled", off)):
        assert not answer["ok"], (name, answer)
        said = (answer["error"] + answer["stderr"]).lower()
        # The server's refusal, not the client's "no token found".
        assert "unauthenticated" in said or "authentication" in said, (name, answer)
        assert "no token found" not in said and "token_auth_enabled_but_no_token" not in said, (name, said)
    assert not (tmp_path / ".ray" / "auth_token").exists()  # Ray made no token of its own

    assert right["agent"] is not None, f"no node's dashboard agent registered its port: {right}"
    host, port = right["agent"]
    # Its own port (dev stack), not Ray's fixed 52365: a second Ray on the machine held that once,
    # and this agent came up without its HTTP server.
    assert port != 52365, right
    job = {"entrypoint": "echo pwned", "submission_id": "ipnext-auth-drill"}
    refused = httpx.post(f"http://{host}:{port}/api/job_agent/jobs/", json=job, timeout=30)
    token = token_file.read_text().strip()
    allowed = httpx.get(
        f"http://{host}:{port}/api/job_agent/jobs/ipnext-auth-drill/logs",
        headers={"authorization": f"Bearer {token}"},
        timeout=30,
    )
    print(
        f"ray token: wrong token refused ({_said(wrong)}); auth off refused ({_said(off)}); "
        f"job API without the token {refused.status_code}, with it {allowed.status_code} (no such job)"
    )
    assert refused.status_code == 401, refused.text
    assert allowed.status_code != 401, allowed.text  # the token passes the check (the job does not exist)


def _listening(pid: int) -> list[str]:
    """The addresses (host:port) on which process `pid` listens for TCP connections."""
    inodes = set()
    try:
        for fd in (Path("/proc") / str(pid) / "fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:  # the process ended meanwhile
        return []
    found = []
    for table in ("tcp", "tcp6"):
        for line in (Path("/proc") / str(pid) / "net" / table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # The kernel writes each 32-bit word in host order (little-endian here).
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            host = ipaddress.ip_address(words)
            if isinstance(host, ipaddress.IPv6Address) and host.ipv4_mapped is not None:
                host = host.ipv4_mapped
            found.append(f"{host}:{int(port, 16)}")
    return found


def _title(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def test_every_port_of_the_stack_listens_on_loopback_only(stack: Settings) -> None:
    """The dev stack is one machine: Temporal, Serve's proxy, and every Ray process (the GCS,
    raylets, agents, and the metrics servers that answer without a token) listen on 127.0.0.1
    alone. The one exception Ray gives no setting for: each Serve replica's inter-deployment
    gRPC server, which Serve binds to `[::]:0` itself (ray/serve/_private/replica.py); at most
    that one port per replica, documented in docs/operations/security.md."""
    record = json.loads((stack.state_dir / "dev.json").read_text())
    by_process = {pid: _listening(pid) for pid in stack_processes(record["stack_id"])}
    listening = sorted({address for addresses in by_process.values() for address in addresses})
    exposed = {
        pid: [a for a in addresses if not ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback]
        for pid, addresses in by_process.items()
    }
    replicas = {pid: ports for pid, ports in exposed.items() if _title(pid).startswith("ray::ServeReplica")}
    print(
        f"dev stack: {len(listening)} listening ports over {len(by_process)} processes; beyond loopback "
        f"only Serve's inter-deployment gRPC of {sum(1 for p in replicas.values() if p)} replicas"
    )
    assert len(listening) >= 5, by_process  # Temporal, Serve, the GCS, a raylet, an agent at least
    others = {pid: (_title(pid), ports) for pid, ports in exposed.items() if ports and pid not in replicas}
    assert not others, others
    assert all(len(ports) <= 1 for ports in replicas.values()), replicas
