"""Reading spec files: YAML that rejects duplicate keys, and pydantic errors turned into SpecErrors.

PyYAML silently keeps the last of two equal keys, which would let a model with two
parts named alike lose one without a word; this loader refuses them instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml

from ipnext.errors import SpecError

__all__ = ["format_validation_error", "load_yaml", "parse_spec"]

SpecT = TypeVar("SpecT", bound=pydantic.BaseModel)


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                line = key_node.start_mark.line + 1
                raise SpecError(
                    f"duplicate name {key!r} at line {line}.",
                    field=str(key),
                    value=key,
                    fix="give every part, region and key a unique name",
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path) -> Any:
    """Parse a YAML file, refusing duplicate keys; errors name the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError(
            f"{path}: file not found.", field="path", value=str(path), fix="check the path"
        ) from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except SpecError as err:
        raise SpecError(f"{path}: {err}", field=err.field, value=err.value) from None
    except yaml.YAMLError as err:
        raise SpecError(f"{path}: not valid YAML: {err}", field="yaml", value=None) from None


def format_validation_error(err: pydantic.ValidationError) -> str:
    """One line per problem: the field path, what is wrong, and the value given."""
    lines = []
    for item in err.errors(include_url=False):
        loc = ".".join(str(p) for p in item["loc"])
        msg = str(item["msg"]).removeprefix("Value error, ")
        value = item.get("input")
        shown = "" if isinstance(value, dict | list) else f" (got {value!r})"
        lines.append(f"{loc}: {msg}{shown}" if loc else msg)
    return "; ".join(lines)


def parse_spec(cls: type[SpecT], data: Any, *, source: str = "spec") -> SpecT:
    """Validate `data` as `cls`, raising a SpecError whose text names every bad field."""
    try:
        return cls.model_validate(data)
    except pydantic.ValidationError as err:
        first = err.errors(include_url=False)[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        raise SpecError(
            f"{source} is invalid: {format_validation_error(err)}",
            field=field,
            value=first.get("input"),
        ) from None
