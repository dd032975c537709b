"""No import circles anywhere in ipnext: every import counts, at module level, inside a function or
under TYPE_CHECKING, because each still ties the two modules (neither can be read, moved or tested
without the other). The graph is built from the sources' ASTs, as the layering test reads them."""

from __future__ import annotations

from .test_layering import imports_of, module_name, source_files


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the ipnext modules it imports, for `sources` (module -> (text, is_package)).
    An import of a name from a package counts against the package, not its submodules."""
    graph: dict[str, set[str]] = {}
    for module, (text, is_package) in sources.items():
        targets = {m for _, m in imports_of(text, module, is_package)}
        graph[module] = {t for t in targets if t in sources and t != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def repo_sources() -> dict[str, tuple[str, bool]]:
    return {module_name(p): (p.read_text(), p.name == "__init__.py") for p in source_files()}


def _edge_lines(sources: dict[str, tuple[str, bool]], component: list[str]) -> list[str]:
    """Where each module of a circle imports another of it: file-level evidence for the message."""
    lines = []
    for module in component:
        text, is_package = sources[module]
        for line, target in imports_of(text, module, is_package):
            if target in component and target != module:
                lines.append(f"  {module}:{line} imports {target}")
    return lines


def test_no_module_takes_part_in_an_import_circle() -> None:
    sources = repo_sources()
    assert len(sources) > 50, f"found only {len(sources)} modules: is the walk broken?"
    found = circles(import_graph(sources))
    report = "\n".join(
        "circle: " + " <-> ".join(c) + "\n" + "\n".join(_edge_lines(sources, c)) for c in found
    )
    assert not found, "import circles:\n" + report


def test_a_planted_circle_of_a_function_level_import_is_found() -> None:
    """The check above would miss a circle it cannot see: plant one made of an import inside a
    function, and one under TYPE_CHECKING, into a copy of the real graph."""
    sources = dict(repo_sources())
    text, is_package = sources["ipnext.errors"]
    sources["ipnext.errors"] = (
        text + "\n\ndef _late():\n    from ipnext.spec.settings import Settings\n",
        is_package,
    )
    assert any({"ipnext.errors", "ipnext.spec.settings"} <= set(c) for c in circles(import_graph(sources)))
    planted = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ipnext.spec.settings import Settings\n"
    )
    sources["ipnext.errors"] = (planted + text, is_package)
    assert any({"ipnext.errors", "ipnext.spec.settings"} <= set(c) for c in circles(import_graph(sources)))
