"""The work units `make test` hands its two workers (tests/conftest.py): each half of the drills is
one unit on one stack, the drills with a stack of their own and the light modules units of their
own, in the hand-out order the conftest's docstring gives."""

from __future__ import annotations

from tests.conftest import unit_order, work_unit


def test_each_test_falls_in_its_unit() -> None:
    assert work_unit("tests/integration/test_rollout.py::test_x") == "integration"
    assert work_unit("tests/integration/test_restart.py::test_y[a]") == "integration"
    assert work_unit("tests/integration/test_replan.py::test_z") == "integration-b"
    assert work_unit("tests/integration/test_demo.py::test_d") == "own-stack:tests/integration/test_demo.py"
    assert work_unit("tests/workflows/test_wait.py::test_w") == "workflows"
    assert work_unit("tests/llm/test_engine.py::test_e") == "llm"
    assert work_unit("tests/unit/test_dag.py::test_u") == "tests/unit/test_dag.py"


def test_units_are_handed_out_in_the_documented_order() -> None:
    units = [
        "own-stack:tests/integration/test_demo.py",
        "tests/unit/test_dag.py",
        "integration-b",
        "workflows",
        "integration",
    ]
    assert sorted(units, key=unit_order) == [
        "integration",
        "workflows",
        "tests/unit/test_dag.py",
        "integration-b",
        "own-stack:tests/integration/test_demo.py",
    ]
