"""Arguments and helpers shared by several commands."""

from __future__ import annotations

from qnnpasses.errors import BadInputError
from qnnpasses.passmanager.api import load_entry_point_plugins, load_plugin_file


def add_plugin_args(parser) -> None:
    parser.add_argument("--plugin", action="append", default=[], metavar="FILE.py",
                        help="import passes from a Python file (repeatable); entry-point plugins load always")


def load_plugins(files: list[str]) -> None:
    load_entry_point_plugins()
    for file in files:
        load_plugin_file(file)


def parse_shape_args(values: list[str]) -> dict[str, list[int]]:
    """``NAME=D0,D1,...`` (repeatable) into a dict; errors name the bad argument."""
    shapes: dict[str, list[int]] = {}
    for value in values:
        name, sep, dims = value.partition("=")
        if not sep or not name:
            raise BadInputError(f"--shape expects NAME=D0,D1,... (got '{value}')")
        try:
            parsed = [int(d) for d in dims.split(",") if d.strip() != ""]
        except ValueError:
            raise BadInputError(f"--shape {name}: dimensions must be integers (got '{dims}')") from None
        if any(d < 0 for d in parsed):
            raise BadInputError(f"--shape {name}: dimensions must not be negative")
        shapes[name] = parsed
    return shapes
