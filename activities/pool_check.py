"""The fleet's pool check: one serving check for every pooled model, at every tick of `fleet`.

A dedicated model checks its own serving every `serve.reconcile_seconds`
(`activities/reconcile.py`). Two hundred pooled models doing the same would cost the worker two
hundred Temporal timers, activities and writer reads per interval for apps that are, in Serve,
a handful of pools and one pool router per region. So a pooled model checks its own serving
only every `serve.pools.model_check_seconds` (a safety net: the record against the writer), and
this check, run by `FleetWorkflow` at each of its ticks, watches what they share in one status
read and one writer read:

- every Serve app a pooled model's placeholders are folded into (`ConfigWriter.pool_members`):
  missing in Serve, or a version Serve gave up starting (`app_health.given_up`);
- every pooled model the last check saw the writer hold and this one does not: a new writer
  (Ray lost it, or its cluster) that could not adopt it. A model stays remembered this way for
  `serve.pools.model_check_seconds`, by which time its own check has run anyway.

It repairs nothing itself: it signals `reconcile` to the model workflows concerned, whose own
check (the record is theirs) pushes what is missing; the first one's push serves its
pool-mates too, and theirs then find nothing to do. A model asked is not asked again for
`serve.reconcile_seconds`, so a pool that takes a while to come back is not a signal storm.
Regions with no live Ray node are left alone, as the models' own checks leave them.

Faults: Ray or the writer unreachable is reported, not raised (`error`: the workflow records it,
keeps its memory and checks at its next tick, as `check_regions` does, so the fleet's loop never
waits on retries); no writer running is not an error (nothing was ever pooled, or every
remembered model is in doubt); a signal to a workflow that is gone is dropped with its model;
any other signal failure raises."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from pydantic import Field
from temporalio import activity
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from ipnext.activities import _context
from ipnext.names import Frozen, ModelWorkflowNames, model_workflow_id

__all__ = ["PoolCheckActivities", "PoolCheckInput", "PoolCheckResult", "pools_in_doubt"]


class PoolCheckInput(Frozen):
    members: dict[str, float] = Field(default_factory=dict)  # pooled model -> when last held (unix s)
    asked: dict[str, float] = Field(default_factory=dict)  # model -> when last asked to check (unix s)


class PoolCheckResult(Frozen):
    members: dict[str, float] = Field(default_factory=dict)  # the next check's input
    asked: dict[str, float] = Field(default_factory=dict)
    doubts: dict[str, str] = Field(default_factory=dict)  # model -> why its serving is in doubt
    signalled: list[str] = Field(default_factory=list)  # asked to check now (not asked lately)
    error: str = ""  # why nothing could be judged this time (Ray or the writer unreachable)


def pools_in_doubt(
    held: Mapping[str, list[str]],
    remembered: Mapping[str, float],
    listed: Mapping[str, Any],
    live: set[str],
) -> dict[str, str]:
    """Which pooled models must check their serving, and why: one that the writer holds (`held`:
    model -> the Serve apps it is folded into) whose app in a live region Serve does not list
    (`listed`: Serve's status by app) or gave up on; one `remembered` that the writer no longer
    holds. Pure."""
    from ipnext.serving.app_health import given_up
    from ipnext.serving.pool_layout import pool_app_region

    doubts: dict[str, str] = {}
    for model, apps in sorted(held.items()):
        for app in apps:
            if pool_app_region(app) not in live:
                continue
            why = f"{app} missing in Serve" if app not in listed else given_up(listed[app])
            if why:
                doubts[model] = why
                break
    for model in sorted(set(remembered) - set(held)):
        doubts[model] = "the writer holds it no more (a new writer, or it left its pool)"
    return doubts


class PoolCheckActivities:
    """The pool check, with the worker's Temporal client to signal the models it doubts."""

    def __init__(self, client: Client) -> None:
        self._client = client

    @activity.defn
    async def check_pools(self, input: PoolCheckInput) -> PoolCheckResult:
        settings = _context.settings()
        now = time.time()
        try:
            held, doubts = await asyncio.to_thread(_read_and_judge, input.members)
        except Exception as err:  # Ray or the writer unreachable: no judgement this time
            why = f"the pools could not be checked: {err!r}"
            return PoolCheckResult(members=input.members, asked=input.asked, error=why)
        keep_s = settings.serve.pools.model_check_seconds
        members = {m: now for m in held} | {
            m: seen for m, seen in input.members.items() if m not in held and now - seen < keep_s
        }
        again_s = settings.serve.reconcile_seconds
        asked = {m: t for m, t in input.asked.items() if m in doubts and now - t < again_s}
        signalled: list[str] = []
        for model in sorted(set(doubts) - set(asked)):
            try:
                handle = self._client.get_workflow_handle(model_workflow_id(model))
                await handle.signal(ModelWorkflowNames.RECONCILE)
            except RPCError as err:
                if err.status == RPCStatusCode.NOT_FOUND:  # the model is gone: forget it
                    members.pop(model, None)
                    continue
                raise
            asked[model] = now
            signalled.append(model)
        if signalled:
            activity.logger.warning(
                "pool check: asked %d pooled model(s) to check their serving: %s",
                len(signalled),
                "; ".join(f"{m} ({doubts[m]})" for m in signalled[:10]),
            )
        return PoolCheckResult(members=members, asked=asked, doubts=doubts, signalled=signalled)


def _read_and_judge(remembered: dict[str, float]) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The writer's pooled models and Serve's status (the tick's shared read), judged; anything
    in doubt is confirmed on a read begun now, so a read a tick old never asks anyone."""
    import ray

    from ipnext.serving.control import (
        STATUS_TICK_S,
        connect_for,
        existing_writer,
        live_regions,
        serve_applications,
    )

    connect_for(_context.settings())
    writer = existing_writer()
    held: dict[str, list[str]] = {} if writer is None else ray.get(writer.pool_members.remote(), timeout=20)
    if not held:  # nothing pooled now: only the remembered are in doubt; no status to read
        return held, pools_in_doubt(held, remembered, {}, set())
    live = live_regions()
    doubts = pools_in_doubt(held, remembered, serve_applications(max_age_s=STATUS_TICK_S), live)
    if doubts:
        doubts = pools_in_doubt(held, remembered, serve_applications(), live)
    return held, doubts
