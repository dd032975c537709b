"""How the router answers: every refusal and failure as `{error_id, message}` with the details
in the replica's log under that id, never a traceback to the caller; a shed request's answer with
its Retry-After; and the caller's own deadline read from its header."""

from __future__ import annotations

import logging
import math
import uuid
from typing import Any

from ray.serve.exceptions import BackPressureError
from starlette.responses import JSONResponse

from ipnext.contracts.http_routes import SHED_REASON
from ipnext.policy.admission import Admission, retry_after_seconds
from ipnext.serving.pool_parts import PartRefusedError

__all__ = [
    "NonFiniteOutputsError",
    "answer",
    "caller_deadline",
    "part_cause",
    "refusal",
    "server_failure",
    "set_failure",
    "shed_answer",
]

logger = logging.getLogger("ray.serve")


def refusal(status: int, message: str) -> tuple[dict[str, Any], int]:
    """An answer for a request refused without running it (the caller's mistake, no set)."""
    error_id = uuid.uuid4().hex[:16]
    logger.info("request %s refused (%d): %s", error_id, status, message)
    return {"error_id": error_id, "message": message}, status


def server_failure(status: int, message: str, err: BaseException) -> tuple[dict[str, Any], int]:
    """An answer for a request the server failed: the caller gets the message and an id, the
    log gets the id with the exception and its traceback (which names pids, addresses, paths)."""
    error_id = uuid.uuid4().hex[:16]
    logger.warning("request %s failed (%d): %s", error_id, status, message, exc_info=err)
    return {"error_id": error_id, "message": f"{message} (error_id {error_id})"}, status


class NonFiniteOutputsError(ValueError):
    """The parts answered NaN or infinity: a failed request, which the gates must see."""

    def __init__(self, message: str = "the model's outputs are not finite (NaN or inf)") -> None:
        super().__init__(message)


def set_failure(err: Exception, failed_part: str | None, deadline_s: float) -> tuple[dict[str, Any], int]:
    """The answer to a request the set failed: 504 past the deadline, 503 when a part's queue
    was full or its pool refuses it (quarantined), else 500; the message says which without the
    server's insides."""
    if isinstance(err, TimeoutError):
        return server_failure(504, f"no answer within the deadline of {deadline_s:g} s", err)
    if isinstance(err, BackPressureError):
        return server_failure(503, f"part {failed_part or '?'} is overloaded; retry later", err)
    if isinstance(err, NonFiniteOutputsError):
        return server_failure(500, str(err), err)
    if isinstance(err, PartRefusedError):  # the part's snapshot failed its pool; its pool-mates serve
        return server_failure(503, f"part {failed_part or '?'} is quarantined by its pool; retry later", err)
    return server_failure(500, f"part {failed_part or '?'} failed", err)


def part_cause(err: BaseException) -> str:
    """A part's own words for an error it raised (Ray wraps it with the replica's traceback)."""
    cause = getattr(err, "cause", None)
    return str(cause) if isinstance(cause, BaseException) else str(err).strip().splitlines()[-1]


def answer(body: dict[str, Any], status: int) -> JSONResponse:
    """The HTTP answer; a shed request's says when to come back (Retry-After, seconds)."""
    retry = body.get("retry_after") if status == 503 else None
    headers = {"Retry-After": str(retry)} if isinstance(retry, int) else None
    return JSONResponse(body, status_code=status, headers=headers)


def caller_deadline(raw: str | None) -> float | None:
    """The caller's own deadline in seconds from its header (ms), None without one or a bad one."""
    if raw is None:
        return None
    try:
        ms = float(raw)
    except ValueError:
        return None
    return ms / 1000 if math.isfinite(ms) and ms > 0 else None


def shed_answer(
    model: str, region: str, admission: Admission, least_retry_s: int
) -> tuple[dict[str, Any], int]:
    """The 503 of a request shed for its expected queue wait: why, and when to come back."""
    budget = admission.budget_s or 0.0
    body, status = refusal(
        503,
        f"model {model} is overloaded in {region}: a request now would wait about "
        f"{admission.expected_wait_s * 1000:.0f} ms in the queue, over its {budget * 1000:.0f} ms; "
        "retry later",
    )
    return {
        **body,
        "reason": SHED_REASON,
        "retry_after": retry_after_seconds(admission, least_retry_s),
    }, status
