"""Workflow code never uses `assert`: an AssertionError is not an ApplicationError, so the
workflow task would retry forever instead of failing with a reason."""

from __future__ import annotations

import ast
from pathlib import Path

WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"


def asserts_in(source: str) -> list[int]:
    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Assert)]


def test_no_workflow_module_asserts() -> None:
    files = sorted(WORKFLOWS.glob("*.py"))
    assert len(files) >= 4, f"found only {files}: is the path right?"
    found = [f"{f.name}:{line}" for f in files for line in asserts_in(f.read_text())]
    assert not found, "raise a non-retryable ApplicationError instead of assert at " + ", ".join(found)


def test_the_check_finds_an_assert() -> None:
    assert asserts_in("def f(x):\n    assert x is not None\n    return x\n") == [2]
