"""The router's side of an experiment: the arm and signed request id an answer carries, and the
feedback route, which counts each (request id, outcome) once, as the experiment's feedback
ledger decides (`serving.feedback_actor`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import ray

from ipnext.contracts.router import ExperimentRoute
from ipnext.policy.experiments import RequestIdError, new_request_id, read_request_id, unit_bucket
from ipnext.serving.answers import refusal, server_failure
from ipnext.serving.feedback_actor import CLAIM_TIMEOUT_S, ledger_actor
from ipnext.serving.request_body import BodyError, parse_feedback_body
from ipnext.serving.traffic import PickedApps
from ipnext.store.feedback_ledger import Claim
from ipnext.store.keys import KeyCheck

__all__ = ["stamp_arm", "take_feedback"]

# Counts outcomes for a set app in a unit bucket (the router's `_note`).
Note = Callable[[str, dict[str, float], int | None], None]


def stamp_arm(
    experiment: ExperimentRoute | None, keys: KeyCheck | None, picked: PickedApps, unit: str | None
) -> dict[str, Any]:
    """What an answer says of the experiment: its arm (None outside one) and, in one, the signed
    id that feedback names, carrying the unit's bucket and the time (none while the keys file
    has no signing secret)."""
    if picked.arm is None or experiment is None or unit is None:
        return {"arm": None}
    secret = keys.signing_secret() if keys is not None else None
    if secret is None:
        return {"arm": picked.arm}
    bucket = unit_bucket(experiment.salt, unit)
    request_id = new_request_id(secret, experiment.experiment, picked.arm, bucket, time.time())
    return {"arm": picked.arm, "request_id": request_id}


async def take_feedback(
    raw: bytes,
    model: str,
    experiment: ExperimentRoute | None,
    keys: KeyCheck | None,
    max_json_depth: int,
    note: Note,
) -> tuple[dict[str, Any], int]:
    """POST .../feedback `{request_id, outcome: {name: number}}`: the outcomes count for the arm
    the (signed) id names, in its set app's counters and its unit's bucket, while its experiment
    runs here, each (request id, outcome) once: the experiment's feedback ledger says which were
    counted before, by any router of any region. Repeats answer 200 and name what was not
    counted again; nothing is counted while the ledger cannot be asked or is full (503)."""
    try:
        given = parse_feedback_body(raw, max_json_depth)
    except BodyError as err:
        return refusal(err.status, err.message)
    secret = keys.signing_secret() if keys is not None else None
    if secret is None:
        return refusal(503, "feedback needs the keys file's request_signing_secret; ask the operator")
    try:
        named = read_request_id(secret, given.request_id)
    except RequestIdError as err:
        return refusal(400, str(err))
    if experiment is None or experiment.experiment != named.experiment:
        return refusal(
            410, f"request_id: experiment {named.experiment} is not running here; its outcomes are refused"
        )
    app = experiment.arms.get(named.arm)
    if app is None:
        return refusal(400, f"request_id: {named.arm!r} is not an arm of experiment {named.experiment}")
    try:
        ledger = ledger_actor(model, named.experiment)
        found: dict[str, str] = await asyncio.wait_for(
            ledger.claim.remote(given.request_id, float(named.issued_at), sorted(given.outcome)),
            CLAIM_TIMEOUT_S,
        )
    except ray.exceptions.RayTaskError as err:  # the ledger is full (LedgerFullError)
        return server_failure(503, "the experiment's feedback ledger is full; retry later", err)
    except (TimeoutError, ray.exceptions.RayError) as err:
        return server_failure(503, "the experiment's feedback ledger did not answer; retry", err)
    if found and all(v == str(Claim.EXPIRED) for v in found.values()):
        return refusal(
            410, "request_id: its answer is older than the feedback window (feedback.window_seconds)"
        )
    counted = {name: value for name, value in given.outcome.items() if found.get(name) == str(Claim.NEW)}
    note(app, counted, named.bucket)
    repeats = sorted(name for name in given.outcome if found.get(name) == str(Claim.SEEN))
    return {
        "experiment": named.experiment,
        "arm": named.arm,
        "recorded": sorted(counted),
        "already_recorded": repeats,
    }, 200
