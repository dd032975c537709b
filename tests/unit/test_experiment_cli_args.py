"""`ipnext experiment start`'s arms and split as the README writes them, read before anything
connects: `--arms control=@current,treatment=v4`, `--split 90/10`, `--unit`, `--metric`."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ipnext.client.cli.experiment import parse_arms, parse_split
from ipnext.contracts.experiment import StartExperimentInput
from ipnext.errors import IpnextError


def test_arms_name_the_treatment_and_the_control_is_the_serving_set() -> None:
    assert parse_arms("control=@current,treatment=v4") == "v4"
    assert parse_arms(" treatment = feed-ranker@4 , control = @current ") == "feed-ranker@4"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("treatment=v4", "name two arms, control and treatment"),
        ("control=@current,treatment=v4,b=v5", "one treatment arm"),
        ("control=@current,control=@current", "named twice"),
        ("control=feed-ranker@2,treatment=v4", "the control is the set that serves, @current"),
        ("control,treatment=v4", "arm=set pairs"),
        ("control=@current,treatment=", "arm=set pairs"),
    ],
)
def test_bad_arms_are_refused_with_the_fix(text: str, says: str) -> None:
    with pytest.raises(IpnextError, match=says):
        parse_arms(text)


def test_a_split_is_control_over_treatment_or_the_treatments_share() -> None:
    assert parse_split("50/50") == 50 and parse_split("90/10") == 10 and parse_split("12.5") == 12.5
    for bad in ("60/60", "50/50/0", "half", "/"):
        with pytest.raises(IpnextError, match="summing to 100"):
            parse_split(bad)


def test_unit_and_metrics_are_checked_and_named_in_the_error() -> None:
    ok = StartExperimentInput(
        name="e1",
        treatment="m@2",
        duration_seconds=60,
        unit="session",
        metrics=["click:higher", "latency_ms:lower"],
    )
    assert (ok.unit, ok.metrics) == ("session", ["click:higher", "latency_ms:lower"])
    assert ok.directions() == {"click": "higher", "latency_ms": "lower"} and ok.missing_directions() == []
    # Read as before (an experiment started before directions), but a new one must say them.
    old = StartExperimentInput(name="e1", treatment="m@2", duration_seconds=60, metrics=["click"])
    assert old.missing_directions() == ["click"]
    with pytest.raises(ValidationError, match="'click:up' is not an outcome and its direction"):
        StartExperimentInput(name="e1", treatment="m@2", duration_seconds=60, metrics=["click:up"])
    assert StartExperimentInput(name="e1", treatment="m@2", duration_seconds=60).unit == "user"
    with pytest.raises(ValidationError, match="unit"):
        StartExperimentInput(name="e1", treatment="m@2", duration_seconds=60, unit="User Id")
    with pytest.raises(ValidationError, match="'Click!' is not an outcome and its direction"):
        StartExperimentInput(name="e1", treatment="m@2", duration_seconds=60, metrics=["Click!"])
