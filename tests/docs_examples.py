"""The code blocks of the README and the docs pages, for the tests that check or run them.

A Python example carries a name on the line before its fence, `<!-- example: NAME -->`, and the
test that runs it asks for it by that name (`example("NAME")`), so an edit to the page is an edit
to what the suite runs. `tests/unit/test_docs_examples.py` checks the rest by kind: every `ipnext`
command line parses under the CLI's own parser, every YAML block validates against the schema of
the file it shows, and every named example is run by some test.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(\s*)```(\w*)[^\n]*$")
NAME = re.compile(r"^\s*<!-- example: ([a-z0-9-]+) -->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is (`page`, `line` of its opening fence, 1-based), its language,
    its text (the fence's indentation removed) and its name, if the line before names it."""

    page: Path
    line: int
    lang: str
    text: str
    name: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(pages: list[Path] | None = None) -> list[Block]:
    found = []
    for page in pages or PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            opened = FENCE.match(lines[i])
            if not opened:
                i += 1
                continue
            indent, lang = opened[1], opened[2]
            named = NAME.match(lines[i - 1]) if i else None
            end = i + 1
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            body = [line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end]]
            found.append(Block(page, i + 1, lang, "\n".join(body) + "\n", named[1] if named else None))
            i = end + 1
    return found


def example(name: str) -> str:
    """The Python example the docs name `name`, as written (KeyError if none has that name)."""
    named = [b for b in blocks() if b.name == name]
    if len(named) != 1:
        raise KeyError(f"{len(named)} docs examples are named {name!r} (want exactly one)")
    return named[0].text


def substituted(code: str, replacements: dict[str, str]) -> str:
    """`code` with each key replaced by its value; a key the example no longer holds fails, so the
    test and the page cannot drift apart silently."""
    for old, new in replacements.items():
        if old not in code:
            raise AssertionError(f"the docs example no longer contains {old!r}: update the test")
        code = code.replace(old, new)
    return code
