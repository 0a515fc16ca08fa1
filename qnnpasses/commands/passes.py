"""``qnnpasses passes``: every registered pass with its summary, contract, properties and options,
plugins included; ``--properties`` lists the properties passes require and ensure."""

from __future__ import annotations

import dataclasses
import typing

from qnnpasses.commands.common import add_plugin_args, load_plugins
from qnnpasses.passmanager.api import (
    format_option_value,
    pass_origin,
    registered_passes,
    registered_properties,
)


def register(subparsers) -> None:
    parser = subparsers.add_parser("passes", help="list every registered pass with its options")
    parser.add_argument("--properties", action="store_true", help="list the properties passes require and ensure")
    add_plugin_args(parser)
    parser.set_defaults(func=main)


def main(args) -> int:
    load_plugins(args.plugin)
    if args.properties:
        registered_passes()  # built-in passes declare their properties as they import
        for prop in registered_properties().values():
            checked = "checked" if prop.check is not None else "orders passes only"
            print(f"{prop.name:<22} {prop.summary}  [{checked}]")
        return 0
    for name, cls in registered_passes().items():
        flags = [f"requires {r}" for r in sorted(cls.requires)]
        flags += [f"ensures {r}" for r in sorted(cls.ensures)]
        origin = pass_origin(name)
        if not origin.startswith("qnnpasses.passes"):
            flags.append(f"plugin {origin}")
        suffix = f"  [{', '.join(flags)}]" if flags else ""
        print(f"{name:<22} {cls.summary}{suffix}")
        print(f"    contract: {cls.contract.describe()}")
        hints = typing.get_type_hints(cls.Options)
        for field in dataclasses.fields(cls.Options):
            type_name = getattr(hints[field.name], "__name__", str(hints[field.name]))
            default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            doc = field.metadata.get("help", "")
            print(f"    {field.name}: {type_name} = {format_option_value(default)}" + (f"  {doc}" if doc else ""))
    return 0
