"""``qnnpasses passes``: every registered pass with its summary and options, plugins included."""

from __future__ import annotations

import dataclasses
import typing

from qnnpasses.commands.common import add_plugin_args, load_plugins
from qnnpasses.passmanager.api import (
    format_option_value,
    pass_origin,
    registered_passes,
)


def register(subparsers) -> None:
    parser = subparsers.add_parser("passes", help="list every registered pass with its options")
    add_plugin_args(parser)
    parser.set_defaults(func=main)


def main(args) -> int:
    load_plugins(args.plugin)
    for name, cls in registered_passes().items():
        flags = [] if cls.lossless else ["lossy"]
        flags += [f"requires {r}" for r in sorted(cls.requires)]
        origin = pass_origin(name)
        if not origin.startswith("qnnpasses.passes"):
            flags.append(f"plugin {origin}")
        suffix = f"  [{', '.join(flags)}]" if flags else ""
        print(f"{name:<22} {cls.summary}{suffix}")
        hints = typing.get_type_hints(cls.Options)
        for field in dataclasses.fields(cls.Options):
            type_name = getattr(hints[field.name], "__name__", str(hints[field.name]))
            default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            doc = field.metadata.get("help", "")
            print(f"    {field.name}: {type_name} = {format_option_value(default)}" + (f"  {doc}" if doc else ""))
    return 0
