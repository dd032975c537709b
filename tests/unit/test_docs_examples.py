"""The docs' code blocks are checked against the code they show, each by its kind:

- every `ipnext ...` line of a shell block parses under the CLI's own parser (a renamed verb or a
  removed flag fails here), every `python -m ipnext...` names a module that exists, every
  `make X` a target of the Makefile;
- every YAML block validates against the schema of the file it shows (model.yaml, fleet.yaml,
  demand.yaml, freeze.yaml), an excerpt (one holding `...`) by its top-level keys;
- every Python block is named (`<!-- example: NAME -->`) and run by a test that asks for it by
  that name; the ones that need no stack run here, the others on the real stack
  (`tests/integration/test_cli.py`, the LLM drill).
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch
import yaml

from ipnext.client.cli import parser
from ipnext.contracts.freeze import FreezeCalendar
from ipnext.serving.routing_app import METRICS_PATH
from ipnext.spec.demand_file import DemandFile
from ipnext.spec.fleet import Fleet
from ipnext.spec.model import ModelSpec
from tests.docs_examples import REPO, Block, blocks, example

ALL = blocks()
OPTIONAL = re.compile(r"\[(--[^\]]+)\]")  # `[--who ann]` in a command line: checked as given
SCHEMAS: dict[str, type[pydantic.BaseModel]] = {
    "model.yaml": ModelSpec,
    "fleet.yaml": Fleet,
    "demand.yaml": DemandFile,
    "freeze.yaml": FreezeCalendar,
}


def _commands(block: Block) -> list[tuple[int, str]]:
    """The block's command lines (continuations joined, prompts and comments dropped), with the
    line each starts on."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for n, raw in enumerate(block.text.splitlines(), start=block.line + 1):
        line = raw.rstrip()
        start, text = pending if pending else (n, "")
        text += " " + line.rstrip("\\")
        if line.endswith("\\"):
            pending = (start, text)
            continue
        pending = None
        out.append((start, text.strip().removeprefix("$ ")))
    return [(n, c) for n, c in out if c and not c.startswith("#")]


def _tokens(command: str) -> list[str]:
    return shlex.split(OPTIONAL.sub(r"\1", command), comments=True)


def _shell_blocks() -> list[Block]:
    return [b for b in ALL if b.lang in ("sh", "bash", "console")]


def test_every_ipnext_command_in_the_docs_parses() -> None:
    checked, failures = 0, []
    for block in _shell_blocks():
        for line, command in _commands(block):
            tokens = _tokens(command)
            if not tokens or Path(tokens[0]).name != "ipnext" or "..." in tokens:
                continue
            try:
                args = parser().parse_args(tokens[1:])
            except SystemExit:
                failures.append(f"{block.page.relative_to(REPO)}:{line}: {command}")
                continue
            assert callable(args.run)
            checked += 1
    assert not failures, "these docs commands do not parse:\n" + "\n".join(failures)
    assert checked >= 40, checked  # the reference and the guides are full of them


def test_a_stale_command_would_fail() -> None:
    """The check above can fail: a verb the CLI does not have and a flag it does not take."""
    for stale in ("ipnext model promote feed-ranker", "ipnext rollout pause feed-ranker --because x"):
        with pytest.raises(SystemExit):
            parser().parse_args(_tokens(stale)[1:])


def test_every_module_and_make_target_the_docs_run_exists() -> None:
    targets = set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))
    seen = 0
    for block in _shell_blocks():
        for line, command in _commands(block):
            tokens = _tokens(command) if "'" not in command or command.count("'") % 2 == 0 else []
            where = f"{block.page.relative_to(REPO)}:{line}"
            if tokens[:1] == ["make"]:
                assert tokens[1] in targets, f"{where}: no make target {tokens[1]!r}"
                seen += 1
            for i, token in enumerate(tokens[:-1]):
                if token == "-m" and tokens[i + 1].startswith("ipnext"):
                    assert importlib.util.find_spec(tokens[i + 1]), f"{where}: no module {tokens[i + 1]}"
                    seen += 1
    assert seen >= 5, seen


def _schema(block: Block) -> type[pydantic.BaseModel] | None:
    data = yaml.safe_load(block.text.replace("{...}", "{}"))
    if not isinstance(data, dict):
        return None
    keys = set(data)
    if "deployments" in keys:
        return DemandFile
    if "freezes" in keys:
        return FreezeCalendar
    if "pools" in keys or "latency_ms" in keys:
        return Fleet
    if keys & {"parts", "dag", "choices", "rollout", "traffic"}:
        return ModelSpec
    return None


def _prometheus_scrape(block: Block) -> bool:
    """A Prometheus scrape config (docs/operations/ports.md): it must scrape the keyed door's path
    with a bearer key, or it shows a scrape that finds nothing."""
    data = yaml.safe_load(block.text)
    if not isinstance(data, dict) or "scrape_configs" not in data:
        return False
    for job in data["scrape_configs"]:
        assert job["metrics_path"] == METRICS_PATH, f"{block.where}: ipnext's metrics are on {METRICS_PATH}"
        assert job["authorization"]["type"] == "Bearer", f"{block.where}: the door needs an operator's key"
    return True


def test_every_yaml_block_validates_against_its_file() -> None:
    checked = 0
    for block in (b for b in ALL if b.lang == "yaml"):
        if _prometheus_scrape(block):
            continue
        schema = _schema(block)
        assert schema is not None, f"{block.where}: a YAML block showing no file ipnext reads"
        if "..." in block.text:  # an excerpt: its keys are the file's
            data: dict[str, Any] = yaml.safe_load(block.text.replace("{...}", "{}"))
            unknown = set(data) - set(schema.model_fields)
            assert not unknown, f"{block.where}: {sorted(unknown)} are not fields of {schema.__name__}"
        else:
            try:
                schema.model_validate(yaml.safe_load(block.text))
            except pydantic.ValidationError as err:
                raise AssertionError(f"{block.where}: not a valid {schema.__name__}: {err}") from None
        checked += 1
    assert checked >= 6, checked


def test_every_python_example_is_named_and_run_by_a_test() -> None:
    tests_text = "\n".join(p.read_text() for p in (REPO / "tests").rglob("test_*.py"))
    for block in (b for b in ALL if b.lang == "python"):
        assert block.name, f"{block.where}: name it (`<!-- example: NAME -->` on the line before)"
        runs = re.search(rf'(example|run_as_written)\("{block.name}"', tests_text)
        assert runs, f"{block.where}: no test runs example {block.name!r}"
    names = [b.name for b in ALL if b.name]
    assert len(names) == len(set(names)), f"example names repeat: {names}"


def test_kernels_example_runs() -> None:
    """The kernels guide's example, as written (on CPU the kernels take their CPU paths)."""
    scope: dict[str, Any] = {}
    exec(compile(example("kernels"), "docs/guides/kernels.md", "exec"), scope)
    assert scope["out"].shape == scope["q"].shape
    assert torch.allclose(
        scope["out"],
        torch.nn.functional.scaled_dot_product_attention(
            scope["q"], scope["k"].repeat_interleave(2, 1), scope["v"].repeat_interleave(2, 1), is_causal=True
        ),
        atol=1e-4,
    )


def test_every_block_says_what_it_holds() -> None:
    """A fence without a language is neither checked nor highlighted: say `sh`, `python`, `yaml`
    (checked above) or `text` (a picture, an output)."""
    bare = [b.where for b in ALL if not b.lang]
    assert not bare, f"blocks without a language: {bare}"
