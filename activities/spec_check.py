"""A model's code, run in a process forked for it from a warm checker, with a time and memory limit.

Importing a model's factories runs the model owner's code, and so does building a part with
its weights. Neither runs in the worker: each check runs in a fresh process (a module that
hangs, crashes, leaks, allocates without bound or changes global state harms only that
process, which is killed after its timeout and may use only so much memory), and the
caller's machine never imports the model's code at all (the SDK asks the worker to check).
Before any of it, the worker refuses a factory outside `model_code.factory_prefixes`
(`ipnext.spec.model.check_factories_allowed`); the check refuses one whose callable is defined
outside them. Two jobs: `factories` imports a spec's factories (at `publish_model`), `part`
builds one part from its pinned weights and checks the tensors it expects (at each publish).

Starting a Python process that imports torch costs a second or more on a small machine, and
every model registration pays for a check. So the worker keeps one warm *checker*: a child
process that has imported torch and ipnext's model code once and then only forks. Three
processes take part in a check:

    worker ──control socket──> checker ──fork──> supervisor ──fork──> check
      └──────────── its own socket pair, one per check ──────────────┘

- The worker makes a socket pair per check and hands one end to the checker over the control
  socket (SCM_RIGHTS), then writes the request (the job, its spec and arguments,
  `timeout_s` and `memory_bytes`, one JSON line) on the other and reads one JSON line back.
- The checker forks a supervisor per handed socket and goes back to waiting. It imports no
  owner code, so every check sees the owner's modules as they are on disk now.
- The supervisor forks the check, which lowers its RLIMIT_DATA to `memory_bytes` (private
  writable memory: the heap and anonymous maps a runaway allocation grows; not the address
  space, which torch reserves far beyond what it uses), runs the job with its output going to
  a file, and writes its answer (`{"error": null}`, `{"error": {"type", "message"}}` or
  `{"out_of_memory": detail}`) to another. The supervisor kills the check at its timeout, or
  when the worker hangs up, and answers for it: the check's answer, `{"timeout": true}`, or
  `{"exit": code, "tail": ...}` when it ended without one (owner code that calls `os._exit`,
  crashes the interpreter, or is killed: a negative code is the signal).

Faults: the checker ends when the control socket closes (the worker exited or was killed),
so it never outlives the worker. If the checker has died, or was started with an environment
that has since changed (the check must see the worker's current `PYTHONPATH` and working
folder: tests change them), the next check starts a new one. A checker that cannot start, or a supervisor that
does not answer, is the worker's fault, not the spec's: those raise `CheckerError`, which the
activity lets Temporal retry; a bad spec raises `SpecError`, which it does not.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from ipnext.errors import IpnextError, SpecError, error_from_wire
from ipnext.spec.model import ModelSpec, SnapshotRef, check_factories
from ipnext.store.validation import check_part_fits

__all__ = [
    "SPEC_CHECK_TIMEOUT_S",
    "CheckerError",
    "check_factories_in_child",
    "check_part_in_child",
    "start_checker",
    "stop_checker",
]

SPEC_CHECK_TIMEOUT_S = 60.0
# Imported once by the checker, before it forks: what nearly every factory module imports.
PRELOAD = ("torch",)
CHECKER_START_TIMEOUT_S = 120.0  # a torch import on a busy two-core machine
ANSWER_GRACE_S = 10.0  # beyond a check's timeout, how long the supervisor has to answer
_POLL_S = 0.01  # how often the supervisor looks at its check and its caller
TIMEOUT_SETTING = "model_code.validation_timeout_s"
MEMORY_SETTING = "model_code.validation_memory_bytes"
# How torch and the OS word a failed allocation that is not a MemoryError.
_OUT_OF_MEMORY_WORDS = ("can't allocate memory", "Cannot allocate memory")


class CheckerError(RuntimeError):
    """The checker machinery failed (not the spec): retrying on a fresh checker may succeed."""


# ---- the worker's side ---------------------------------------------------------------------


def check_factories_in_child(
    spec: ModelSpec,
    timeout_s: float = SPEC_CHECK_TIMEOUT_S,
    memory_bytes: int | None = None,
    prefixes: Sequence[str] | None = None,
) -> None:
    """Import every part's factory in a forked process; raise its error as an IpnextError.

    Raises SpecError for the spec's faults (a factory that does not import, is not callable,
    is defined outside `prefixes`, hangs past `timeout_s`, needs more than `memory_bytes` or
    exits the process) and CheckerError for the checker's own."""
    request = {"job": "factories", "spec": spec.model_dump_json(), "prefixes": _list(prefixes)}
    answer = _checker().check(request, timeout_s, memory_bytes)
    _raise_for(
        answer,
        f"model {spec.name}: importing its factories",
        field="parts.*.factory",
        fix="make the factory modules import quickly, with no work at import time",
        timeout_s=timeout_s,
        memory_bytes=memory_bytes,
    )


def check_part_in_child(
    spec: ModelSpec,
    part: str,
    ref: SnapshotRef,
    pinned: Path,
    timeout_s: float = SPEC_CHECK_TIMEOUT_S,
    memory_bytes: int | None = None,
    prefixes: Sequence[str] | None = None,
    budget_s: float | None = None,
) -> None:
    """Build `part` from its pinned weights in a forked process (`validation.check_part_fits`);
    raise its error: a SnapshotError when the weights do not fit, a SpecError when the part's
    code hangs, exits or runs out of memory, CheckerError for the checker's own faults.
    `budget_s`: the whole set's time, of which `timeout_s` is what was left for this part."""
    request = {
        "job": "part",
        "spec": spec.model_dump_json(),
        "part": part,
        "ref": ref.model_dump_json(),
        "pinned": str(pinned),
        "prefixes": _list(prefixes),
    }
    answer = _checker().check(request, timeout_s, memory_bytes)
    _raise_for(
        answer,
        f"model {spec.name}: building part {part} with snapshot {ref.snapshot_id}",
        field=f"parts.{part}.factory",
        fix="make the part build from its weights quickly, within the memory its weights need",
        timeout_s=timeout_s,
        memory_bytes=memory_bytes,
        budget_s=budget_s,
    )


def _list(prefixes: Sequence[str] | None) -> list[str] | None:
    return None if prefixes is None else list(prefixes)


def _raise_for(
    answer: dict[str, Any],
    what: str,
    *,
    field: str,
    fix: str,
    timeout_s: float,
    memory_bytes: int | None,
    budget_s: float | None = None,
) -> None:
    """Raise the error a check's answer stands for; return if it passed."""
    if answer.get("timeout"):
        of = f"what was left of the set's {budget_s:g} s, " if budget_s is not None else ""
        raise SpecError(
            f"{what} did not finish within {timeout_s:.3g} s (the check was killed; {of}{TIMEOUT_SETTING}).",
            field=field,
            fix=f"{fix}, or have the worker's operator raise {TIMEOUT_SETTING}",
        )
    if "out_of_memory" in answer:
        detail = f" ({answer['out_of_memory']})" if answer["out_of_memory"] else ""
        if memory_bytes:
            why = f"the check may use {memory_bytes / 1024**3:g} GiB of private memory ({MEMORY_SETTING})"
        else:
            why = f"the machine had no more for it ({MEMORY_SETTING} was not set)"
        raise SpecError(
            f"{what} ran out of memory: {why}{detail}.",
            field=field,
            fix=f"{fix}, or have the worker's operator raise {MEMORY_SETTING}",
        )
    if "exit" in answer:
        code = int(answer["exit"])
        if code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
            if -code == signal.SIGKILL:
                how += " (the kernel's out-of-memory killer, or an operator)"
        else:
            how = f"ended with code {code}"
        raise SpecError(
            f"{what}: the check process {how} and no answer ({answer.get('tail') or 'no output'}).",
            field=field,
            fix=f"{fix}, without exiting the process",
        )
    if answer.get("error") is not None:
        error = answer["error"]
        raise error_from_wire(str(error["type"]), str(error["message"]), error.get("details"))


def start_checker() -> None:
    """Start the warm checker now (the worker does, at start), so no registration waits for it."""
    _checker()


def stop_checker() -> None:
    """End the checker (it exits when its control socket closes)."""
    global _current
    with _lock:
        if _current is not None:
            _current.close()
            _current = None


def _environment() -> tuple[str, ...]:
    """Where a check finds modules, which it must see as the worker does now."""
    return (sys.executable, os.getcwd(), os.environ.get("PYTHONPATH", ""))


class _Checker:
    """The worker's handle on one checker process."""

    def __init__(self) -> None:
        self.environment = _environment()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ipnext.activities.spec_check", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=2,  # the owner's prints go to the worker's log, never into an answer
            )
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self.control = ours
        self.send_lock = threading.Lock()
        ours.settimeout(CHECKER_START_TIMEOUT_S)
        try:
            ready = ours.recv(16)
        except OSError as err:
            self.close()
            raise CheckerError(
                f"the factory checker did not start within {CHECKER_START_TIMEOUT_S:g} s: {err}"
            ) from None
        if ready != b"ready\n":
            code = self.process.wait(timeout=10)
            self.close()
            raise CheckerError(f"the factory checker exited with code {code} before it was ready")
        ours.settimeout(None)

    def alive(self) -> bool:
        return self.process.poll() is None and self.environment == _environment()

    def check(self, request: dict[str, Any], timeout_s: float, memory_bytes: int | None) -> dict[str, Any]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with ours:
            try:
                with self.send_lock:
                    socket.send_fds(self.control, [b"c"], [theirs.fileno()])
            except OSError as err:
                raise CheckerError(f"the factory checker is gone: {err}") from None
            finally:
                theirs.close()
            ours.settimeout(timeout_s + ANSWER_GRACE_S)
            try:
                limits = {"timeout_s": timeout_s, "memory_bytes": memory_bytes}
                ours.sendall((json.dumps({**request, **limits}) + "\n").encode())
                with ours.makefile("rb") as reader:
                    line = reader.readline()
            except OSError as err:
                raise CheckerError(f"the factory check's supervisor did not answer: {err}") from None
        try:
            answer = json.loads(line)
        except json.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):
            raise CheckerError(f"the factory check's supervisor ended without an answer ({line[:200]!r})")
        return answer

    def close(self) -> None:
        self.control.close()  # the checker reads EOF and exits
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_lock = threading.Lock()
_current: _Checker | None = None


def _checker() -> _Checker:
    """The live checker for the worker's current environment, started if need be."""
    global _current
    with _lock:
        if _current is not None and not _current.alive():
            _current.close()
            _current = None
        if _current is None:
            _current = _Checker()
        return _current


# ---- the checker's side --------------------------------------------------------------------


def _serve(control: socket.socket) -> None:
    """Preload, say ready, then fork a supervisor per socket handed over, until EOF."""
    for module in PRELOAD:
        with contextlib.suppress(ImportError):  # a worker without torch still checks
            importlib.import_module(module)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    control.sendall(b"ready\n")
    while True:
        try:
            message, fds, _flags, _addr = socket.recv_fds(control, 16, 4)
        except (ConnectionError, OSError):
            return
        if not message:
            return  # the worker is gone: so are we
        for fd in fds:
            if os.fork() == 0:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the supervisor waits for its check
                control.close()
                try:
                    _supervise(socket.socket(fileno=fd))
                finally:
                    os._exit(0)
            os.close(fd)


def _supervise(conn: socket.socket) -> None:
    """Run one check in a forked process and answer for it on `conn`."""
    with conn.makefile("rb") as reader:  # closed, so the check's `conn.close()` frees the socket
        request = json.loads(reader.readline())
    timeout_s = float(request["timeout_s"])
    answer_file = tempfile.TemporaryFile()
    output_file = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:
        conn.close()
        _check(request, answer_file, output_file)
    deadline = time.monotonic() + timeout_s
    status: int | None = None
    caller_gone = False
    while status is None:
        done, wait_status = os.waitpid(pid, os.WNOHANG)
        if done:
            status = wait_status
            break
        conn.settimeout(_POLL_S)
        try:
            caller_gone = conn.recv(1) == b""  # the worker hung up (or died): stop the check
        except TimeoutError:
            pass
        if caller_gone or time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
    output = _read(output_file)
    if output:
        sys.stderr.write(output)  # the owner's prints, into the worker's log
        sys.stderr.flush()
    if caller_gone:
        return
    answer: dict[str, Any]
    if status is None:
        answer = {"timeout": True}
    else:
        try:
            answer = json.loads(_read(answer_file))
        except json.JSONDecodeError:
            tail = " | ".join(output.strip().splitlines()[-3:])
            answer = {"exit": os.waitstatus_to_exitcode(status), "tail": tail}
    conn.settimeout(ANSWER_GRACE_S)
    conn.sendall((json.dumps(answer) + "\n").encode())


def _check(request: dict[str, Any], answer_file: IO[bytes], output_file: IO[bytes]) -> None:
    """The check itself: limit its memory, run the job, write the answer, exit. Never returns."""
    os.dup2(output_file.fileno(), 1)
    os.dup2(output_file.fileno(), 2)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if request.get("memory_bytes"):
        _limit_memory(int(request["memory_bytes"]))
    importlib.invalidate_caches()  # modules written since the checker started must be found
    answer: dict[str, Any] = {"error": None}
    out_of_memory = False
    try:
        _run(request)
    except MemoryError:
        out_of_memory = True  # answered below, once the frames holding the memory are gone
    except IpnextError as err:
        answer = {"error": {"type": type(err).__name__, "message": str(err), "details": err.wire_details()}}
    except BaseException as err:  # the owner's code may raise anything, SystemExit included
        answer = {
            "error": {"type": "SpecError", "message": f"factory check failed: {type(err).__name__}: {err}"}
        }
    if out_of_memory:
        answer = {"out_of_memory": None}
    elif answer["error"] is not None and any(w in answer["error"]["message"] for w in _OUT_OF_MEMORY_WORDS):
        answer = {"out_of_memory": answer["error"]["message"][-300:]}
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    answer_file.write((json.dumps(answer) + "\n").encode())
    answer_file.flush()
    os._exit(0)


def _limit_memory(memory_bytes: int) -> None:
    """Cap the private memory this process may hold, and its owner code may not raise it."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = memory_bytes if hard == resource.RLIM_INFINITY else min(memory_bytes, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def _run(request: dict[str, Any]) -> None:
    spec = ModelSpec.model_validate_json(request["spec"])
    prefixes = request.get("prefixes")
    if request["job"] == "factories":
        check_factories(spec, prefixes)
    else:
        ref = SnapshotRef.model_validate_json(request["ref"])
        check_part_fits(spec, str(request["part"]), ref, Path(request["pinned"]), prefixes)


def _read(file: IO[bytes]) -> str:
    file.seek(0)
    return file.read().decode(errors="replace")


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
