"""Module size as a test: no module of the repo over 800 lines, and one over 600 says in its
docstring why it is one file (the phrase `ONE_FILE_ON_PURPOSE`, then the reason), so a file that
grows past either line fails here, named with its size, instead of quietly becoming the place
where every feature lands."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The repo's own Python: the card's folders, ipnext/'s packages by role, tests and benchmarks
# (ipnext/<folder> are symlinks to the card's folders, so ipnext/ is walked without following them).
FOLDERS = ("ipnext", "workflows", "activities", "planner", "serving", "kernels", "examples", "tests", "bench")
HARD_LIMIT = 800
SOFT_LIMIT = 600
ONE_FILE_ON_PURPOSE = "One file over 600 lines on purpose:"


def modules() -> list[Path]:
    found: list[Path] = []
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if not any(part.is_symlink() for part in [path, *path.parents] if REPO in part.parents):
                found.append(path)
    return found


def size_problem(path: Path, text: str) -> str | None:
    """What is wrong with a module's size, or None."""
    lines = len(text.splitlines())
    name = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    if lines > HARD_LIMIT:
        return f"{name}: {lines} lines, over the {HARD_LIMIT}-line limit: split it by concern"
    if lines > SOFT_LIMIT:
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if ONE_FILE_ON_PURPOSE not in docstring:
            return (
                f"{name}: {lines} lines, over {SOFT_LIMIT}: split it, or say why it is one file in its "
                f"docstring ('{ONE_FILE_ON_PURPOSE} ...')"
            )
    return None


def test_every_module_is_within_its_size() -> None:
    paths = modules()
    assert len(paths) > 100  # the walk found the repo, not an empty folder
    problems = [p for p in (size_problem(path, path.read_text()) for path in paths) if p]
    assert not problems, "modules too long:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize(
    ("lines", "docstring", "expected"),
    [
        (801, ONE_FILE_ON_PURPOSE + " a reason.", "over the 800-line limit"),
        (650, "A module.", "say why it is one file"),
        (650, ONE_FILE_ON_PURPOSE + " a reason.", None),
        (600, "A module.", None),
    ],
)
def test_a_long_module_is_named_with_its_size(
    tmp_path: Path, lines: int, docstring: str, expected: str | None
) -> None:
    path = tmp_path / "big.py"
    text = f'"""{docstring}"""\n' + "x = 1\n" * (lines - 1)
    problem = size_problem(path, text)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and expected in problem and f"{lines} lines" in problem
