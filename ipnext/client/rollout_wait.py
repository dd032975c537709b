"""Waiting on a rollout, as a CI step or a person at a terminal does: `wait_until_serving` (the
SDK's `Client.wait_until_serving`, and what `ipnext snapshot publish --wait` runs), the progress
line it prints, and the errors a wait ends with.

What a wait answers is the question its caller asked, "does my set serve?":

- it waits through the pauses that end by themselves when asked to (`through_traffic_pause`:
  ipnext's own pause for too little traffic, which traffic ends, and its hold for a freeze
  window, which the window's end ends), and stops at once on one that needs a person (an
  on-call pause, a rollback that cannot complete): `RolloutPausedError`, saying who paused it,
  why, and how it goes on;
- it stops at once when the set's rollout ends any other way than completed (rolled back,
  aborted, cancelled, failed, refused, superseded): `RolloutStoppedError`, its outcome in one
  line;
- `timeout_s` bounds it: `ServingError`, naming where the rollout is;
- `on_progress` hears every change of the rollout (state, step, split), and at least every
  `heartbeat_s` while nothing changes, so a terminal is never silent for long.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ipnext.contracts.rollout import (
    FREEZE_PAUSE,
    INSUFFICIENT_TRAFFIC,
    IPNEXT,
    NEEDS_ATTENTION,
    RolloutStatus,
    resumes_by_itself,
)
from ipnext.errors import ModelNotFoundError, RolloutPausedError, RolloutStoppedError, ServingError
from ipnext.names import ModelStatus, PollTimeoutError, RolloutState, poll_until

if TYPE_CHECKING:
    from ipnext.contracts.model import ModelState


class _ReadsRollouts(Protocol):
    """What a wait asks of the SDK's `Client`."""

    async def get_model(self, name: str) -> ModelState: ...

    async def rollout_status(self, name: str) -> RolloutStatus | None: ...


__all__ = ["WAIT_INTERVAL_S", "paused_error", "progress_line", "stopped_line", "wait_until_serving"]

WAIT_INTERVAL_S = 0.5  # how often a wait reads the model and its rollout
# Reads in a row that may find no model before a wait says so: an overloaded Temporal dev server
# (SQLite past its deadlines) answered a describe of a running model with NOT_FOUND once, in
# the density bench, right after the model was published. A model deleted meanwhile still ends
# the wait, these few reads later.
NOT_FOUND_READS = 10


async def wait_until_serving(
    client: _ReadsRollouts,
    name: str,
    set_id: str,
    timeout_s: float = 300.0,
    *,
    on_progress: Callable[[RolloutStatus], object] | None = None,
    stop_on_pause: bool = True,
    through_traffic_pause: bool = False,
    heartbeat_s: float | None = None,
) -> ModelState:
    """Wait until `set_id` serves, and return the model's state then (the module's docstring
    says when it stops instead). `stop_on_pause=False` waits through every pause;
    `through_traffic_pause=True` through those that end by themselves only. `on_progress` is
    called with the running rollout's status (the set's own, or the one it is queued behind)
    each time its state, step or split changes, and again every `heartbeat_s` (None: only on a
    change)."""
    seen: list[object] = []
    last_call = [time.monotonic()]

    def serves(state: ModelState) -> bool:
        return state.serving_set == set_id and state.state == ModelStatus.SERVING

    missing = [0]

    async def read() -> tuple[ModelState | None, RolloutStatus | None]:
        try:
            state = await client.get_model(name)
        except ModelNotFoundError:
            missing[0] += 1
            if missing[0] >= NOT_FOUND_READS:
                raise
            return None, None
        missing[0] = 0
        if serves(state):
            return state, None
        mine = next((s for s in state.sets if s.id == set_id), None)
        if mine is not None and mine.status.never_serves:
            last = state.rollout if state.rollout is not None and state.rollout.set_id == set_id else None
            words = mine.status.value.replace("_", " ")
            raise RolloutStoppedError(
                f"{set_id} will not serve: {words}: {mine.detail or 'no detail'}", status=last
            )
        live = await client.rollout_status(name) if state.state == ModelStatus.ROLLING_OUT else None
        if live is None:
            return state, None
        now = (live.set_id, live.state, live.step, sorted(live.traffic_percent.items()), live.part)
        quiet = heartbeat_s is not None and time.monotonic() - last_call[0] >= heartbeat_s
        if on_progress is not None and (seen[-1:] != [now] or quiet):
            on_progress(live)
            last_call[0] = time.monotonic()
        seen[:] = [now]
        # A set queued behind a paused rollout does not move either.
        if live.state == RolloutState.PAUSED and stop_on_pause:
            if not (through_traffic_pause and resumes_by_itself(live)):
                raise paused_error(name, live, waiting_for=set_id)
        if live.set_id == set_id and live.state.is_terminal and live.state != RolloutState.COMPLETED:
            raise RolloutStoppedError(stopped_line(set_id, live), status=live)
        return state, live

    try:
        state, _ = await poll_until(
            read,
            lambda found: found[0] is not None and serves(found[0]),
            timeout_s=timeout_s,
            interval_s=WAIT_INTERVAL_S,
            what=set_id,
        )
    except PollTimeoutError as err:
        last_state, live = err.last if isinstance(err.last, tuple) else (None, None)
        model_is = last_state.state if last_state is not None else "unknown"
        where = (
            f"; its rollout is {live.state.value} at {live.step or 'start'}: {live.detail}" if live else ""
        )
        raise ServingError(
            f"{set_id} not serving after {timeout_s:.0f}s (model is {model_is}{where})",
            fix=f"`ipnext rollout status {name}` shows where it is",
        ) from None
    assert state is not None  # the condition held
    return state


def stopped_line(set_id: str, status: RolloutStatus) -> str:
    """One line for a rollout that ended without its set serving: the outcome and why."""
    outcome = (status.outcome.value if status.outcome is not None else status.state.value).replace("_", " ")
    return f"{set_id} will not serve: {outcome}: {status.detail or 'no detail'}"


def progress_line(status: RolloutStatus) -> str:
    """A rollout's progress on one line: state, step, split, the gates' latest readings and the
    requests its window still needs (what `ipnext snapshot publish --wait` prints)."""
    split = ", ".join(f"{k} {v:g}%" for k, v in sorted(status.traffic_percent.items())) or "none"
    who = status.workflow_id or status.set_id
    line = f"{who} {status.state.value}: {status.step or 'starting'}; traffic {split}"
    if status.part_traffic:
        line += "; parts on the new set " + ", ".join(f"{k} {v:g}%" for k, v in status.part_traffic.items())
    if status.gates:
        line += "; gates " + ", ".join(g.describe() for g in status.gates)
    needed = status.requests_needed()
    if needed:
        line += f"; needs {needed} more request(s) on the new set (min_requests {status.min_requests})"
    if status.detail:
        line += f"; {status.detail}"
    return line


def paused_error(name: str, status: RolloutStatus, waiting_for: str | None = None) -> RolloutPausedError:
    """The error of a wait (for `waiting_for`, a set) that found the rollout paused: who paused
    it, why, and how it goes on."""
    pause = status.pauses[-1] if status.pauses else None
    reason = pause.reason if pause is not None else "unknown"
    who = pause.who if pause is not None else "unknown"
    why = status.detail.removeprefix("paused: ") if who == IPNEXT and status.detail else reason
    resume = f"`ipnext rollout resume {name}` bakes the step again"
    abort = f"`ipnext rollout abort {name} --reason R` rolls back"
    if who == IPNEXT and reason == INSUFFICIENT_TRAFFIC:
        fix = (
            "send the model traffic: the rollout goes on by itself once its window holds "
            f"min_requests; or {resume}, {abort}"
        )
    elif who == IPNEXT and reason.startswith(FREEZE_PAUSE):
        fix = (
            "it goes on when the freeze window ends; "
            f"`ipnext rollout override-freeze {name} --reason R --who W` lets it through now"
        )
    elif who == IPNEXT and reason == NEEDS_ATTENTION:
        fix = (
            f"its rollback cannot complete: read `ipnext rollout status {name}`, fix it, "
            f"then `ipnext rollout resume {name}` retries"
        )
    else:
        fix = f"`ipnext rollout resume {name}` goes on (the step bakes again), or {abort}"
    behind = f"{waiting_for} is queued behind it: " if waiting_for not in (None, status.set_id) else ""
    return RolloutPausedError(
        f"{behind}{status.set_id}'s rollout paused at {status.step or 'start'} by {who}: {why}. It "
        f"stays paused; `ipnext rollout watch {name}` follows it.",
        reason=reason,
        who=who,
        status=status,
        fix=fix,
    )
