"""docs/ARCHITECTURE.md names only what exists: every file path, every `module.name` and every
class or function it puts in backticks is looked up in the source (as text, so nothing heavy is
imported). A rename that forgets the map fails here, naming the stale name."""

from __future__ import annotations

import builtins
import re
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The map: the overview and its pages.
DOCS = [REPO / "docs" / "ARCHITECTURE.md", *sorted((REPO / "docs" / "architecture").glob("*.md"))]
LAYER_FOLDERS = ("workflows", "activities", "planner", "serving", "kernels", "examples")
# ipnext/'s packages by role: a short name (`counters.SetCounters`) may live in any of them.
ROLE_PACKAGES = ("spec", "contracts", "policy", "store", "client")

SPAN = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^[a-z_][a-z0-9_./-]*(\.py|\.md|\.yaml|/)$")
DOTTED = re.compile(r"^[a-z_][a-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+(\(.*\))?$")
CAMEL = re.compile(r"^[A-Z][a-z]+[A-Z][A-Za-z]*$")
CALL = re.compile(r"^([a-z_][a-z0-9_]*)\(.*\)")


def module_file(dotted: str) -> Path | None:
    """`ipnext.serving.layout` (or `serving.layout`, `layout`, `contracts`) -> its source file."""
    parts = dotted.split(".")
    if parts[0] == "ipnext":
        parts = parts[1:]
    candidates = [parts]
    if parts and parts[0] not in LAYER_FOLDERS:
        candidates += [[folder, *parts] for folder in LAYER_FOLDERS + ROLE_PACKAGES]
    for rel in candidates:
        if not rel:
            continue
        root = REPO / rel[0] if rel[0] in LAYER_FOLDERS else REPO / "ipnext" / rel[0]
        path = root.joinpath(*rel[1:])
        for file in (path.with_suffix(".py"), path / "__init__.py"):
            if file.is_file():
                return file
    return None


@cache
def all_sources() -> str:
    files = [f for f in (REPO / "ipnext").rglob("*.py") if f.relative_to(REPO).parts[1] not in LAYER_FOLDERS]
    for folder in LAYER_FOLDERS:
        files += (REPO / folder).rglob("*.py")
    return "\n".join(f.read_text() for f in files)


def defines(source: str, name: str) -> bool:
    """Defined, imported (a third-party name the code uses) or a quoted name (a search attribute)."""
    pattern = (
        rf"^\s*(class|def|async def)\s+{name}\b|^\s*{name}\s*[:=]|^\s*{name}\s*,?\s*$|\b{name} = "
        rf"|^\s*from \S+ import .*\b{name}\b|\"{name}\""
    )
    return re.search(pattern, source, re.MULTILINE) is not None


def find_path(span: str) -> bool:
    """A path from the repository root, or from ipnext/ or a card folder (`client/prediction.py`),
    or a bare file name that some package holds (`layout.py`)."""
    rel = span.rstrip("/")
    roots = [REPO, REPO / "ipnext", *(REPO / f for f in LAYER_FOLDERS)]
    if any((root / rel).exists() for root in roots):
        return True
    return "/" not in rel and any(next(root.rglob(rel), None) is not None for root in roots[1:])


def stale(span: str) -> str | None:
    """Why a backticked span names nothing that exists, or None."""
    if any(c in span for c in "<>{}* ") or span.startswith(("http", "-", "/")):
        return None
    if PATH.match(span):
        return None if find_path(span) else f"no file or folder {span}"
    call = CALL.match(span)
    if call and "." not in call[1]:
        return None if defines(all_sources(), call[1]) else f"no function {call[1]}"
    if DOTTED.match(span):
        names = span.split("(")[0].split(".")
        for i in range(len(names), 0, -1):
            file = module_file(".".join(names[:i]))
            if file is not None:
                source = file.read_text()
                missing = [n for n in names[i:] if not defines(source, n)]
                return f"{file.relative_to(REPO)} defines no {missing}" if missing else None
        return None  # a field path (`router.max_ongoing_requests`), not a module
    if CAMEL.match(span):
        known = hasattr(builtins, span) or defines(all_sources(), span)
        return None if known else f"no class {span}"
    return None


def test_every_name_in_the_map_exists() -> None:
    spans = [span for doc in DOCS for span in SPAN.findall(doc.read_text())]
    assert len(spans) > 100, "the map lost its names?"
    problems = sorted({f"`{s}`: {why}" for s in spans if (why := stale(s))})
    assert not problems, "the architecture pages name what does not exist:\n" + "\n".join(problems)


def test_the_checker_catches_a_stale_name() -> None:
    assert stale("names.model_workflow_id") is None
    assert stale("serving.layout.SetDescription") is None
    assert stale("planner/block/") is None
    assert stale("names.no_such_helper") is not None
    assert stale("RolloutCheckpoint") is not None
    assert stale("serving/apps_gone.py") is not None
    assert stale("layout.py") is None and stale("gone_module.py") is not None
