"""Chat templates and the tokenizer of a Hugging Face checkpoint.

A checkpoint brings its chat template as code: a Jinja template in `tokenizer_config.json`
(`chat_template`, a string or a list of named templates, "default" taken) or in
`chat_template.jinja` beside it (which wins, as transformers reads it). It is rendered the way
transformers renders it (`messages`, `add_generation_prompt`, the special tokens by name,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII, `{% generation %}` blocks,
loop controls, trim_blocks and lstrip_blocks), in Jinja's `ImmutableSandboxedEnvironment`: the
template cannot reach Python's internals or change what it is given.

At publish (`ChatTemplate` is built when the part is built, in the validation's child process)
a template is refused when it does not parse, when it names an attribute or item the sandbox
would block (`__class__`, `mro`, `__globals__`, ... : an attempt to escape, refused before any
request), or when it cannot render one user message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from ipnext.errors import CheckpointError
from ipnext.serving.llm.hf import HFCheckpoint
from ipnext.serving.llm.text import TextCodec

__all__ = ["ChatTemplate", "checkpoint_codec"]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# Attributes no chat template has a reason to touch: the ways out of a sandbox.
_UNSAFE_NAMES = {
    "mro",
    "func_globals",
    "func_code",
    "gi_frame",
    "gi_code",
    "cr_frame",
    "f_globals",
    "f_locals",
}


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks the assistant's tokens for training
    masks): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        next(parser.stream)
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class ChatTemplate:
    """One checkpoint's chat template, compiled in the sandbox and checked (see the module)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str], where: str = TOKENIZER_CONFIG) -> None:
        self.source = source
        self.where = where
        self._special = dict(special_tokens)
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            parsed = env.parse(source)
        except jinja2.exceptions.TemplateSyntaxError as err:
            raise CheckpointError(
                f"{where}: the chat template does not parse (line {err.lineno}: {err.message})",
                field="chat_template",
            ) from None
        self._refuse_escapes(parsed)
        self._template = env.from_string(source)
        try:
            self.render([{"role": "user", "content": "hello"}], add_generation_prompt=True)
        except CheckpointError:
            raise
        except Exception as err:  # raise_exception, a missing variable used wrongly, ...
            raise CheckpointError(
                f"{where}: the chat template cannot render one user message: {type(err).__name__}: {err}",
                field="chat_template",
            ) from None

    def _refuse_escapes(self, parsed: nodes.Template) -> None:
        for node in parsed.find_all((nodes.Getattr, nodes.Getitem)):
            name = node.attr if isinstance(node, nodes.Getattr) else _constant(getattr(node, "arg", None))
            if isinstance(name, str) and (name.startswith("_") or name in _UNSAFE_NAMES):
                raise CheckpointError(
                    f"{self.where}: the chat template reaches for {name!r} (line {node.lineno}), which "
                    "only a template escaping its sandbox would; refused",
                    field="chat_template",
                    fix="use the checkpoint's published chat template",
                )

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The conversation as the model was trained to read it."""
        try:
            text: str = self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self._special,
            )
        except jinja2.exceptions.SecurityError as err:
            raise CheckpointError(
                f"{self.where}: the chat template was stopped by the sandbox: {err}"
            ) from None
        return text


def _constant(node: nodes.Node | None) -> Any:
    return node.value if isinstance(node, nodes.Const) else None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _template_source(files: Mapping[str, bytes], config: Mapping[str, Any]) -> tuple[str, str] | None:
    if TEMPLATE_FILE in files:
        return files[TEMPLATE_FILE].decode("utf-8"), TEMPLATE_FILE
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template, TOKENIZER_CONFIG
    return None


def checkpoint_codec(files: Mapping[str, bytes], checkpoint: HFCheckpoint) -> TextCodec:
    """The checkpoint's tokenizer (`tokenizer.json`, through the `tokenizers` library), its eos
    ids, and its chat template if it has one."""
    if TOKENIZER_FILE not in files:
        raise CheckpointError(
            f"the checkpoint has no {TOKENIZER_FILE} (ipnext reads the fast tokenizer only)",
            field=TOKENIZER_FILE,
            fix="save the tokenizer with save_pretrained from a fast tokenizer",
        )
    try:
        tokenizer = Tokenizer.from_str(files[TOKENIZER_FILE].decode("utf-8"))
    except Exception as err:
        raise CheckpointError(f"{TOKENIZER_FILE}: not a tokenizer ({err})", field=TOKENIZER_FILE) from None
    config: dict[str, Any] = {}
    if TOKENIZER_CONFIG in files:
        try:
            loaded = json.loads(files[TOKENIZER_CONFIG])
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{TOKENIZER_CONFIG}: not JSON ({err})", field=TOKENIZER_CONFIG) from None
        config = loaded if isinstance(loaded, dict) else {}
    special = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
    if tokenizer.get_vocab_size() > checkpoint.config.vocab_size:
        raise CheckpointError(
            f"{TOKENIZER_FILE}: {tokenizer.get_vocab_size()} tokens, more than config.json's vocab_size "
            f"{checkpoint.config.vocab_size}",
            field="vocab_size",
        )
    eos = list(checkpoint.eos_token_ids)
    if (
        not eos
        and "eos_token" in special
        and (found := tokenizer.token_to_id(special["eos_token"])) is not None
    ):
        eos = [found]
    source = _template_source(files, config)
    chat = ChatTemplate(source[0], special, source[1]) if source is not None else None
    return TextCodec(
        tokenizer, bos=checkpoint.bos_token_id, eos=eos, special_tokens_in_prompt=True, chat=chat
    )
