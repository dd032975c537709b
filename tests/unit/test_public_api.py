"""The public surface of ipnext, frozen: what `ipnext` exports (lazily, PEP 562), what every
package declares in a literal `__all__`, what the package root costs to import, and the dotted
paths that are contracts (factories in users' YAML and in recorded workflow state, the import
paths Serve deploys by, the old module paths the README and examples showed)."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ipnext

from .test_layering import REPO, source_files

# The surface. Removing a name breaks users: this list changes only with a note in the README.
PUBLIC = [
    "AsyncPredictionClient",
    "CheckpointError",
    "Client",
    "ExperimentError",
    "GenerationError",
    "InfeasiblePlanError",
    "IpnextError",
    "KernelBackendError",
    "KernelInputError",
    "Manifest",
    "ModelExistsError",
    "ModelNotFoundError",
    "ModelRecordError",
    "ModelSpec",
    "ModelState",
    "PartInputError",
    "PlanningTimeoutError",
    "Prediction",
    "PredictionBadRequestError",
    "PredictionClient",
    "PredictionDeadlineError",
    "PredictionError",
    "PredictionNotFoundError",
    "PredictionOverloadedError",
    "PredictionServerError",
    "PredictionTransportError",
    "RegionStateError",
    "RolloutInputError",
    "RolloutPausedError",
    "RolloutStateError",
    "RolloutStatus",
    "RolloutStoppedError",
    "ServingError",
    "Settings",
    "SnapshotError",
    "SnapshotRef",
    "SpecError",
    "StackError",
    "TemporalConnectionError",
    "UpdateInputError",
    "__version__",
    "import_checkpoint",
    "key_header",
    "load_model_spec",
    "load_settings",
    "write_snapshot",
]

# Old module paths the README and examples showed, and the names kept there.
COMPAT = {
    "ipnext.sdk": ["Client", "Prediction", "PredictionClient"],
    "ipnext.model": ["load_model_spec"],
    "ipnext.snapshots": ["Manifest", "import_checkpoint", "write_snapshot"],
    "ipnext.registry": ["ModelState"],
    "ipnext.config": ["Settings"],
    "ipnext.auth": ["key_header"],
}


def test_the_public_surface_is_exactly_the_frozen_list() -> None:
    missing = sorted(set(PUBLIC) - set(ipnext.__all__))
    added = sorted(set(ipnext.__all__) - set(PUBLIC))
    assert not missing, f"public names gone from ipnext.__all__: {missing}"
    assert not added, f"new public names: add them to PUBLIC here (and the README): {added}"


def test_every_public_name_resolves_to_the_object_its_module_defines() -> None:
    for name in PUBLIC:
        value = getattr(ipnext, name)
        home = ipnext._EXPORTS.get(name)
        if home is not None:
            assert value is getattr(importlib.import_module(home), name), name
    with pytest.raises(AttributeError, match="no attribute 'Clinet'"):
        ipnext.Clinet  # noqa: B018


def test_the_type_checkers_imports_name_the_same_homes_as_the_lazy_map() -> None:
    """`ipnext/__init__.py` names each export three times (`__all__`, the TYPE_CHECKING imports
    type checkers read, the lazy map): the three must agree."""
    tree = ast.parse((REPO / "ipnext" / "__init__.py").read_text())
    checked = {
        alias.name: node.module
        for block in tree.body
        if isinstance(block, ast.If) and getattr(block.test, "id", "") == "TYPE_CHECKING"
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert checked == ipnext._EXPORTS
    assert sorted([*checked, "__version__"]) == sorted(ipnext.__all__)


def _literal_all(path: Path) -> list[str] | None:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            value = node.value
            if isinstance(value, ast.List) and all(isinstance(e, ast.Constant) for e in value.elts):
                return [e.value for e in value.elts]
            return None  # computed: not literal
    return None


def test_every_package_declares_a_literal_all() -> None:
    packages = [p for p in source_files() if p.name == "__init__.py"]
    assert len(packages) > 15, packages
    bad = [str(p.relative_to(REPO)) for p in packages if _literal_all(p) is None]
    assert not bad, f"packages without a literal __all__: {bad}"
    assert _literal_all(REPO / "ipnext" / "__init__.py") == ipnext.__all__


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return set(out.stdout.split())


def test_importing_the_package_root_loads_nothing_of_the_client_or_its_libraries() -> None:
    """Every Serve replica imports `ipnext` as the parent of `ipnext.serving.*`."""
    loaded = _loaded_after("import ipnext")
    heavy = sorted(m for m in loaded if m.startswith(("ipnext.", "temporalio", "httpx", "pydantic", "ray")))
    assert heavy == [], heavy


def test_a_replicas_router_module_loads_neither_the_temporal_client_nor_httpx() -> None:
    loaded = _loaded_after("import ipnext.serving.router")
    assert "ipnext.serving.router" in loaded
    assert not {"temporalio.client", "httpx"} & loaded
    assert not [m for m in loaded if m.startswith("ipnext.client")]


def _defines(module: str, name: str) -> bool:
    """`module` has a source file that defines `name` at top level (read, not imported)."""
    parts = module.split(".")[1:]
    root = (
        REPO / parts[0] if (REPO / parts[0]).is_dir() and parts[0] != "ipnext" else REPO / "ipnext" / parts[0]
    )
    base = root.joinpath(*parts[1:])
    for file in (base.with_suffix(".py"), base / "__init__.py"):
        if file.is_file():
            text = file.read_text()
            return re.search(rf"^(class|def|async def) {name}\b|^{name}\s*[:=]", text, re.M) is not None
    return False


def _contract_paths() -> list[str]:
    """module:attr strings users and recorded state hold: every factory in the examples' specs,
    and the import paths Serve deploys apps by."""
    found = set()
    for spec in (REPO / "examples").rglob("*.yaml"):
        found |= set(re.findall(r"factory:\s*([\w.]+:\w+)", spec.read_text()))
    layout = (REPO / "serving" / "layout.py").read_text()
    found |= set(re.findall(r'_IMPORT_PATH = "([\w.]+:\w+)"', layout))
    return sorted(found)


def test_the_dotted_paths_that_are_contracts_stay_put() -> None:
    paths = _contract_paths()
    for pinned in (
        "ipnext.serving.llm.part:LLMPart",
        "ipnext.serving.set_app:set_app",
        "ipnext.serving.router:router_app",
        "ipnext.serving.routing_app:routing_app",
        "ipnext.examples.click_ranker.parts:DensePart",
    ):
        assert pinned in paths, f"{pinned} no longer named where users and Serve name it"
    gone = [p for p in paths if not _defines(*p.split(":"))]
    assert not gone, f"dotted paths that name nothing now: {gone}"
    from ipnext.spec.settings import ModelCodeSettings

    assert ModelCodeSettings().factory_prefixes == ["ipnext.examples.", "ipnext.serving.llm.part"]


def test_the_old_paths_the_readme_showed_still_give_their_names() -> None:
    for module, names in COMPAT.items():
        loaded = importlib.import_module(module)
        assert sorted(loaded.__all__) == names, module
        for name in names:
            assert getattr(loaded, name) is getattr(ipnext, name), f"{module}.{name}"
