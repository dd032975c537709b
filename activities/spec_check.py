"""A model spec's factory check, run in a child process of the worker.

Importing a model's factories runs the model owner's code. Doing it in a fresh child process
keeps that code out of the worker (a module that hangs, crashes, leaks or changes global
state at import harms only the child, which is killed after `SPEC_CHECK_TIMEOUT_S`), and
is the seam a later sandbox (limits, no network) hardens. The caller's machine never
imports the model's code at all: the SDK asks the worker to check.

Protocol: the parent writes the spec as JSON on the child's stdin; the child writes one JSON
object on its real stdout, `{"error": null}` or `{"error": {"type", "message"}}` (what the
model's modules print at import goes to stderr).
"""

from __future__ import annotations

import json
import subprocess
import sys

from ipnext.errors import IpnextError, SpecError, error_from_type
from ipnext.model import ModelSpec, check_factories

__all__ = ["SPEC_CHECK_TIMEOUT_S", "check_factories_in_child"]

SPEC_CHECK_TIMEOUT_S = 60.0


def check_factories_in_child(spec: ModelSpec, timeout_s: float = SPEC_CHECK_TIMEOUT_S) -> None:
    """Import every part's factory in a child process; raise the child's error as an IpnextError."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "ipnext.activities.spec_check"],
            input=spec.model_dump_json(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise SpecError(
            f"model {spec.name}: importing its factories did not finish within {timeout_s:g} s.",
            field="parts.*.factory",
            fix="make the factory modules import quickly, with no work at import time",
        ) from None
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        answer = None
    if not isinstance(answer, dict) or "error" not in answer:
        tail = done.stderr.strip().splitlines()[-3:]
        raise SpecError(
            f"model {spec.name}: the factory check process ended with code {done.returncode} "
            f"and no answer ({' | '.join(tail) or 'no output'}).",
            field="parts.*.factory",
            fix="check that the factory modules import on the worker without exiting the process",
        )
    if answer["error"] is not None:
        raise error_from_type(str(answer["error"]["type"]), str(answer["error"]["message"]))


def _main() -> None:
    """The child's side: check the spec read from stdin, answer on the real stdout."""
    answer_to = sys.stdout
    sys.stdout = sys.stderr  # a model module's prints must not corrupt the answer
    error: dict[str, str] | None = None
    try:
        check_factories(ModelSpec.model_validate_json(sys.stdin.read()))
    except IpnextError as err:
        error = {"type": type(err).__name__, "message": str(err)}
    except BaseException as err:  # the owner's code may raise anything, SystemExit included
        error = {"type": "SpecError", "message": f"factory check failed: {type(err).__name__}: {err}"}
    answer_to.write(json.dumps({"error": error}) + "\n")
    answer_to.flush()


if __name__ == "__main__":
    _main()
