"""Temporal activities: every side effect of the lifecycle, as thin wrappers over pure code.

Activities apply a desired state, so a retry after a crash is safe. Heavy imports
(torch, ray) stay inside them; timeouts and retry policies are named constants here.
"""

from datetime import timedelta

from temporalio.common import RetryPolicy

__all__ = [
    "DEPLOY_TIMEOUT",
    "QUICK_TIMEOUT",
    "RETRY",
    "VALIDATE_TIMEOUT",
]

QUICK_TIMEOUT = timedelta(seconds=30)
VALIDATE_TIMEOUT = timedelta(minutes=2)
DEPLOY_TIMEOUT = timedelta(minutes=5)
HEARTBEAT_TIMEOUT = timedelta(seconds=30)
# Input errors are raised non-retryable; anything else (a worker restart, Ray busy) retries.
RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=5,
)
