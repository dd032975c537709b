"""The layering of docs/ARCHITECTURE.md, as a test: every module's imports are parsed (AST) and
checked against the tier it belongs to, so a forbidden import fails here, naming the file, the
line, the imported module and the rule it breaks.

The card's folders (workflows/, activities/, planner/, serving/, kernels/, examples/) are
reached through the `ipnext.<folder>` symlinks, which hide an upward import from every tool;
this test walks the folders themselves and maps each file to its `ipnext.*` name.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The card's folders, reached as ipnext.<folder>.
LAYER_FOLDERS = ("workflows", "activities", "planner", "serving", "kernels", "examples")

# The entry tier: exactly these modules of ipnext/, plus anything under these packages.
ENTRY_MODULES = frozenset({"ipnext.cli", "ipnext.sdk", "ipnext.worker", "ipnext.devstack", "ipnext.__main__"})
ENTRY_PACKAGES = ("ipnext.entry", "ipnext.cli")

# What each tier may import from ipnext (third-party imports are free unless banned below).
MAY_IMPORT: dict[str, frozenset[str]] = {
    "ground": frozenset({"ground"}),
    "planner": frozenset({"ground", "planner"}),
    "kernels": frozenset({"ground", "kernels"}),
    "serving": frozenset({"ground", "kernels", "serving"}),
    "activities": frozenset({"ground", "planner", "kernels", "serving", "activities"}),
    "workflows": frozenset({"ground", "activities", "workflows"}),
    # Examples are what users copy: the ground tier, the part library (kernels and the LLM model
    # family parts are built on), the SDK, and each other. Nothing else is a public surface.
    "examples": frozenset({"ground", "kernels", "serving.llm", "sdk", "examples"}),
    "entry": frozenset(
        {"ground", "planner", "kernels", "serving", "activities", "workflows", "examples", "entry"}
    ),
}

# Third-party packages a tier must never import, and why.
BANNED_THIRD_PARTY: dict[str, dict[str, str]] = {
    "planner": {"temporalio": "the planner is pure", "ray": "the planner is pure"},
    "kernels": {"temporalio": "kernels are pure compute", "ray": "kernels are pure compute"},
    "ground": {"ray": "the ground tier runs in every process, Ray or not"},
    "workflows": {"ray": "workflows orchestrate; Ray is reached through activities"},
}

RULES = {
    "ground": "the ground tier (specs, errors, config, contracts, pure maths) imports nothing above it",
    "planner": "the planner imports only the ground tier",
    "kernels": "kernels import only the ground tier",
    "serving": "serving imports only the ground tier and kernels",
    "activities": "activities never import workflows or the entry tier "
    "(address a workflow by name from ipnext.contracts)",
    "workflows": "workflows import only activities and the ground tier",
    "examples": "examples import only the ground tier, the part library (kernels, serving.llm) and the SDK",
    "entry": "",
}


@dataclass(frozen=True)
class Violation:
    file: str
    line: int
    imported: str
    rule: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.imported}: {self.rule}"


def module_name(path: Path) -> str:
    """`serving/router.py` -> `ipnext.serving.router`; `ipnext/model.py` -> `ipnext.model`."""
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] != "ipnext":
        parts.insert(0, "ipnext")
    return ".".join(parts)


def tier_of(module: str) -> str:
    """The tier of an `ipnext.*` module (its own name, not a file)."""
    if module in ENTRY_MODULES or any(module == p or module.startswith(p + ".") for p in ENTRY_PACKAGES):
        return "entry"
    head = module.split(".")[1] if module.count(".") >= 1 else ""
    if head in LAYER_FOLDERS:
        return head
    return "ground"


def _target_allowed(source_tier: str, target: str) -> bool:
    allowed = MAY_IMPORT[source_tier]
    target_tier = tier_of(target)
    if target_tier in allowed:
        return True
    if target_tier == "entry" and "sdk" in allowed and target == "ipnext.sdk":
        return True
    return target_tier == "serving" and "serving.llm" in allowed and target.startswith("ipnext.serving.llm")


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in the source, at any depth (functions too)."""
    found: list[tuple[int, str]] = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from ipnext import serving` imports the module ipnext.serving.
            for alias in node.names:
                candidate = f"{stem}.{alias.name}"
                found.append((node.lineno, candidate if _is_ipnext_module(candidate) else stem))
    return found


def _is_ipnext_module(name: str) -> bool:
    if not name.startswith("ipnext."):
        return False
    rel = name.split(".")[1:]
    head, rest = rel[0], rel[1:]
    root = REPO / head if head in LAYER_FOLDERS else REPO / "ipnext" / head
    path = root.joinpath(*rest)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def check_source(file: str, source: str) -> list[Violation]:
    """The violations of one module, given its repository path and its text."""
    path = REPO / file
    module = module_name(path)
    tier = tier_of(module)
    violations = []
    for line, imported in sorted(set(imports_of(source, module, path.name == "__init__.py"))):
        top = imported.split(".")[0]
        if top == "ipnext" and imported != "ipnext":
            if not _target_allowed(tier, imported):
                rule = RULES[tier] + f" ({tier} -> {tier_of(imported)})"
                violations.append(Violation(file, line, imported, rule))
        elif top in BANNED_THIRD_PARTY.get(tier, {}):
            violations.append(
                Violation(
                    file, line, imported, f"{tier} never imports {top}: {BANNED_THIRD_PARTY[tier][top]}"
                )
            )
    return violations


def source_files() -> list[Path]:
    files = [
        p
        for p in (REPO / "ipnext").rglob("*.py")
        if not any(part in LAYER_FOLDERS for part in p.relative_to(REPO).parts[1:2])
    ]
    for folder in LAYER_FOLDERS:
        files.extend((REPO / folder).rglob("*.py"))
    return sorted(f for f in files if "__pycache__" not in f.parts)


def test_every_module_respects_the_layering() -> None:
    files = source_files()
    assert len(files) > 50, f"found only {len(files)} modules: is the walk broken?"
    violations = [v for f in files for v in check_source(str(f.relative_to(REPO)), f.read_text())]
    assert not violations, "layering broken:\n" + "\n".join(map(str, violations))


@pytest.mark.parametrize(
    ("file", "source", "imported"),
    [
        (
            "activities/metadata.py",
            "from ipnext.workflows.model_workflow import ModelWorkflow\n",
            "ipnext.workflows.model_workflow",
        ),
        (
            "ipnext/rollout.py",
            "def f():\n    from ipnext.serving.metrics import SetCounters\n",
            "ipnext.serving.metrics",
        ),
        ("planner/solve.py", "import ray\n", "ray"),
        ("planner/solve.py", "from temporalio import workflow\n", "temporalio"),
        ("serving/router.py", "from ipnext.sdk import Client\n", "ipnext.sdk"),
        (
            "serving/router.py",
            "from ipnext.examples.click_ranker import parts\n",
            "ipnext.examples.click_ranker.parts",
        ),
        ("workflows/model_workflow.py", "from ipnext.serving import layout\n", "ipnext.serving.layout"),
        (
            "examples/click_ranker/parts.py",
            "from ipnext.activities import serving\n",
            "ipnext.activities.serving",
        ),
        ("ipnext/model.py", "from .entry import schedules\n", "ipnext.entry.schedules"),
    ],
)
def test_a_forbidden_import_is_named_with_its_rule(file: str, source: str, imported: str) -> None:
    violations = check_source(file, source)
    assert [v.imported for v in violations] == [imported], violations
    assert violations[0].file == file and violations[0].rule


@pytest.mark.parametrize(
    ("file", "source"),
    [
        (
            "activities/serving.py",
            "from ipnext.serving.layout import render\nfrom ipnext.contracts import Workflows\n",
        ),
        ("workflows/rollout_workflow.py", "from ipnext.activities.serving import deploy_set\n"),
        (
            "examples/llm/train.py",
            "from ipnext.serving.llm.model import Decoder\nfrom ipnext.sdk import Client\n",
        ),
        ("ipnext/cli.py", "from ipnext.workflows.model_workflow import ModelWorkflow\n"),
        ("serving/llm/part.py", "from .engine import LLMEngine\n"),
    ],
)
def test_allowed_imports_pass(file: str, source: str) -> None:
    assert check_source(file, source) == []


def test_the_repos_kernels_folder_does_not_stand_in_for_the_kernels_package() -> None:
    """The card's top-level `kernels/` is ipnext.kernels; in the test process a bare `kernels`
    must not resolve to it: transformers (>= 5.25) imports the `kernels` package when it is
    installed, and with the repo root at the front of sys.path it got ours and failed at load
    (pytest's `--import-mode=append` in pyproject.toml keeps the root at the end)."""
    import importlib.util

    spec = importlib.util.find_spec("kernels")
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    assert origin is None or not origin.is_relative_to(REPO / "kernels"), origin
