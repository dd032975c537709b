"""What a failed drill prints of its stack (tests/integration/stack_state.py): the stack found
from the test's fixtures, a model's state and a rollout in the few lines that say where they
stand, and a stack that is down still reported, section by section, without raising."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from ipnext.client.devstack.stack import scratch_config
from ipnext.spec.settings import Settings, load_settings
from tests.integration.stack_state import condensed, describe, model_lines, rollout_lines, stack_config_of

REPO = Path(__file__).resolve().parents[2]


def test_the_stack_is_found_from_the_tests_fixtures(tmp_path: Path) -> None:
    config = tmp_path / "ipnext.yaml"
    config.write_text("{}\n")
    settings = load_settings(config)
    assert stack_config_of({"stack": settings, "model_name": "m"}) == settings.source
    assert stack_config_of({"per_region_stack": SimpleNamespace(config=config)}) == config
    assert stack_config_of({"stack_config": config}) == config
    assert stack_config_of({"tmp_path": tmp_path, "settings": Settings()}) is None


def test_a_models_state_and_rollout_read_in_a_few_lines() -> None:
    state = {
        "state": "rolling_out",
        "serving_set": "m@1",
        "serving_apps": {"us-east": "m.us-east.s1.r2"},
        "queued": [],
        "plan": {
            "revision": 3,
            "deployments": {"m/embed": {"replicas": {"us-east": {"cpu": 1}, "eu-west": {}}}},
        },
        "rollout": {"state": "running", "step": "running", "steps_done": 0, "gates": [], "pauses": []},
        "reconcile": {
            "checks": 12,
            "failures": 1,
            "last_failure": "ServingError: Serve app m.eu-west is UNHEALTHY",
        },
    }
    lines = list(model_lines(state))
    assert '  serving_apps: {"us-east": "m.us-east.s1.r2"}' in lines
    assert "  plan: revision 3, regions ['eu-west', 'us-east']" in lines
    assert not [line for line in lines if line.startswith("  queued")]  # empty fields are left out
    assert any(line.startswith("  rollout (the model's record):") for line in lines)
    assert any("Serve app m.eu-west is UNHEALTHY" in line for line in lines)
    paused = {"state": "paused", "pauses": [{"reason": "insufficient_traffic (0 requests on the new set)"}]}
    live = list(rollout_lines(paused))
    assert live[0].startswith('  live rollout: {"state": "paused"}')
    assert "insufficient_traffic" in live[-1] and live[-1].startswith("    last pause:")
    assert list(rollout_lines({})) == []


def test_a_stack_that_is_down_is_still_reported(tmp_path: Path) -> None:
    config = scratch_config(tmp_path, REPO / "config")
    report = describe(config, "m")
    assert report.startswith(f"-- stack of {config}")
    assert "-- dev stack: no record (not up)" in report
    assert "-- models: TemporalConnectionError" in report  # said in its place, the rest goes on
    assert "-- Serve apps: no Ray address file (Ray not up)" in report
    assert "-- worker.log: none" in report


def test_a_logs_looping_traceback_is_cut_so_what_the_worker_did_shows() -> None:
    """The worker's log as CI's stop 54 ended: a Ray metrics thread failing every few seconds,
    each time a traceback, after the lines that said what the worker had done."""
    said = [
        "WARNING 2026-12-06 01:35:40,101 reconcile t1: repairing t1.us-east.s1.r1: lost",
        "WARNING 2026-12-06 01:36:10,412 rollout serving check failed (tried again next interval): timed out",
    ]
    loop: list[str] = []
    for second, owner in ((9, "a8fc07a3e951a5a7"), (19, "b2fc07a3e951a5a8"), (29, "c3fc07a3e951a5a9")):
        loop += [
            "Traceback (most recent call last):",
            '  File "ray/serve/_private/router.py", line 438, in push_autoscaling_metrics_to_controller',
            "    if not check_obj_ref_ready_nowait(self._pending_metrics_push_ref):",
            "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
            f"ValueError: An application is trying to access a Ray object whose owner is unknown({owner} ).",
            f"ERROR 2026-12-06 01:37:{second:02d},779 serve 1016 -- "
            "Failed to run metrics task 'push_metrics'",
        ]
    lines = condensed(said + loop)
    assert lines[:2] == said  # what the worker did, still in a tail of a few lines
    assert not [line for line in lines if line.startswith(("Traceback", "  File", "    "))], lines
    assert lines[2].startswith("ValueError") and lines[3].startswith("ERROR"), lines
    assert lines[4:] == ["(4 more line(s) like those above)"], lines
