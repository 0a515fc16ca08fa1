"""Arguments and helpers shared by several commands."""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

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


# --------------------------------------------------------------------------- shared vocabulary
# One spelling per idea across the commands:
#   --on cpu|htp      where something runs
#   -o/--output FILE  a file the command writes;  --out-dir DIR  a folder it writes
#   --shape NAME=...  static input shapes, wherever a model is loaded
#   --format ...      how the result is printed

FORMAT_HELP = {"text": "for people", "json": "for scripts", "sarif": "SARIF 2.1.0, for code-scanning tools"}


def add_format_arg(parser, choices=("text", "json")) -> None:
    parser.add_argument("--format", choices=choices, default=choices[0],
                        help="output format: " + "; ".join(f"{c} {FORMAT_HELP[c]}" for c in choices)
                             + f" (default {choices[0]})")


def add_target_args(parser) -> None:
    """``--soc`` / ``--htp-arch``, from the one registry of targets (:mod:`qnnpasses.backends.targets`)."""
    from qnnpasses.backends.targets import ARCHS, DEFAULT, TARGETS

    names = ", ".join(f"{t.name} ({t.part})" for t in TARGETS)
    parser.add_argument("--soc", metavar="NAME",
                        help=f"the device to target, by name or part number: {names} "
                             f"(default {DEFAULT.name})")
    parser.add_argument("--htp-arch", metavar="vNN",
                        help=f"the Hexagon HTP arch ({', '.join(f'v{a}' for a in ARCHS)}); "
                             "alone it picks the first SoC of that arch")


def add_shape_arg(parser) -> None:
    parser.add_argument("--shape", action="append", default=[], metavar="NAME=D0,D1,...",
                        help="give an input with symbolic dimensions a static shape (repeatable)")


def add_on_arg(parser, choices, default, help: str) -> None:
    parser.add_argument("--on", choices=choices, default=default, help=help)


class _Deprecated(argparse.Action):
    """An old spelling kept working: sets the new option's value and says so on stderr."""

    def __init__(self, option_strings, dest, replacement: str, value=None, takes_value=False, **kw):
        self.replacement, self.value = replacement, value
        super().__init__(option_strings, dest, nargs=None if takes_value else 0, help=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        value = self.value if self.value is not None else values
        new = self.replacement.replace("VALUE", str(value))
        sys.stderr.write(f"qnnpasses: warning: {option_string} is deprecated; use {new}\n")
        setattr(namespace, self.dest, value)


def add_deprecated(parser, old: str, dest: str, replacement: str, value=None) -> None:
    """Keep ``old`` working as a hidden alias that sets ``dest`` (to ``value``, or to its argument)."""
    parser.add_argument(old, dest=dest, action=_Deprecated, replacement=replacement, value=value,
                        takes_value=value is None, default=argparse.SUPPRESS)


def resolve_shapes(args, ir) -> dict[str, list[int]]:
    """``--shape`` values, checked against the model's inputs."""
    shapes = parse_shape_args(getattr(args, "shape", []) or [])
    names = {t.name for t in ir.graph.inputs}
    unknown = sorted(set(shapes) - names)
    if unknown:
        raise BadInputError(f"--shape names unknown inputs {unknown} (inputs: {sorted(names)})")
    return shapes


def apply_shapes(ir, shapes: dict[str, list[int]]):
    """``ir`` with the given static input shapes (the fix-shapes pass), unchanged without any."""
    if not shapes:
        return ir
    from qnnpasses.passmanager.api import PassContext
    from qnnpasses.passmanager.manager import PassManager, RunConfig
    from qnnpasses.passmanager.spec import parse_pipeline

    PassManager(parse_pipeline("fix-shapes"), RunConfig(), [], PassContext(shapes=shapes)).run(ir)
    return ir


def load_shaped(args, path: str | None = None):
    """Load the command's model (``args.model`` unless ``path``) with ``--shape`` applied."""
    from qnnpasses.ir.load import load_model

    ir = load_model(path or args.model)
    return apply_shapes(ir, resolve_shapes(args, ir))


@contextlib.contextmanager
def shaped_path(args, path: str | None = None) -> Iterator[str]:
    """A path to the command's model with ``--shape`` applied: the model itself without
    ``--shape``, else a temporary copy (the input is never modified)."""
    path = path or args.model
    if not getattr(args, "shape", None):
        yield path
        return
    from qnnpasses.ir.model import save_model

    ir = load_shaped(args, path)
    with tempfile.TemporaryDirectory(prefix="qnnpasses-shaped-") as tmp:
        out = Path(tmp) / Path(path).name
        save_model(ir, out)
        yield str(out)


def inputs_static(ir) -> bool:
    """True when no graph input has a symbolic dimension (then a dynamic shape inside the
    graph comes from shape arithmetic, not from the inputs)."""
    from qnnpasses.ir.shapes import symbolic_dims

    inputs = {t.name for t in ir.graph.inputs}
    return not any(name in inputs for name in symbolic_dims(ir.graph))
