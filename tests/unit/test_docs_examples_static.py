"""Every Python block of the README and the docs pages, at unit speed: a block that needs no stack
runs here as written; one that needs the live stack is checked against the code it calls (it
compiles, every module it imports exists, every name it takes from ipnext is there, and every
call the text makes visibly on an ipnext class, function or object binds to that callable's
signature, every attribute it reads of one is a field or attribute of its class) and names the
real-stack test that runs it as written (`LIVE`). A new block must be put in one of the two.

Types are followed as far as the text shows them: `with C(...) as x`, `x = await C.connect()`, a
return annotation (`reply = ipn.predict(...)` is a `Prediction`), a `for` over a `list[C]`, an
`except C as err`. Anything else (a subscript, a local function) is left unchecked.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import re
import types
import typing
from collections.abc import Iterator
from typing import Any

import pytest

from tests.docs_examples import REPO, Block, blocks

pytestmark = pytest.mark.timeout(120)

PYTHON = [b for b in blocks() if b.lang == "python"]
# Blocks that need no stack: run here, as written.
RUNS_HERE = {"kernels"}
# Blocks that need the live stack -> the real-stack test that runs them as written.
LIVE = {
    "readme-sdk": "tests/integration/test_cli.py",
    "sdk-client": "tests/integration/test_cli.py",
    "sdk-prediction-client": "tests/integration/test_cli.py",
    "llm-openai-chat": "tests/integration/test_llm.py",
}


# ---- what a name in the text stands for ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Thing:
    """An ipnext object the text names (a module, class, function, a class's method), an
    instance of an ipnext class, or an iterable of such instances."""

    kind: str  # "object", "instance", "method" or "items"
    value: Any  # the object; for the others, the class
    method: Any = None  # for "method": the function on the class


def _ours(value: Any) -> bool:
    module = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", "")
    return isinstance(module, str) and (module == "ipnext" or module.startswith("ipnext."))


def _class_of(hint: Any) -> Thing | None:
    """The ipnext class a type hint names (`C`, `C | None`, `list[C]`), as what it gives."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        kept = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return _class_of(kept[0]) if len(kept) == 1 else None
    if typing.get_origin(hint) in (list, tuple, set, frozenset) and typing.get_args(hint):
        inner = _class_of(typing.get_args(hint)[0])
        return Thing("items", inner.value) if inner and inner.kind == "instance" else None
    return Thing("instance", hint) if inspect.isclass(hint) and _ours(hint) else None


def _returns(function: Any) -> Thing | None:
    try:
        hints = typing.get_type_hints(inspect.unwrap(getattr(function, "__func__", function)))
    except Exception:  # a hint only a type checker can resolve: leave the result unchecked
        return None
    return _class_of(hints["return"]) if "return" in hints else None


def _has_attribute(cls: type, name: str) -> bool:
    """A class attribute, a pydantic or dataclass field, an annotation, or `self.<name>` set in its
    source (instance attributes a constructor makes)."""
    if hasattr(cls, name) or name in getattr(cls, "model_fields", {}):
        return True
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}):
            return True
        try:
            if _ours(klass) and re.search(rf"\bself\.{name}\b", inspect.getsource(klass)):
                return True
        except (OSError, TypeError):
            pass
    return False


def _field_type(cls: type, name: str) -> Thing | None:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:
        return None
    return _class_of(hints[name]) if name in hints else None


class Checker:
    """Follows what the block's names stand for and records each mismatch with ipnext's code."""

    def __init__(self, block: Block) -> None:
        self.block = block
        self.names: dict[str, Thing | None] = {}  # None: bound to more than one kind of thing
        self.problems: list[str] = []

    def say(self, node: ast.AST, problem: str) -> None:
        line = self.block.line + getattr(node, "lineno", 0)
        found = f"{self.block.page.relative_to(REPO)}:{line}: {problem}"
        if found not in self.problems:
            self.problems.append(found)

    def bind(self, name: str, thing: Thing | None) -> None:
        if thing is None:
            return
        if name in self.names and self.names[name] != thing:
            self.names[name] = None
        else:
            self.names[name] = thing

    def resolve(self, node: ast.expr, check: bool = False) -> Thing | None:
        """What `node` stands for, when the text shows it; with `check`, say every attribute
        that is not there and every call that does not bind."""
        if isinstance(node, ast.Await):
            return self.resolve(node.value, check)
        if isinstance(node, ast.Name):
            return self.names.get(node.id)
        if isinstance(node, ast.Attribute):
            return self._attribute(node, check)
        if isinstance(node, ast.Call):
            return self._call(node, check)
        return None

    def _attribute(self, node: ast.Attribute, check: bool) -> Thing | None:
        base = self.resolve(node.value, check)
        if base is None or base.kind in ("method", "items"):
            return None
        if base.kind == "object":
            if not hasattr(base.value, node.attr):
                if check:
                    self.say(node, f"{_name(base.value)} has no attribute {node.attr!r}")
                return None
            value = getattr(base.value, node.attr)
            return Thing("object", value) if _ours(value) or callable(value) else None
        cls = base.value
        if not _has_attribute(cls, node.attr):
            if check:
                self.say(node, f"a {cls.__name__} has no attribute {node.attr!r}")
            return None
        member = inspect.getattr_static(cls, node.attr, None)
        if inspect.isfunction(member):
            return Thing("method", cls, member)
        return _field_type(cls, node.attr)

    def _call(self, node: ast.Call, check: bool) -> Thing | None:
        called = self.resolve(node.func, check)
        if called is None:
            return None
        if called.kind == "method":
            target, leading = called.method, 1  # unbound: `self` first
        elif called.kind == "object" and callable(called.value):
            target, leading = called.value, 0
        else:
            return None
        if check:
            self._fits(node, target, leading)
        if inspect.isclass(target):
            return Thing("instance", target) if _ours(target) else None
        if called.kind == "object" and inspect.ismethod(target) and inspect.isclass(target.__self__):
            # a class's own constructor (`Client.connect`, `PredictionClient.from_settings`)
            return _returns(target) or Thing("instance", target.__self__)
        return _returns(target)

    def _fits(self, node: ast.Call, target: Any, leading: int) -> None:
        """Say when the call's arguments do not bind to `target`'s signature (a call that spreads
        `*args` or `**kwargs` cannot be judged from the text)."""
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            return
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):  # a builtin without one
            return
        try:
            keywords = {k.arg: 0 for k in node.keywords if k.arg is not None}
            bound = signature.bind(*[object()] * (leading + len(node.args)), **keywords)
            _bind_passed_on(target, signature, bound)
        except TypeError as err:
            self.say(node, f"{ast.unparse(node.func)}(...) does not fit {_name(target)}{signature}: {err}")

    def imports(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    module = self._module(node, alias.name)
                    if module is not None:
                        top = alias.name.split(".")[0]
                        self.bind(alias.asname or top, Thing("object", importlib.import_module(top)))
            elif isinstance(node, ast.ImportFrom) and node.module:
                module = self._module(node, node.module)
                if module is None or not _ours(module):
                    continue
                for alias in node.names:
                    if not hasattr(module, alias.name):
                        self.say(
                            node,
                            f"`from {node.module} import {alias.name}`: {node.module} has no {alias.name}",
                        )
                        continue
                    value = getattr(module, alias.name)
                    self.bind(alias.asname or alias.name, Thing("object", value) if _ours(value) else None)

    def _module(self, node: ast.AST, name: str) -> types.ModuleType | None:
        """The module, imported when it is ipnext's; else only found (a third party's)."""
        if not (name == "ipnext" or name.startswith("ipnext.")):
            if importlib.util.find_spec(name.split(".")[0]) is None:
                self.say(node, f"no module {name!r} to import")
            return None
        try:
            return importlib.import_module(name)
        except ImportError as err:
            self.say(node, f"`{name}` does not import: {err}")
            return None

    def follow(self, tree: ast.Module) -> None:
        """Bind the names the text assigns, until nothing new is learned (a binding may use
        another made later in the walk's order)."""
        for _ in range(5):
            before = dict(self.names)
            for node in ast.walk(tree):
                if isinstance(node, ast.withitem) and isinstance(node.optional_vars, ast.Name):
                    self.bind(node.optional_vars.id, self.resolve(node.context_expr))
                elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for target in targets:
                        if isinstance(target, ast.Name):
                            self.bind(target.id, self.resolve(node.value))
                elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
                    items = self.resolve(node.iter)
                    if isinstance(node.target, ast.Name) and items is not None and items.kind == "items":
                        self.bind(node.target.id, Thing("instance", items.value))
                elif isinstance(node, ast.ExceptHandler) and node.name and node.type is not None:
                    caught = self.resolve(node.type)
                    if caught is not None and caught.kind == "object" and inspect.isclass(caught.value):
                        self.bind(node.name, Thing("instance", caught.value))
            if self.names == before:
                return

    def check(self) -> list[str]:
        try:
            tree = ast.parse(self.block.text, filename=self.block.where)
            compile(tree, self.block.where, "exec")
        except SyntaxError as err:
            return [f"{self.block.where}: does not compile: {err}"]
        self.imports(tree)
        self.follow(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call | ast.Attribute) and isinstance(
                getattr(node, "ctx", ast.Load()), ast.Load
            ):
                self.resolve(node, check=True)
        return self.problems


def _passed_on() -> dict[Any, Any]:
    """Callables that pass their `**options` on, as their docstrings say, and where to: the
    keywords a call gives them are bound there too (`PredictionClient(url, retries=3)` fits
    its own `**options`, not its async client's)."""
    from ipnext.client.prediction import AsyncPredictionClient, PredictionClient
    from ipnext.client.sdk import Client

    return {
        PredictionClient: AsyncPredictionClient,
        PredictionClient.from_settings.__func__: AsyncPredictionClient,  # type: ignore[attr-defined]
        AsyncPredictionClient.from_settings.__func__: AsyncPredictionClient,  # type: ignore[attr-defined]
        PredictionClient.predict: AsyncPredictionClient.predict,
        PredictionClient.predict_stream: AsyncPredictionClient.predict_stream,
        Client.predict: AsyncPredictionClient.predict,
        Client.predict_stream: AsyncPredictionClient.predict_stream,
    }


def _bind_passed_on(target: Any, signature: inspect.Signature, bound: inspect.BoundArguments) -> None:
    """Bind the keywords that went to `target`'s `**options` where it passes them on (TypeError
    when they do not fit there)."""
    to = _passed_on().get(getattr(target, "__func__", target))
    options = [p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    if to is not None and options:
        inspect.signature(to).bind_partial(**bound.arguments.get(options[0], {}))


def _name(value: Any) -> str:
    return getattr(value, "__qualname__", None) or getattr(value, "__name__", None) or repr(value)


def _checked(block: Block) -> list[str]:
    return Checker(block).check()


def _block(text: str) -> Block:
    return Block(REPO / "README.md", 1, "python", text, "planted")


# ---- the tests -----------------------------------------------------------------------------


def _ids(found: list[Block]) -> Iterator[str]:
    return (b.name or b.where for b in found)


def test_every_python_block_runs_here_or_names_its_live_test() -> None:
    assert len(PYTHON) >= 5, [b.where for b in PYTHON]
    for block in PYTHON:
        assert (block.name in RUNS_HERE) != (block.name in LIVE), (
            f"{block.where} ({block.name}): put it in RUNS_HERE (it needs no stack) or in LIVE "
            "(with the real-stack test that runs it as written), not both"
        )
    named = {b.name for b in PYTHON}
    assert not (RUNS_HERE | set(LIVE)) - named, (
        f"no such examples any more: {(RUNS_HERE | set(LIVE)) - named}"
    )


@pytest.mark.parametrize("name", sorted(LIVE))
def test_each_live_example_is_run_by_its_real_stack_test(name: str) -> None:
    source = (REPO / LIVE[name]).read_text()
    assert re.search(rf'(example|run_as_written)\("{name}"', source), f"{LIVE[name]} does not run {name!r}"
    assert "pytest.mark.integration" in source, f"{LIVE[name]} is not a real-stack test"


@pytest.mark.parametrize("block", PYTHON, ids=list(_ids(PYTHON)))
def test_every_python_block_fits_the_code_it_calls(block: Block) -> None:
    problems = _checked(block)
    assert not problems, "the example no longer fits ipnext:\n" + "\n".join(problems)


@pytest.mark.parametrize("block", [b for b in PYTHON if b.name in RUNS_HERE], ids=sorted(RUNS_HERE))
def test_every_block_that_needs_no_stack_runs_as_written(block: Block) -> None:
    scope: dict[str, Any] = {"__name__": "__doc_example__"}
    exec(compile(block.text, block.where, "exec"), scope)


def test_the_check_follows_the_sdk_examples_types() -> None:
    """What the check knows of the SDK page's examples: the types it follows are the SDK's."""
    from ipnext import Client, Prediction, PredictionClient

    checker = Checker(next(b for b in PYTHON if b.name == "sdk-client"))
    assert checker.check() == []
    assert checker.names["ipn"] == Thing("instance", Client)
    assert checker.names["reply"] == Thing("instance", Prediction)
    assert checker.names["summary"].value.__name__ == "ModelSummary"  # type: ignore[union-attr]
    checker = Checker(next(b for b in PYTHON if b.name == "sdk-prediction-client"))
    assert checker.check() == []
    assert checker.names["serving"] == Thing("instance", PredictionClient)
    assert checker.names["err"].value.__name__ == "PredictionBadRequestError"  # type: ignore[union-attr]


STALE = {  # what a stale example says -> what the check says of it
    "a-name-ipnext-lacks": ("from ipnext import PredictionClientt\n", "ipnext has no PredictionClientt"),
    "a-module-nowhere": ("import ipnext_nowhere\n", "no module 'ipnext_nowhere'"),
    "an-ipnext-module-gone": ("from ipnext.nowhere import Client\n", "`ipnext.nowhere` does not import"),
    "a-keyword-passed-on-nowhere": (
        "from ipnext import PredictionClient\nPredictionClient('http://x', retries=3)\n",
        "got an unexpected keyword argument 'retries'",
    ),
    "a-keyword-only-given-by-place": (
        "from ipnext import AsyncPredictionClient\nAsyncPredictionClient('http://x', 40.0)\n",
        "too many positional arguments",
    ),
    "a-method-missing-an-argument": (
        "from ipnext import PredictionClient\nwith PredictionClient.from_settings() as s:\n"
        "    s.predict('m')\n",
        "missing a required argument: 'inputs'",
    ),
    "a-misspelt-keyword-of-a-method": (
        "from ipnext import PredictionClient\nwith PredictionClient.from_settings(timeout_s=5) as s:\n"
        "    s.predict('m', {}, sourc='us-east')\n",
        "got an unexpected keyword argument 'sourc'",
    ),
    "a-field-of-the-answer-it-lacks": (
        "from ipnext import PredictionClient\nwith PredictionClient('http://x') as s:\n"
        "    r = s.predict('m', {})\n    print(r.serving_set)\n",
        "a Prediction has no attribute 'serving_set'",
    ),
    "a-verb-the-client-lacks": (
        "from ipnext import Client\nasync def f():\n    async with await Client.connect() as ipn:\n"
        "        await ipn.promote('m')\n",
        "a Client has no attribute 'promote'",
    ),
    "a-class-method-it-lacks": (
        "from ipnext import PredictionClient\nPredictionClient.from_setting()\n",
        "has no attribute 'from_setting'",
    ),
    "text-that-is-not-python": ("with open('x') as f\n", "does not compile"),
}


@pytest.mark.parametrize("stale", sorted(STALE))
def test_a_stale_example_fails_the_check(stale: str) -> None:
    """The check can fail: an example that names what ipnext no longer has, or calls it wrong."""
    code, said = STALE[stale]
    problems = _checked(_block(code))
    assert any(said in p for p in problems), problems


def test_an_example_that_fits_passes_the_check() -> None:
    fits = (
        "from ipnext import PredictionClient\n"
        "with PredictionClient('http://127.0.0.1:8000', api_key='k', timeout_s=5) as serving:\n"
        "    reply = serving.predict('m', {'user': 1}, source='us-east')\n"
        "    print(reply.outputs, reply.set, reply.region, serving.url)\n"
    )
    assert _checked(_block(fits)) == []
