"""mkdocs hook: the reference sections that have a source of truth in the code are generated from
it at build time, so they cannot drift. A page asks for one with a marker line:

    <!-- generated: cli -->                            every command, from the CLI's own parser
    <!-- generated: fields ipnext.spec.model.ModelSpec -->   every field of a file, from its pydantic schema
    <!-- generated: benches -->                        every benchmark in bench/, from its docstring
    <!-- generated: http-routes -->                    every HTTP route, from ipnext.contracts.http_routes

A marker that names nothing fails the build (mkdocs --strict turns the hook's error into a failure).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import re
from pathlib import Path
from typing import Any

MARKER = re.compile(r"^<!-- generated: (cli|benches|http-routes|fields (\S+)) -->$", re.M)
REPO = Path(__file__).resolve().parents[1]


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def generate(m: re.Match[str]) -> str:
        if m[1] == "cli":
            return cli_reference()
        if m[1] == "benches":
            return benches()
        if m[1] == "http-routes":
            return http_routes()
        return fields_reference(m[2])

    return MARKER.sub(generate, markdown)


# ---- benchmarks -------------------------------------------------------------------------------


def benches() -> str:
    """Each bench/*.py that writes results: what it measures (its docstring's first paragraph),
    how to run it, and the results files it leaves in bench/results/."""
    out = []
    for script in sorted((REPO / "bench").glob("*.py")):
        text = script.read_text()
        summary = (ast.get_docstring(ast.parse(text)) or "").split("\n\n")[0]
        results = sorted(set(re.findall(r"bench/results/([a-z0-9-]+\.json)", text)))
        out += [f"## `bench/{script.name}`", "", " ".join(summary.split()), ""]
        if "ArgumentParser" in text:  # a command (the others are its helpers)
            out += ["```sh", f".venv/bin/python bench/{script.name} --help", "```", ""]
        if results:
            out += ["Results: " + ", ".join(f"`bench/results/{name}`" for name in results) + ".", ""]
    return "\n".join(out)


# ---- the HTTP routes -------------------------------------------------------------------------


def http_routes() -> str:
    """The route table the routers dispatch on, one row per route, grouped by the app answering."""
    from ipnext.contracts.http_routes import ROUTES

    apps = {
        "router": "a model's router in a region, mounted at `/<region>/models/<model>`",
        "routing": "the routing app: routing documents, the OpenAI door, the engine metrics",
        "serve": "Ray Serve's own proxy",
    }
    out = ["| method | path | answered by | what | answers |", "|---|---|---|---|---|"]
    for route in ROUTES:
        path = route.path.replace("{", "<").replace("}", ">")
        out.append(f"| {route.method} | `{path}` | {apps[route.app]} | {route.what} | {route.answers} |")
    return "\n".join(out) + "\n"


# ---- the CLI ----------------------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def _arguments(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        name = ", ".join(action.option_strings) or action.dest
        choices = f" (one of {', '.join(map(str, action.choices))})" if action.choices else ""
        default = (
            "" if action.default in (None, False, argparse.SUPPRESS) else f" Default: `{action.default}`."
        )
        text = (action.help or "").replace("%%", "%").replace("|", "\\|")
        rows.append(f"| `{name}` | {text}{choices}{default} |")
    return rows


def _command(path: str, parser: argparse.ArgumentParser, help_text: str, out: list[str], level: int) -> None:
    children = _subparsers(parser)
    if children:
        helps = _helps(parser)
        for name, child in children.items():
            _command(f"{path} {name}", child, helps.get(name, ""), out, level)
        return
    usage = " ".join(parser.format_usage().split()).removeprefix("usage: ")
    out += [
        f"{'#' * level} `{path}`",
        "",
        help_text[:1].upper() + help_text[1:] + ("." if help_text else ""),
        "",
    ]
    out += ["```", usage, "```", ""]
    rows = _arguments(parser)
    if rows:
        out += ["| argument | what it does |", "|---|---|", *rows, ""]


def cli_reference() -> str:
    from ipnext.client.cli import parser as cli_parser

    root = cli_parser()
    out: list[str] = []
    helps = _helps(root)
    for noun, parser in _subparsers(root).items():
        if _subparsers(parser):  # a noun with verbs: its own heading, a section per verb under it
            text = helps.get(noun, "")
            out += [f"## `ipnext {noun}`", "", text[:1].upper() + text[1:] + ".", ""]
            _command(f"ipnext {noun}", parser, text, out, 3)
        else:
            _command(f"ipnext {noun}", parser, helps.get(noun, ""), out, 2)
    return "\n".join(out)


# ---- files, from their pydantic schemas -------------------------------------------------------


def _type(node: dict[str, Any], defs: dict[str, Any]) -> str:
    if "$ref" in node:
        return node["$ref"].rsplit("/", 1)[-1]
    if "anyOf" in node:
        return " or ".join(_type(n, defs) for n in node["anyOf"])
    if "enum" in node:
        return " \\| ".join(f"`{v}`" for v in node["enum"])
    if "const" in node:
        return f"`{node['const']}`"
    kind = node.get("type", "any")
    if kind == "array":
        return f"list of {_type(node.get('items', {}), defs)}"
    if kind == "object":
        values = node.get("additionalProperties") or next(
            iter(node.get("patternProperties", {}).values()), None
        )
        return f"map of {_type(values, defs)}" if isinstance(values, dict) else "map"
    return str(kind)


def _constraints(node: dict[str, Any]) -> str:
    words = {
        "minimum": ">=",
        "exclusiveMinimum": ">",
        "maximum": "<=",
        "exclusiveMaximum": "<",
        "minLength": "length >=",
        "maxLength": "length <=",
        "minItems": "items >=",
        "maxItems": "items <=",
        "minProperties": "entries >=",
    }
    found = [f"{word} {node[key]}" for key, word in words.items() if key in node]
    if "pattern" in node:
        found.append(f"matches `{node['pattern']}`")
    return ", ".join(found)


def _rows(schema: dict[str, Any], defs: dict[str, Any], prefix: str, seen: tuple[str, ...]) -> list[str]:
    rows = []
    required = set(schema.get("required", []))
    for name, node in schema.get("properties", {}).items():
        path = f"{prefix}{name}"
        default = (
            f"`{json.dumps(node['default'])}`"
            if "default" in node
            else ("required" if name in required else "")
        )
        rows.append(f"| `{path}` | {_type(node, defs)} | {default} | {_constraints(node)} |")
        inner = node
        key = ".<name>" if node.get("type") == "object" and "$ref" not in node else ""
        if node.get("type") == "object" and "$ref" not in node:
            inner = node.get("additionalProperties") or next(
                iter(node.get("patternProperties", {}).values()), {}
            )
        if node.get("type") == "array":
            inner, key = node.get("items", {}), "[]"
        if isinstance(inner, dict) and "anyOf" in inner:
            inner = next((n for n in inner["anyOf"] if "$ref" in n), inner)
        ref = inner.get("$ref", "").rsplit("/", 1)[-1] if isinstance(inner, dict) else ""
        if ref and ref in defs and ref not in seen:
            rows += _rows(defs[ref], defs, f"{path}{key}.", (*seen, ref))
    return rows


def fields_reference(dotted: str) -> str:
    module, _, name = dotted.rpartition(".")
    model = getattr(importlib.import_module(module), name)
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    rows = _rows(schema, defs, "", (name,))
    header = [
        f"Every field of `{name}` (generated from its schema; unknown fields are refused):",
        "",
        "| field | type | default | constraints |",
        "|---|---|---|---|",
    ]
    return "\n".join([*header, *rows, ""])
