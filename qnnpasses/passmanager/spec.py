"""Pipelines: a sequence of passes and fixed-point groups, with a textual form that round-trips.

Grammar::

    pipeline := item ("," item)*
    item     := NAME options?                      a pass
              | "repeat" options? "(" pipeline ")"  run until nothing changes (option max=N, default 4)
    options  := "{" KEY "=" VALUE ("," KEY "=" VALUE)* "}"

Example: ``fix-shapes{batch=1,seq=128},simplify,repeat{max=3}(layout,simplify)``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Union

from qnnpasses.errors import PipelineSpecError
from qnnpasses.passmanager.api import (
    Pass,
    format_option_value,
    get_pass,
    parse_option_value,
)

DEFAULT_REPEAT_MAX = 4


@dataclass
class Repeat:
    """Run ``items`` again until an iteration changes nothing, at most ``max_iterations`` times."""

    items: list["Item"]
    max_iterations: int = DEFAULT_REPEAT_MAX


Item = Union[Pass, Repeat]


@dataclass
class Pipeline:
    items: list[Item] = field(default_factory=list)

    def passes(self) -> list[Pass]:
        return list(_flatten(self.items))

    def to_text(self) -> str:
        return format_items(self.items)

    def with_options(self, name: str, **options) -> "Pipeline":
        """A copy in which every ``name`` pass runs with ``options`` on top of its own."""
        return Pipeline(_with_options(self.items, name, options))

    def __add__(self, other: "Pipeline") -> "Pipeline":
        """This pipeline, then ``other``."""
        return Pipeline(list(self.items) + list(other.items))


def _with_options(items: list[Item], name: str, options: dict) -> list[Item]:
    out: list[Item] = []
    for item in items:
        if isinstance(item, Repeat):
            out.append(Repeat(_with_options(item.items, name, options), item.max_iterations))
        elif item.name == name:
            out.append(type(item)(dataclasses.replace(item.options, **options)))
        else:
            out.append(item)
    return out


def _flatten(items: list[Item]):
    for item in items:
        if isinstance(item, Repeat):
            yield from _flatten(item.items)
        else:
            yield item


# --------------------------------------------------------------------------- parsing

_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)|(?P<punct>[,{}()=]))")


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.pos = 0

    def fail(self, message: str) -> PipelineSpecError:
        return PipelineSpecError(f"bad pipeline spec at column {self.pos + 1}: {message} (in '{self.text}')")

    def peek(self) -> str | None:
        rest = self.text[self.pos:].lstrip()
        return rest[0] if rest else None

    def expect(self, char: str) -> None:
        if self.peek() != char:
            found = self.peek()
            raise self.fail(f"expected '{char}' but found {repr(found) if found else 'the end'}")
        self.pos = self.text.index(char, self.pos) + 1

    def name(self) -> str:
        match = _TOKEN.match(self.text, self.pos)
        if not match or not match.group("name"):
            found = self.peek()
            raise self.fail(f"expected a pass name but found {repr(found) if found else 'the end'}")
        self.pos = match.end()
        return match.group("name")

    def value(self) -> str:
        """An option value: everything up to the next ',' or '}' at this level (may hold ':' and '-')."""
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in ",}{()":
            self.pos += 1
        value = self.text[start:self.pos].strip()
        if not value:
            raise self.fail("empty option value")
        return value

    def options(self) -> dict[str, str]:
        options: dict[str, str] = {}
        if self.peek() != "{":
            return options
        self.expect("{")
        while True:
            key = self.name()
            self.expect("=")
            if key in options:
                raise self.fail(f"option '{key}' given twice")
            options[key] = self.value()
            if self.peek() == ",":
                self.expect(",")
                continue
            self.expect("}")
            return options

    def items(self, closing: str | None) -> list[Item]:
        items: list[Item] = []
        while True:
            items.append(self.item())
            nxt = self.peek()
            if nxt == ",":
                self.expect(",")
                continue
            if nxt == closing:
                return items
            raise self.fail(f"expected ',' or {repr(closing) if closing else 'the end'} but found {repr(nxt)}")

    def item(self) -> Item:
        name = self.name()
        options = self.options()
        if name == "repeat":
            unknown = set(options) - {"max"}
            if unknown:
                raise self.fail(f"repeat takes only the option 'max' (got {sorted(unknown)})")
            try:
                max_iterations = int(options.get("max", DEFAULT_REPEAT_MAX))
            except ValueError:
                raise self.fail(f"repeat max must be an integer (got '{options['max']}')") from None
            if max_iterations < 1:
                raise self.fail("repeat max must be at least 1")
            self.expect("(")
            inner = self.items(")")
            self.expect(")")
            return Repeat(inner, max_iterations)
        pass_cls = get_pass(name)
        values = {key: parse_option_value(pass_cls, key, text) for key, text in options.items()}
        try:
            return pass_cls(**values)
        except (TypeError, ValueError) as exc:
            raise PipelineSpecError(f"pass '{name}': {exc}") from None


def parse_pipeline(text: str) -> Pipeline:
    """Parse the textual form into pass instances; errors name the column and the problem."""
    if not text or not text.strip():
        raise PipelineSpecError("empty pipeline spec")
    parser = _Parser(text)
    items = parser.items(None)
    return Pipeline(items)


def split_items(text: str) -> list[str]:
    """The top-level items of a comma-separated list whose items may be pipelines: commas inside
    ``{...}`` options or ``repeat(...)`` do not split (``a{x=1,y=2},b`` -> ``a{x=1,y=2}``, ``b``)."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += (char in "{(") - (char in "})")
        if char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


# --------------------------------------------------------------------------- printing


def format_items(items: list[Item]) -> str:
    return ",".join(_format_item(item) for item in items)


def _format_item(item: Item) -> str:
    if isinstance(item, Repeat):
        options = "" if item.max_iterations == DEFAULT_REPEAT_MAX else f"{{max={item.max_iterations}}}"
        return f"repeat{options}({format_items(item.items)})"
    explicit = item.explicit_options()
    if not explicit:
        return item.name
    body = ",".join(f"{k}={format_option_value(v)}" for k, v in explicit.items())
    return f"{item.name}{{{body}}}"
