"""The docs site (mkdocs.yml, docs/): it builds with --strict, so a broken link, a page left out
of the nav or a stale anchor fails the suite; every `ipnext.<module>.<Name>` the README and the
docs mention exists and is public; the README stays a front page of at most 200 lines."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ipnext.contracts.http_routes import ROUTES

from .test_architecture_doc import SPAN, defines, module_file

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
MENTION = re.compile(r"^ipnext(\.[A-Za-z_]\w*)+(\(.*\))?$")
FILE_SUFFIX = re.compile(r"\.(ya?ml|json|py|md|txt|toml|c)$")


def _build(config: Path, out: Path) -> subprocess.CompletedProcess[str]:
    mkdocs = Path(sys.executable).parent / "mkdocs"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [str(mkdocs), "build", "--strict", "-f", str(config), "-d", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=config.parent,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real site, built once with --strict for the tests that read it."""
    out = tmp_path_factory.mktemp("docs") / "site"
    built = _build(REPO / "mkdocs.yml", out)
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def test_the_site_builds_strict(site: Path) -> None:
    assert (site / "index.html").is_file()
    assert (site / "guides" / "rollouts" / "index.html").is_file()


def _copy_site(tmp_path: Path) -> Path:
    """The site's sources in `tmp_path`, for a planted failure. Lean: without the SDK reference
    (mkdocstrings reads the code, half of a build's time), which no planted failure touches."""
    shutil.copytree(REPO / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    config = (REPO / "mkdocs.yml").read_text()
    start, end = config.index("  # The SDK's reference"), config.index("markdown_extensions:")
    (tmp_path / "mkdocs.yml").write_text(config[:start] + config[end:])
    sdk = tmp_path / "docs" / "reference" / "sdk.md"
    sdk.write_text(re.sub(r"^::: .*$", "", sdk.read_text(), flags=re.M))
    return tmp_path / "mkdocs.yml"


def test_a_planted_broken_link_or_anchor_fails_the_build(tmp_path: Path) -> None:
    config = _copy_site(tmp_path)
    index = tmp_path / "docs" / "index.md"
    original = index.read_text()
    index.write_text(
        original
        + "\nSee [the gone page](guides/no-such-page.md) and [a gone section](concepts.md#no-such-section).\n"
    )
    built = _build(config, tmp_path / "site")
    said = built.stdout + built.stderr
    assert built.returncode != 0 and "no-such-page.md" in said and "no-such-section" in said, said


def test_generated_reference_covers_every_command_and_a_bad_marker_fails(site: Path, tmp_path: Path) -> None:
    """The CLI page is generated from the parser (every noun and verb), the file pages from the
    schemas; a marker naming no model fails the build rather than leaving a hole."""
    cli_page = (site / "reference" / "cli" / "index.html").read_text()
    for verb in (
        "ipnext model publish",
        "ipnext snapshot import-hf",
        "ipnext fleet region down",
        "ipnext demo",
    ):
        assert verb in cli_page, verb
    assert "parts.&lt;name&gt;.factory" in (site / "reference" / "model-yaml" / "index.html").read_text()
    bench_page = (site / "benchmarks" / "index.html").read_text()
    for script in (REPO / "bench").glob("*.py"):
        assert f"bench/{script.name}" in bench_page, script.name
    http_page = (site / "reference" / "http" / "index.html").read_text()
    for route in ROUTES:
        assert route.path.replace("{", "&lt;").replace("}", "&gt;") in http_page, route.path
    sdk_page = (site / "reference" / "sdk" / "index.html").read_text()
    for method in (
        "Client.publish_model",
        "Client.wait_until_serving",
        "Client.delete_model",
        "PredictionClient",
    ):
        assert 'id="ipnext.client.' in sdk_page and method in sdk_page, method
    config = _copy_site(tmp_path / "planted")
    page = tmp_path / "planted" / "docs" / "reference" / "settings.md"
    page.write_text(page.read_text() + "\n<!-- generated: fields ipnext.spec.settings.GoneSettings -->\n")
    built = _build(config, tmp_path / "planted" / "site")
    assert built.returncode != 0 and "GoneSettings" in built.stdout + built.stderr


def _literal_all(path: Path) -> list[str] | None:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            if isinstance(node.value, ast.List):
                return [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
    return None


def unknown_or_private(span: str) -> str | None:
    """Why `ipnext.a.b.Name` names nothing public, or None: the longest prefix that is a module
    must define the next name, not privately (`_x`), and list it in its `__all__` if it has one."""
    names = span.split("(")[0].split(".")
    for i in range(len(names), 0, -1):
        prefix = ".".join(names[:i])
        file = REPO / "ipnext" / "__init__.py" if prefix == "ipnext" else module_file(prefix)
        if file is None:
            continue
        rest = names[i:]
        if not rest:
            return None
        name = rest[0]
        if name.startswith("__") and name.endswith("__"):
            return None
        if not defines(file.read_text(), name):
            return f"{file.relative_to(REPO)} defines no {name}"
        if name.startswith("_"):
            return f"{name} is private"
        public = _literal_all(file)
        if public is not None and name not in public:
            return f"{name} is not in {file.relative_to(REPO)}'s __all__"
        return None
    return "no such module"


def test_every_ipnext_name_the_docs_mention_exists_and_is_public() -> None:
    problems = []
    seen = 0
    for page in PAGES:
        for span in SPAN.findall(page.read_text()):
            if MENTION.match(span) and not FILE_SUFFIX.search(span):
                seen += 1
                why = unknown_or_private(span)
                if why:
                    problems.append(f"{page.relative_to(REPO)}: `{span}`: {why}")
    assert seen > 10, "the docs lost their mentions?"
    assert not problems, "\n".join(problems)


def test_the_name_check_catches_a_gone_or_private_name() -> None:
    assert unknown_or_private("ipnext.Client") is None
    assert unknown_or_private("ipnext.client.sdk.Client") is None
    assert unknown_or_private("ipnext.Clinet") is not None
    assert unknown_or_private("ipnext.client.sdk._translate_gone") is not None
    assert unknown_or_private("ipnext.workflows._model_run.ModelRun") is None
    assert "private" in (unknown_or_private("ipnext.errors._every_error_class") or "")


def test_the_readme_is_a_front_page_that_links_into_the_site() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert len(links) > 15
    missing = [link for link in links if not (REPO / link).exists()]
    assert not missing, missing


ARCHITECTURE_PAGES = [
    REPO / "docs" / "ARCHITECTURE.md",
    *sorted((REPO / "docs" / "architecture").glob("*.md")),
]
PRIVATE = re.compile(r"(^|\.)_[A-Za-z]\w*(\.|$)")


def private_names(text: str) -> list[str]:
    """The spans of `text` that name a private function, method or attribute (`x._y`, `_y`);
    files (`workflows/_signals.py`) and dunders are not names of helpers."""
    found = []
    for span in SPAN.findall(text):
        name = span.split("(")[0].strip()
        if "/" in name or " " in name or FILE_SUFFIX.search(name) or name.startswith("__"):
            continue
        if PRIVATE.search(name):
            found.append(span)
    return found


def test_the_architecture_map_names_public_seams_not_private_helpers() -> None:
    problems = {p.name: names for p in ARCHITECTURE_PAGES if (names := private_names(p.read_text()))}
    assert not problems, f"name the public seam instead: {problems}"
    assert private_names("see `RolloutWorkflow._check_serving` and `decompose._first_plan()`") == [
        "RolloutWorkflow._check_serving",
        "decompose._first_plan()",
    ]
