"""The feedback ledger as Ray runs it: one detached actor per experiment on the head node
(`ipnext-feedback/<model>/<experiment>`), which every router replica of every region asks before
it counts an outcome, so a (request id, outcome) counts once (`ipnext.store.feedback_ledger`).

The first router to get feedback for an experiment creates it; it restarts when its process dies
(reading its log back), and the experiment's end retires it (`retire_ledger`), log included.
Faults: a router that cannot reach it within `CLAIM_TIMEOUT_S` counts nothing and answers 503, so
the caller posts again; a claim is never retried by Ray, since a retry after a recorded claim
would find it seen and the outcome would not be counted at all (the caller's repost has the same
effect, and says so)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import ray

from ipnext.errors import IpnextError
from ipnext.serving.layout import RAY_NAMESPACE, head_node_options
from ipnext.store.feedback_ledger import FeedbackLedger

__all__ = ["CLAIM_TIMEOUT_S", "FeedbackLedgerActor", "ledger_actor", "ledger_name", "retire_ledger"]

logger = logging.getLogger(__name__)

CLAIM_TIMEOUT_S = 10.0  # a claim is a dict lookup and an fsync: seconds only when the head is lost


def ledger_name(model: str, experiment: str) -> str:
    return f"ipnext-feedback/{model}/{experiment}"


class FeedbackLedgerActor:
    """Body of the actor: the ledger, with its log under the settings' feedback folder (from the
    config file the stack's processes read, IPNEXT_CONFIG); without settings, in memory only."""

    def __init__(self, model: str, experiment: str) -> None:
        from ipnext.spec.settings import FeedbackSettings, load_settings

        path: Path | None
        try:
            settings = load_settings()
            feedback = settings.feedback
            path = settings.feedback_store() / model / f"{experiment}.log"
        except (IpnextError, OSError) as err:
            logger.warning(
                "feedback ledger of %s kept in memory only (settings unreadable: %s)", experiment, err
            )
            feedback, path = FeedbackSettings(), None
        self._ledger = FeedbackLedger(path, feedback.window_seconds, feedback.max_entries)
        logger.info("feedback ledger of %s/%s: %d ids live", model, experiment, len(self._ledger))

    def claim(self, request_id: str, issued_at: float, outcomes: list[str]) -> dict[str, str]:
        """`FeedbackLedger.claim`, its verdicts as strings; LedgerFullError passes to the caller."""
        return {
            outcome: str(found)
            for outcome, found in self._ledger.claim(request_id, issued_at, outcomes).items()
        }

    def size(self) -> int:
        return len(self._ledger)

    def forget_all(self) -> None:
        self._ledger.forget_all()


def ledger_actor(model: str, experiment: str) -> Any:
    """The experiment's ledger actor, created if it is not there yet."""
    return (
        ray.remote(FeedbackLedgerActor)
        .options(
            name=ledger_name(model, experiment),
            namespace=RAY_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=-1,
            max_task_retries=0,
            # On the head node: it must outlive any region whose routers ask it.
            **head_node_options(),
        )
        .remote(model, experiment)
    )


def retire_ledger(model: str, experiment: str) -> bool:
    """Drop the experiment's ledger and its log (its feedback is refused from now on anyway);
    False when there was none."""
    try:
        actor = ray.get_actor(ledger_name(model, experiment), namespace=RAY_NAMESPACE)
    except ValueError:
        return False
    ray.get(actor.forget_all.remote(), timeout=60)
    ray.kill(actor, no_restart=True)
    return True
