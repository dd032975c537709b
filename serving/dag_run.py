"""Running a set's DAG for one request: the variants its choice nodes pick, each part called on
its route once its upstream answered, a failed variant retried once on its fallback, and what
came of it as a typed answer (`DagAnswer`) or a typed failure (`DagFailed`).

The router (`serving/router.py`) decides which set a request goes to, whether it is admitted,
what counts against the set and how it is answered over HTTP; this module only runs the DAG, so
a router of its own set apps and a shared pool's router run requests the same way.

- `run_dag` runs a whole request within its deadline. A caller's mistake (`PartInputError`) is
  raised as it is: it is nobody's failure. Any other error, the deadline included, is raised as
  `DagFailed`, naming the part that failed (None: none did, e.g. the deadline passed while parts
  waited in their queues).
- `run_parts` runs every part but one (`skip`), for the stream, whose final part the router
  calls itself piece by piece.
- A part's output must be finite: NaN or infinity fails the attempt like an exception
  (`NonFiniteOutputsError`), so a variant answering NaN falls back, and the gates see it.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from ipnext.errors import PartInputError
from ipnext.serving.answers import NonFiniteOutputsError
from ipnext.serving.choices import variant_label
from ipnext.serving.set_routes import SetRoute
from ipnext.serving.traffic import all_finite, join_shards, jsonable, upstream_values
from ipnext.spec.model import DAG_INPUT, DAG_OUTPUT

__all__ = ["Attempt", "DagAnswer", "DagFailed", "run_dag", "run_parts"]


@dataclass
class Attempt:
    """One run of a request's DAG: the variant at each choice node, the snapshot id of each part
    that answered, and the part that failed it (not by the caller's mistake), if one did."""

    chosen: dict[str, str]
    stamps: dict[str, str] = field(default_factory=dict)
    failed_part: str | None = None
    retried: bool = False  # this is the retry on a fallback after the first attempt failed


@dataclass(frozen=True)
class DagAnswer:
    """A request the DAG answered: its outputs (JSON-ready), the snapshot id each part answered
    with, the variants that ran (`variant_label`), and whether the fallback answered after a
    part of the chosen variant failed (`retried`: the caller was saved, but the set failed once,
    and its gates must see that)."""

    outputs: Any
    stamps: dict[str, str]
    variant: str | None
    retried: bool


class DagFailed(Exception):
    """A request the DAG did not answer: `cause` (a part's error, a full queue's
    BackPressureError, a TimeoutError past the deadline, NonFiniteOutputsError) and the part
    that failed it, if one did."""

    def __init__(self, cause: Exception, failed_part: str | None) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.failed_part = failed_part


async def run_dag(
    route: SetRoute,
    part_routes: dict[str, SetRoute],
    inputs: Any,
    rng: random.Random,
    deadline_s: float,
) -> DagAnswer:
    """Run `route`'s DAG on the variants its choice nodes pick for the request, calling each part
    in `part_routes` on that route instead (an experiment's arm swapping one part), within
    `deadline_s`. When a part of a chosen variant fails (not by the caller's mistake), the
    request runs once more with that choice on its fallback."""
    tried: list[Attempt] = []
    try:
        async with asyncio.timeout(deadline_s):
            outputs = await _with_fallback(route, part_routes, inputs, rng, tried)
    except PartInputError:
        raise
    except Exception as err:
        raise DagFailed(err, tried[-1].failed_part if tried else None) from err
    last = tried[-1]
    return DagAnswer(
        outputs=outputs, stamps=last.stamps, variant=variant_label(last.chosen), retried=last.retried
    )


async def _with_fallback(
    route: SetRoute, part_routes: dict[str, SetRoute], inputs: Any, rng: random.Random, tried: list[Attempt]
) -> Any:
    """Each attempt is appended to `tried` as it starts: the last one is how the request ran."""
    attempt = Attempt(route.variants.choose(inputs, time.monotonic()))
    tried.append(attempt)
    try:
        return await _run_attempt(route, part_routes, inputs, rng, attempt)
    except PartInputError:
        raise
    except Exception:
        retry = route.variants.retry_on_fallback(attempt.chosen, attempt.failed_part)
        if retry is None:
            raise
    attempt = Attempt(retry, retried=True)
    tried.append(attempt)
    return await _run_attempt(route, part_routes, inputs, rng, attempt)


async def _run_attempt(
    route: SetRoute, part_routes: dict[str, SetRoute], inputs: Any, rng: random.Random, attempt: Attempt
) -> Any:
    try:
        results = await run_parts(route, part_routes, inputs, rng, attempt)
        feeding = route.variants.plan(attempt.chosen).upstream.get(DAG_OUTPUT, [])
        finals = join_shards({u: results[u] for u in feeding}, route.shard_groups)
        outputs = jsonable(next(iter(finals.values())) if len(finals) == 1 else finals)
        if not all_finite(outputs):  # a failure of the parts that answered: a variant falls back
            attempt.failed_part = feeding[0]
            raise NonFiniteOutputsError()
    finally:
        route.variants.finish(attempt.chosen, attempt.stamps, attempt.failed_part, time.monotonic())
    return outputs


async def run_parts(
    route: SetRoute,
    part_routes: dict[str, SetRoute],
    inputs: Any,
    rng: random.Random,
    attempt: Attempt,
    skip: str | None = None,
) -> dict[str, Any]:
    """Every output of the parts the attempt's variants run (all but `skip`), each part started
    once its upstream is done; snapshot ids and a failing part go into `attempt`."""
    plan = route.variants.plan(attempt.chosen)
    tasks: dict[str, asyncio.Task[Any]] = {}

    async def run(part: str) -> Any:
        ups = [u for u in plan.upstream.get(part, []) if u != DAG_INPUT]
        values = dict(zip(ups, await asyncio.gather(*(tasks[u] for u in ups)), strict=True))
        upstream = upstream_values(plan, part, values, inputs, route.shard_groups)
        try:
            reply = await part_routes.get(part, route).handle(part, rng).remote(upstream)
        except Exception as err:
            if not isinstance(err, PartInputError) and attempt.failed_part is None:
                attempt.failed_part = part
            raise
        attempt.stamps[part] = reply["snapshot_id"]
        return reply["output"]

    for part in plan.order:  # topological: upstream tasks exist before their consumers
        if part != skip:
            tasks[part] = asyncio.ensure_future(run(part))
    done = await asyncio.gather(*tasks.values())
    return dict(zip(tasks, done, strict=True))
