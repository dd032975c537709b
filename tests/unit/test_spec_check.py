"""The factory check in a child process: the real child, with real modules on its path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ipnext.activities.spec_check import check_factories_in_child
from ipnext.errors import SpecError
from ipnext.model import ModelSpec


def with_factory(spec: ModelSpec, factory: str) -> ModelSpec:
    data = spec.model_dump(mode="json")
    data["parts"]["embed"]["factory"] = factory
    return ModelSpec.model_validate(data)


@pytest.fixture
def owner_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on the child's import path (the child inherits the environment), not on ours."""
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return tmp_path


def test_the_example_factories_pass(example_spec: ModelSpec) -> None:
    check_factories_in_child(example_spec)


def test_a_missing_module_is_named_with_its_part(example_spec: ModelSpec) -> None:
    with pytest.raises(SpecError, match=r"parts\.embed\.factory: .*'no_such_module_xyz' does not import"):
        check_factories_in_child(with_factory(example_spec, "no_such_module_xyz:Part"))
    assert "no_such_module_xyz" not in sys.modules


def test_the_owners_code_runs_in_the_child_only(example_spec: ModelSpec, owner_code: Path) -> None:
    (owner_code / "noisy_parts.py").write_text("print('hello from import')\nPart = object\n")
    check_factories_in_child(with_factory(example_spec, "noisy_parts:Part"))  # its print is not the answer
    assert "noisy_parts" not in sys.modules


def test_a_module_that_exits_or_hangs_is_refused(example_spec: ModelSpec, owner_code: Path) -> None:
    (owner_code / "exits.py").write_text("import os\nos._exit(3)\n")
    with pytest.raises(SpecError, match="ended with code 3 and no answer"):
        check_factories_in_child(with_factory(example_spec, "exits:Part"))
    (owner_code / "hangs.py").write_text("import time\ntime.sleep(600)\n")
    with pytest.raises(SpecError, match="did not finish within 2 s"):
        check_factories_in_child(with_factory(example_spec, "hangs:Part"), timeout_s=2)


def test_a_factory_that_is_not_callable_is_refused(example_spec: ModelSpec, owner_code: Path) -> None:
    (owner_code / "plain.py").write_text("Part = 3\n")
    with pytest.raises(SpecError, match=r"parts\.embed\.factory: .*has no callable 'Part'"):
        check_factories_in_child(with_factory(example_spec, "plain:Part"))
