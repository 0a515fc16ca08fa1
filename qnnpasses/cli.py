"""The ``qnnpasses`` command line: one module per sub-command under ``qnnpasses.commands``.

Each command module exposes ``register(subparsers)``, which adds its parser and sets
``func`` (taking the parsed arguments, returning an exit code).  Errors derived from
:class:`QnnPassesError` become one line on stderr and their exit code; no traceback
unless ``QNNPASSES_DEBUG=1``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from qnnpasses.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, QnnPassesError

# Order is the order of `qnnpasses --help`.
COMMANDS = ("run", "passes", "pipelines", "check", "lint", "diagnose", "analyze", "compare", "partition", "convert", "compile", "quantize", "sweep", "llm")


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="qnnpasses", description=__doc__.splitlines()[0])
    from qnnpasses import __version__

    parser.add_argument("--version", action="version", version=f"qnnpasses {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_ArgumentParser)
    subparsers.required = True
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"qnnpasses.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"qnnpasses.commands.{name}":
                continue  # command not built yet
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except QnnPassesError as exc:
        if os.environ.get("QNNPASSES_DEBUG"):
            raise
        sys.stderr.write(f"qnnpasses: error: {exc}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("qnnpasses: interrupted\n")
        return 130
    except Exception as exc:  # noqa: BLE001 - last line of defence: one line, not a traceback
        if os.environ.get("QNNPASSES_DEBUG"):
            raise
        sys.stderr.write(
            f"qnnpasses: internal error: {type(exc).__name__}: {exc} (set QNNPASSES_DEBUG=1 for a traceback)\n"
        )
        return EXIT_INTERNAL


if __name__ == "__main__":
    raise SystemExit(main())
