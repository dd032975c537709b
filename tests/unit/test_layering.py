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

# ipnext/'s own packages by role (docs/ARCHITECTURE.md), each one tier; `ipnext.errors` and
# `ipnext.names` are the root every tier stands on, and the package itself (the lazy public API)
# and `python -m ipnext` belong to the client tier they expose.
ROLE_PACKAGES = ("spec", "contracts", "policy", "store", "client")
ROOT_MODULES = frozenset({"ipnext.errors", "ipnext.names"})
CLIENT_MODULES = frozenset({"ipnext", "ipnext.__main__"})
# Old paths the README and examples showed, kept as re-exports of the names they used.
COMPAT_MODULES = frozenset(
    {"ipnext.sdk", "ipnext.model", "ipnext.snapshots", "ipnext.registry", "ipnext.config", "ipnext.auth"}
)

# What each tier may import from ipnext (third-party imports are free unless banned below).
MAY_IMPORT: dict[str, frozenset[str]] = {
    "root": frozenset({"root"}),
    "spec": frozenset({"root", "spec"}),
    "contracts": frozenset({"root", "spec", "contracts"}),
    "policy": frozenset({"root", "spec", "contracts", "policy"}),
    "store": frozenset({"root", "spec", "contracts", "policy", "store"}),
    "planner": frozenset({"root", "spec", "contracts", "planner"}),
    "kernels": frozenset({"root", "kernels"}),
    "serving": frozenset({"root", "spec", "contracts", "policy", "store", "kernels", "serving"}),
    "activities": frozenset(
        {"root", "spec", "contracts", "policy", "store", "planner", "kernels", "serving", "activities"}
    ),
    "workflows": frozenset({"root", "spec", "contracts", "policy", "activities", "workflows"}),
    # Examples are what users copy: the public API (`ipnext`), specs, contracts and the snapshot
    # store, the part library (kernels, and serving.llm the LLM family's parts are built on), and
    # each other.
    "examples": frozenset({"root", "spec", "contracts", "store", "kernels", "serving.llm", "examples"}),
    "client": frozenset(
        {
            "root",
            "spec",
            "contracts",
            "policy",
            "store",
            "planner",
            "kernels",
            "serving",
            "activities",
            "workflows",
            "examples",
            "client",
        }
    ),
}

# Third-party packages a tier must never import, and why.
BANNED_THIRD_PARTY: dict[str, dict[str, str]] = {
    "planner": {"temporalio": "the planner is pure", "ray": "the planner is pure"},
    "kernels": {"temporalio": "kernels are pure compute", "ray": "kernels are pure compute"},
    "root": {"ray": "the root runs in every process"},
    "spec": {"ray": "a spec is checked where it is written", "temporalio": "specs need no server"},
    "contracts": {"ray": "contracts are data, read in every process"},
    "policy": {"ray": "decisions are pure", "temporalio": "decisions are pure"},
    "store": {"ray": "files need no cluster"},
    "workflows": {"ray": "workflows orchestrate; Ray is reached through activities"},
}

RULES = {
    "root": "ipnext.errors and ipnext.names import nothing of ipnext beyond each other",
    "spec": "specs import only the root and other specs",
    "contracts": "contracts import the root, specs and each other, never a policy",
    "policy": "policies import the root, specs, contracts and each other",
    "store": "the store imports the root, specs, contracts and policies",
    "planner": "the planner imports only the root, specs and contracts",
    "kernels": "kernels import only the root",
    "serving": "serving imports the tiers below the client, and kernels",
    "activities": "activities never import workflows or the client tier "
    "(address a workflow by name from ipnext.names)",
    "workflows": "workflows import only activities and the tiers below them",
    "examples": "examples import only the public API, specs, contracts, the store and the part library",
    "client": "",
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
    """`serving/router.py` -> `ipnext.serving.router`; `ipnext/model.py` -> `ipnext.spec.model`."""
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] != "ipnext":
        parts.insert(0, "ipnext")
    return ".".join(parts)


def tier_of(module: str) -> str:
    """The tier of an `ipnext.*` module (its own name, not a file)."""
    if module in ROOT_MODULES:
        return "root"
    if module in CLIENT_MODULES or module in COMPAT_MODULES:
        return "client"
    head = module.split(".")[1] if module.count(".") >= 1 else ""
    if head in LAYER_FOLDERS or head in ROLE_PACKAGES:
        return head
    raise ValueError(f"{module}: in no tier; a module of ipnext/ goes in one of {ROLE_PACKAGES}")


def _target_allowed(source_tier: str, target: str) -> bool:
    if target == "ipnext":  # the public API: what users (and examples) import
        return source_tier in ("examples", "client")
    allowed = MAY_IMPORT[source_tier]
    target_tier = tier_of(target)
    if target_tier in allowed:
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
        if top == "ipnext":
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
            "ipnext/policy/gates.py",
            "def f():\n    from ipnext.serving.metrics import SetCounters\n",
            "ipnext.serving.metrics",
        ),
        (
            "ipnext/contracts/rollout.py",
            "from ipnext.policy.gates import judge_window\n",
            "ipnext.policy.gates",
        ),
        (
            "ipnext/spec/model.py",
            "if TYPE_CHECKING:\n    from ipnext.contracts.plan import Plan\n",
            "ipnext.contracts.plan",
        ),
        ("ipnext/names.py", "import ray\n", "ray"),
        ("serving/router.py", "from ipnext import Client\n", "ipnext"),
        ("planner/solve.py", "import ray\n", "ray"),
        ("planner/solve.py", "from temporalio import workflow\n", "temporalio"),
        ("serving/router.py", "from ipnext.client.sdk import Client\n", "ipnext.client.sdk"),
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
        ("ipnext/spec/model.py", "from ..client import schedules\n", "ipnext.client.schedules"),
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
            "from ipnext.serving.layout import render\nfrom ipnext.names import Workflows\n",
        ),
        ("workflows/rollout_workflow.py", "from ipnext.activities.serving import deploy_set\n"),
        (
            "examples/llm/train.py",
            "from ipnext.serving.llm.model import Decoder\nfrom ipnext import Client\n",
        ),
        ("ipnext/client/cli/model.py", "from ipnext.workflows.model_workflow import ModelWorkflow\n"),
        ("ipnext/policy/gates.py", "from ipnext.contracts.counters import SetCounters\n"),
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
