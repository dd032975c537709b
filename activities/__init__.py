"""Temporal activities: every side effect of the lifecycle, as thin wrappers over pure code.

Activities apply a desired state, so a retry after a crash is safe. Heavy imports
(torch, ray) stay inside them; timeouts and retry policies are named constants here.
"""

from datetime import timedelta

from temporalio.common import RetryPolicy

__all__ = [
    "DEPLOY_TIMEOUT",
    "HEARTBEAT_TIMEOUT",
    "PINNED_REFS_RETRY",
    "PINNED_REFS_TIMEOUT",
    "QUICK_TIMEOUT",
    "RECONCILE_RETRY",
    "RETRY",
    "VALIDATE_TIMEOUT",
]

QUICK_TIMEOUT = timedelta(seconds=30)
VALIDATE_TIMEOUT = timedelta(minutes=2)
DEPLOY_TIMEOUT = timedelta(minutes=5)
HEARTBEAT_TIMEOUT = timedelta(seconds=30)
# Input errors are raised non-retryable (an ApplicationError from an IpnextError: a bad spec or
# snapshot, a Serve deploy that failed). Anything else is the world, not the input: a worker
# restart, Ray busy or down, the writer gone. Those retry with backoff for as long as it lasts
# (no attempt cap, as Temporal's own default), so an outage makes a rollout wait, not fail; the
# attempt count and the last error are on the activity in the Temporal UI.
RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=0,
)
# A serving check runs again every interval anyway: a few tries, then it is recorded as failed
# and the model goes on (a publish or a delete never waits behind an outage).
RECONCILE_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=5),
    maximum_attempts=3,
)
# A model's references in the pinned store, and a collection (activities/pinned_refs.py): a walk of
# the store's folders, no hashing. A publish waits for it (its set must be named within the
# grace); a few tries, then the model logs it and writes them again at its next change or idle
# check: a store that is down never fails the model.
PINNED_REFS_TIMEOUT = timedelta(minutes=1)
PINNED_REFS_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=5),
    maximum_attempts=3,
)
