"""What a failed drill prints of its stack: each model's state, rollout and reconcile record,
every Serve app and deployment with its status and message, the dev stack's components, and
the last lines of the worker's and the supervisor's logs. So the next reader can tell a loaded
machine from a defect without running the drill again.

The live parts (Temporal, Ray) are read by one process of its own (`python -m` this module),
which may attach to the stack's Ray whatever Ray the test process holds, and prints each
section as soon as it has it; cut at `LOOK_TIMEOUT_S`, it still gives what it printed, and a
section that fails says why in its place. The log tails are read here."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ipnext.spec.settings import Settings, load_settings

LOOK_TIMEOUT_S = 120.0  # one child process; on a machine at load 40 its imports alone take 20 s
LOG_LINES = 40
MODELS_SHOWN = 4  # the test's own model first, then the others the stack holds
# The fields of a model's state that say where it stands.
_MODEL_FIELDS = ("state", "serving_set", "serving_apps", "queued", "pending_plan", "active_rollout")
_ROLLOUT_FIELDS = ("state", "step", "traffic_percent", "steps_done", "detail")


def stack_config_of(funcargs: dict[str, Any]) -> Path | None:
    """The config file of the stack a test ran on, from its fixtures: the shared stack's
    settings (their source) or `stack_config`, or an own stack's object with a `config`."""
    for value in funcargs.values():
        if isinstance(value, Settings) and value.source is not None:
            return value.source
        config = getattr(value, "config", None)
        if isinstance(config, Path) and config.suffix == ".yaml":
            return config
    config = funcargs.get("stack_config")
    return config if isinstance(config, Path) else None


def describe(config: Path, model: str | None = None) -> str:
    """The report for the stack of `config`, as text."""
    settings = load_settings(config)
    env = {k: v for k, v in os.environ.items() if k not in ("TEMPORAL_ADDRESS", "RAY_ADDRESS")}
    env["IPNEXT_CONFIG"] = str(config)
    command = [
        sys.executable,
        "-m",
        "tests.integration.stack_state",
        str(config),
        *([model] if model else []),
    ]
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=LOOK_TIMEOUT_S, cwd=_REPO
        )
        live = done.stdout + (
            f"\n-- the look failed (exit {done.returncode}):\n{done.stderr[-2000:]}"
            if done.returncode
            else ""
        )
    except subprocess.TimeoutExpired as cut:
        printed = cut.stdout.decode(errors="replace") if isinstance(cut.stdout, bytes) else cut.stdout or ""
        live = f"{printed}\n-- cut after {LOOK_TIMEOUT_S:g} s: what is above is all that answered"
    lines = [f"-- stack of {config}", live.rstrip()]
    for log in ("worker.log", "supervisor.log"):
        lines.extend(_tail(settings.state_dir / "logs" / log))
    return "\n".join(lines)


_REPO = Path(__file__).resolve().parents[2]


def _tail(path: Path) -> Iterator[str]:
    if not path.exists():
        yield f"-- {path.name}: none"
        return
    with path.open("rb") as log:
        log.seek(0, os.SEEK_END)
        log.seek(max(0, log.tell() - 512 * 1024))
        lines = condensed(log.read().decode(errors="replace").splitlines())[-LOG_LINES:]
    yield f"-- last {len(lines)} lines of {path.name} (tracebacks cut to their error, repeats counted)"
    yield from (f"  {line}" for line in lines)


def condensed(lines: list[str]) -> list[str]:
    """A log's lines with each Python traceback cut to its error line, and a line alike but for
    its numbers (times, ids) to one of the last few kept left out and counted: a Ray thread that fails every
    few seconds filled the whole tail of a failed drill's report with one traceback (CI, stop
    54), and what the worker had done was not in it."""
    kept: list[str] = []
    in_traceback = False
    for line in lines:
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
            continue
        if in_traceback and (line.startswith((" ", "\t")) or not line.strip()):
            continue  # a frame, its source line, or its ^^^ marks
        in_traceback = False
        kept.append(line)
    out: list[str] = []
    left_out = 0
    for line in kept:
        if any(_shape(line) == _shape(seen) for seen in out[-4:]):
            left_out += 1  # a line of a loop that the last few lines already show
            continue
        if left_out:
            out.append(f"({left_out} more line(s) like those above)")
            left_out = 0
        out.append(line)
    if left_out:
        out.append(f"({left_out} more line(s) like those above)")
    return out


def _shape(line: str) -> str:
    """The line without what changes between repeats of it: hex ids, then every number."""
    return re.sub(r"\d+", "0", re.sub(r"\b[0-9a-f]{8,}\b", "#", line))


def model_lines(state: dict[str, Any]) -> Iterator[str]:
    """A model's state (`ModelState` as JSON) in the few lines that say where it stands."""
    for name in _MODEL_FIELDS:
        if state.get(name) not in (None, [], {}):
            yield f"  {name}: {json.dumps(state[name])}"
    plan = state.get("plan") or {}
    if plan:
        regions = sorted({r for p in (plan.get("deployments") or {}).values() for r in p.get("replicas", {})})
        yield f"  plan: revision {plan.get('revision')}, regions {regions}"
    yield from rollout_lines(state.get("rollout") or {}, "rollout (the model's record)")
    if state.get("reconcile"):
        yield f"  reconcile: {json.dumps(state['reconcile'])[:1500]}"


def rollout_lines(rollout: dict[str, Any], title: str = "live rollout") -> Iterator[str]:
    """A rollout's status (`RolloutStatus` as JSON): state, step, split, its last gate reading
    and its last pause (a rollout held for traffic, a freeze or on-call says so there)."""
    if not rollout:
        return
    yield f"  {title}: {json.dumps({k: rollout[k] for k in _ROLLOUT_FIELDS if k in rollout})}"
    gates = rollout.get("gates") or []
    if gates:
        yield f"    last gate: {json.dumps(gates[-1])[:400]}"
    pauses = rollout.get("pauses") or []
    if pauses:
        yield f"    last pause: {json.dumps(pauses[-1])[:400]}"


# -- the child process: the live sections, each printed as soon as it is read


def _say(line: str = "") -> None:
    print(line, flush=True)


def _dev_status(settings: Settings) -> None:
    from ipnext.client.devstack.stack import process_alive

    record_file = settings.state_dir / "dev.json"
    if not record_file.exists():
        _say("-- dev stack: no record (not up)")
        return
    record = json.loads(record_file.read_text())
    _say("-- dev stack components")
    for name, entry in sorted((record.get("processes") or {}).items()):
        pid = entry.get("pid") if isinstance(entry, dict) else entry
        alive = isinstance(pid, int) and process_alive(pid)
        _say(f"  {name}: pid {pid} {'alive' if alive else 'DEAD'}")
    holds = sorted(p.name for p in (settings.state_dir / "holds").glob("*"))
    if holds:
        _say(f"  held: {holds}")


async def _models(settings: Settings, first: str | None) -> None:
    from ipnext.client.sdk import Client
    from ipnext.client.temporal import stuck_reason
    from ipnext.names import model_workflow_id

    async with await Client.connect(settings) as client:
        names = [m.name for m in await client.list_models()]
        if first is not None:
            names = [first, *(n for n in names if n != first)]
        for name in names[:MODELS_SHOWN]:
            try:
                state = (await client.get_model(name)).model_dump(mode="json")
            except Exception as err:
                _say(f"-- model {name}: {type(err).__name__}: {str(err)[:300]}")
                continue
            _say(f"-- model {name}")
            for line in model_lines(state):
                _say(line)
            if state.get("state") == "rolling_out":  # the running rollout's own view: its pauses, its step
                try:
                    live = await client.rollout_status(name)
                except Exception as err:
                    _say(f"  live rollout: {type(err).__name__}: {str(err)[:300]}")
                else:
                    for line in rollout_lines(live.model_dump(mode="json") if live else {}):
                        _say(line)
                stale = await stuck_reason(client.temporal, model_workflow_id(name))
                if stale:
                    _say(f"  model workflow stuck: {stale[:400]}")
        if len(names) > MODELS_SHOWN:
            _say(f"-- ({len(names) - MODELS_SHOWN} more models not shown)")


def _serve_apps(settings: Settings) -> None:
    if not settings.ray_address_file.exists():
        _say("-- Serve apps: no Ray address file (Ray not up)")
        return
    from ipnext.store.ray_token import loopback_env, ray_auth_env

    address = settings.ray_address_file.read_text().strip()
    os.environ.update(ray_auth_env(settings) | loopback_env(address))  # before Ray is imported
    import ray
    from ray import serve

    from ipnext.serving.app_health import status_word as word

    ray.init(
        address=address,
        namespace="ipnext",
        log_to_driver=False,
        logging_level="ERROR",
    )
    _say("-- Serve apps")
    for name, app in sorted(serve.status().applications.items()):
        _say(f"  {name}: {word(app.status)} {(app.message or '')[:400]}".rstrip())
        for deployment, d in sorted(app.deployments.items()):
            replicas = ", ".join(f"{word(s)} {n}" for s, n in sorted(d.replica_states.items()))
            _say(
                (
                    f"    {deployment}: {word(d.status)} ({word(d.status_trigger)}; {replicas}) "
                    f"{(d.message or '')[:400]}"
                ).rstrip()
            )


def _main(argv: list[str]) -> None:
    settings = load_settings(Path(argv[0]))
    model = argv[1] if len(argv) > 1 else None
    looks: list[tuple[str, Any]] = [
        ("dev stack", lambda: _dev_status(settings)),
        ("models", lambda: asyncio.run(asyncio.wait_for(_models(settings, model), LOOK_TIMEOUT_S / 3))),
        ("Serve apps", lambda: _serve_apps(settings)),
    ]
    for title, look in looks:
        try:
            look()
        except Exception as err:  # each look alone: one that fails leaves the others
            _say(f"-- {title}: {type(err).__name__}: {str(err)[:400]}")


if __name__ == "__main__":
    _main(sys.argv[1:])
