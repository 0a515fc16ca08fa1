"""``qnnpasses pipelines``: every named pipeline in its textual form, ready to copy and edit."""

from __future__ import annotations

from qnnpasses.commands.common import add_plugin_args, load_plugins
from qnnpasses.passmanager.named import get_pipeline, named_pipelines


def register(subparsers) -> None:
    parser = subparsers.add_parser("pipelines", help="print every named pipeline in textual form")
    add_plugin_args(parser)
    parser.set_defaults(func=main)


def main(args) -> int:
    load_plugins(args.plugin)
    for name, named in sorted(named_pipelines().items()):
        print(f"{name}: {named.summary}")
        print(f"  --passes '{get_pipeline(name).to_text()}'")
    return 0
