"""`ipnext experiment start|status|stop|report|promote MODEL` and `ipnext shadow start|status|stop
MODEL`: run an experiment or a shadow on a model and read what it found.

    ipnext experiment start feed-ranker --name ranker-v2 --arms control=@current,treatment=v4 \
        --split 50/50 --duration 3d --unit user --metric click:higher
    ipnext experiment status feed-ranker            # live: phase, arms, guardrails, the report so far
    ipnext experiment stop feed-ranker --reason "saw enough"
    ipnext experiment report feed-ranker [--name N] [--json]
    ipnext experiment promote feed-ranker [--name N]  # the winner (or a shadow's candidate) rolls out

    ipnext shadow start feed-ranker --set feed-ranker@5 --percent 10 [--duration 1d] [--name N]
    ipnext shadow status feed-ranker [--json]     # mirrored, dropped, compared; how the answers agree
    ipnext shadow stop feed-ranker --reason "enough evidence"

The treatment (a shadow's candidate) is a set published with `ipnext snapshot publish --hold`,
named by its set id (MODEL@4) or its version (v4); the control is the set that serves
(`@current`). `--treatment MODEL@4 --split 50` says the same as `--arms` and `--split 50/50`.
`--unit` names what a request's `unit` field holds (arms are assigned per unit); `--metric`
(repeatable) names an outcome the winner is decided on and its better direction (click:higher,
latency_ms:lower); every outcome fed back is reported, and the report names its method
(always-valid p-values, Holm over the deciding outcomes).
A shadow is an experiment in shadow mode: the control answers
every caller, and the routers send a copy of `--percent` of the requests to the candidate after
answering, comparing the two answers. Errors are one line (what failed, the fix), exit 2, as for every verb.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
from typing import Any

from pydantic import ValidationError

from ipnext.errors import IpnextError
from ipnext.spec.reading import format_validation_error
from ipnext.spec.settings import Settings

__all__ = [
    "add_parser",
    "parse_arms",
    "parse_duration",
    "parse_split",
    "run_experiment_command",
    "run_shadow_command",
]

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """`90s`, `30m`, `6h`, `3d` -> seconds."""
    match = _DURATION.match(text.strip())
    if not match:
        raise IpnextError(f"--duration {text!r}: write a number and a unit, like 90s, 30m, 6h or 3d.")
    return float(match[1]) * _UNITS[match[2]]


def parse_arms(text: str) -> str:
    """`control=@current,treatment=<set or version>` -> the treatment's reference. The control is
    always the serving set; one treatment arm (A/B: no A/B/n yet)."""
    arms: dict[str, str] = {}
    for item in text.split(","):
        arm, sep, ref = (part.strip() for part in item.partition("="))
        if not sep or not arm or not ref:
            raise IpnextError(f"--arms {text!r}: write arm=set pairs, like control=@current,treatment=v4.")
        if arm in arms:
            raise IpnextError(f"--arms {text!r}: {arm} is named twice.")
        arms[arm] = ref
    if set(arms) != {"control", "treatment"}:
        raise IpnextError(
            f"--arms {text!r}: name two arms, control and treatment (an experiment has one treatment arm)."
        )
    if arms["control"] not in ("@current", "current"):
        raise IpnextError(
            f"--arms control={arms['control']}: the control is the set that serves, @current; publish the "
            "other set with --hold and make it the treatment."
        )
    return arms["treatment"]


def parse_split(text: str) -> float:
    """`50/50`, `90/10` (control/treatment, summing to 100) or `10` (the treatment's) -> the
    treatment's percent."""
    parts = text.split("/")
    try:
        numbers = [float(p) for p in parts]
    except ValueError:
        numbers = []
    if len(numbers) == 1:
        return numbers[0]
    if len(numbers) == 2 and abs(sum(numbers) - 100) < 1e-9:
        return numbers[1]
    raise IpnextError(
        f"--split {text!r}: write control/treatment percent summing to 100, like 50/50 or 90/10."
    )


def add_parser(commands: Any) -> None:
    """The `experiment` command and its verbs."""
    experiment = commands.add_parser("experiment", help="A/B experiments: a held set against the serving set")
    verbs = experiment.add_subparsers(dest="verb", required=True)
    start = verbs.add_parser("start", help="start one (the model holds its rollouts until it ends)")
    start.add_argument("model")
    start.add_argument("--name", required=True, help="the experiment's name (lowercase, digits, -)")
    arms = start.add_mutually_exclusive_group(required=True)
    arms.add_argument("--arms", help="control=@current,treatment=<held set or version>, e.g. treatment=v4")
    arms.add_argument("--treatment", help="the held set (or its version): --arms' treatment alone")
    start.add_argument(
        "--split", default="50", help="control/treatment percent, 90/10; or the treatment's (50)"
    )
    start.add_argument(
        "--unit", default="user", help="what the requests' unit field names: user, session (user)"
    )
    start.add_argument(
        "--metric",
        action="append",
        default=[],
        help="an outcome the winner is decided on and which way is better: click:higher, "
        "latency_ms:lower (repeat; none: every outcome is reported, no winner is called)",
    )
    start.add_argument("--duration", required=True, help="how long: 90s, 30m, 6h, 3d")
    start.add_argument("--check", default="10s", help="how often the arms are read and the guardrails judged")
    start.add_argument("--alpha", type=float, default=0.01, help="significance level of the report (0.01)")
    start.add_argument("--who", help="default: $USER")
    for verb, text in (("status", "the running one, live (or the latest)"), ("report", "the report")):
        reader = verbs.add_parser(verb, help=text)
        reader.add_argument("model")
        reader.add_argument("--name", help="an ended experiment's name (default: the running or latest one)")
        reader.add_argument("--json", action="store_true", help="as JSON")
    promote = verbs.add_parser(
        "promote", help="roll an ended experiment's winner (or shadow's candidate) out (the normal rollout)"
    )
    promote.add_argument("model")
    promote.add_argument("--name", help="the experiment (default: the latest)")
    promote.add_argument("--who", help="default: $USER")
    stop = verbs.add_parser("stop", help="end the running one now: all traffic back to control")
    stop.add_argument("model")
    stop.add_argument("--reason", required=True)
    stop.add_argument("--who", help="default: $USER")
    experiment.set_defaults(run=run_experiment_command)
    _add_shadow_parser(commands)


def _add_shadow_parser(commands: Any) -> None:
    shadow = commands.add_parser("shadow", help="shadow traffic: copies of live requests to a held set")
    verbs = shadow.add_subparsers(dest="verb", required=True)
    start = verbs.add_parser("start", help="start one (the model holds its rollouts until it ends)")
    start.add_argument("model")
    start.add_argument(
        "--set", required=True, dest="candidate", help="a set published with --hold, e.g. MODEL@5"
    )
    start.add_argument(
        "--percent", type=float, default=10.0, help="percent of requests copied (10; up to 100)"
    )
    start.add_argument("--name", help="the shadow's name (default: shadow-<the set's number>)")
    start.add_argument("--duration", default="1d", help="how long, unless stopped: 90s, 30m, 6h, 3d (1d)")
    start.add_argument("--check", default="10s", help="how often a window is summarized (10s)")
    start.add_argument(
        "--max-in-flight", type=int, default=8, help="copies in flight per router, then dropped (8)"
    )
    start.add_argument("--who", help="default: $USER")
    status = verbs.add_parser("status", help="the running one, live (or the latest)")
    status.add_argument("model")
    status.add_argument("--name", help="an ended shadow's name (default: the running or latest one)")
    status.add_argument("--json", action="store_true", help="as JSON")
    stop = verbs.add_parser("stop", help="end the running one now")
    stop.add_argument("model")
    stop.add_argument("--reason", required=True)
    stop.add_argument("--who", help="default: $USER")
    shadow.set_defaults(run=run_shadow_command)


def run_shadow_command(args: argparse.Namespace, settings: Settings) -> None:
    from ipnext.contracts.experiment import StartExperimentInput
    from ipnext.policy.shadow import render_shadow

    who = getattr(args, "who", None) or os.environ.get("USER", "cli")
    ask = None
    if args.verb == "start":  # checked before anything connects
        number = args.candidate.rpartition("@")[2]
        try:
            ask = StartExperimentInput(
                name=args.name or f"shadow-{number if number.isdigit() else 'set'}",
                treatment=args.candidate,
                treatment_percent=args.percent,
                duration_seconds=parse_duration(args.duration),
                check_seconds=parse_duration(args.check),
                who=who,
                mode="shadow",
                shadow_max_in_flight=args.max_in_flight,
            )
        except ValidationError as err:
            raise IpnextError(f"shadow start: {format_validation_error(err)}") from None

    result = asyncio.run(_act(settings, args, ask, who))
    if args.verb == "start":
        print(
            f"shadow {ask.name if ask else ''} of {args.model}: "
            f"{args.percent:g}% of {result.control}'s requests copied to {result.treatment}"
        )
        print(f"  workflow {result.workflow_id}; `ipnext shadow status {args.model}` follows it")
        return
    if result.mode != "shadow":
        raise IpnextError(
            f"{result.name} of {args.model} is an experiment, not a shadow: "
            f"`ipnext experiment status {args.model}` shows it."
        )
    if getattr(args, "json", False):
        print(json.dumps(result.model_dump(mode="json"), indent=2))
        return
    print(
        f"shadow {result.name} of {result.model}: "
        f"{result.phase}{', ' + result.outcome if result.outcome else ''}"
    )
    print(
        f"  {result.arms.get('treatment')} shadowing {result.arms.get('control')} "
        f"({result.treatment_percent:g}% copied)"
    )
    if result.end:
        print(f"  {result.end}")
    if result.shadow is not None:
        print(f"  so far: {render_shadow(result.shadow)}")
    for window in result.shadow_windows[-5:]:
        print(f"  window: {render_shadow(window)}")
    for reading in result.guardrails:
        print(f"  gate (evidence only) {reading.describe()}")


def run_experiment_command(args: argparse.Namespace, settings: Settings) -> None:
    from ipnext.contracts.experiment import StartExperimentInput
    from ipnext.policy.experiments import render_report

    who = getattr(args, "who", None) or os.environ.get("USER", "cli")
    ask = None
    if args.verb == "start":  # checked before anything connects
        treatment = parse_arms(args.arms) if args.arms else args.treatment
        try:
            ask = StartExperimentInput(
                name=args.name,
                treatment=treatment,
                treatment_percent=parse_split(args.split),
                unit=args.unit,
                metrics=args.metric,
                duration_seconds=parse_duration(args.duration),
                check_seconds=parse_duration(args.check),
                alpha=args.alpha,
                who=who,
            )
        except ValidationError as err:
            raise IpnextError(f"experiment start: {format_validation_error(err)}") from None
        undirected = ask.missing_directions()
        if undirected:
            first = undirected[0]
            raise IpnextError(
                f"experiment start: --metric {first} does not say which way is better. "
                f"Fix: --metric {first}:higher (clicks, revenue) or --metric {first}:lower (latency, cost)"
            )

    result = asyncio.run(_act(settings, args, ask, who))
    if args.verb == "promote":
        print(f"{result.set_id} queued for its rollout; `ipnext rollout watch {args.model}` follows it")
        return
    if args.verb == "start":
        print(
            f"experiment {args.name} of {args.model}: {result.control} (control) against {result.treatment}"
        )
        print(f"  workflow {result.workflow_id}; `ipnext experiment status {args.model}` follows it")
        return
    if getattr(args, "json", False):
        print(json.dumps(result.model_dump(mode="json"), indent=2))
        return
    print(
        f"experiment {result.name} of {result.model}: "
        f"{result.phase}{', ' + result.outcome if result.outcome else ''}"
    )
    if result.end:
        print(f"  {result.end}")
    for reading in result.guardrails:
        print(f"  guardrail {reading.describe()}")
    if result.report is not None:
        print()
        print(render_report(result.report))


async def _act(settings: Settings, args: argparse.Namespace, ask: Any, who: str) -> Any:
    """One verb of `experiment` or `shadow` through the SDK: start (`ask`), stop, promote or status."""
    from ipnext.client.sdk import Client

    async with await Client.connect(settings) as ipn:
        if ask is not None:
            if "@" not in ask.treatment:  # a version: the set of the model that holds it
                ask = ask.model_copy(
                    update={"treatment": await _set_of_version(ipn, args.model, ask.treatment)}
                )
            return await ipn.start_experiment(args.model, ask)
        if args.verb == "stop":
            return await ipn.stop_experiment(args.model, args.reason, who=who)
        if args.verb == "promote":
            return await ipn.promote_experiment(args.model, args.name, who=who)
        return await ipn.experiment_status(args.model, args.name)


async def _set_of_version(ipn: Any, model: str, version: str) -> str:
    """The id of the model's set of `version` (a held one first: what experiments compare)."""
    sets = [s for s in (await ipn.get_model(model)).sets if s.version == version]
    if not sets:
        raise IpnextError(
            f"{model} has no set of version {version!r}: publish it with `ipnext snapshot publish {model} "
            "FOLDER --hold`, or name a set id (MODEL@N)."
        )
    held = [s for s in sets if s.status == "held"]
    return str((held or sets)[-1].id)
