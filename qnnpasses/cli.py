"""qnnpasses: prepare ONNX models for Qualcomm's HTP (NPU) and check them on the real backend.

Run ``qnnpasses COMMAND --help`` for a command's options.  Exit codes: 0 success, 1 a check
failed, 2 bad usage or input, 3 an internal error.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys

from qnnpasses.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, QnnPassesError

# The order of `qnnpasses --help`; any other module in qnnpasses/commands is listed after these.
COMMANDS = ("run", "passes", "pipelines", "check", "lint", "diagnose", "analyze", "compare", "partition", "convert",
            "compile", "quantize", "sweep", "llm", "generate")
#: Modules of qnnpasses/commands that are helpers, not commands.
HELPERS = ("common",)
#: Commands that talk to the HTP backend: they take --soc / --htp-arch (qnnpasses.backends.targets).
BACKEND_COMMANDS = ("run", "check", "lint", "diagnose", "compare", "partition", "compile", "quantize", "sweep", "llm",
                    "generate")


def command_names() -> list[str]:
    """Every command module: the ordered ones first, then the rest alphabetically."""
    import pkgutil

    import qnnpasses.commands as package

    found = {m.name for m in pkgutil.iter_modules(package.__path__)
             if not m.name.startswith("_") and m.name not in HELPERS}
    return [n for n in COMMANDS if n in found] + sorted(found - set(COMMANDS))

EPILOG = """typical session:
  qnnpasses check model.onnx                 what would run on the HTP, and why not
  qnnpasses run model.onnx -o model.htp.onnx  rewrite it for the HTP (pipeline htp-llm)
  qnnpasses compare model.onnx model.htp.onnx --on htp
  qnnpasses compile model.htp.onnx -o model_ctx.onnx"""


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(EXIT_BAD_INPUT)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's layout; wraps option help to the terminal."""


def _broken_command(name: str, exc: BaseException):
    def run(args) -> int:
        raise QnnPassesError(f"the '{name}' command cannot load: {type(exc).__name__}: {exc}")

    return run


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of command ``only`` alone (imports only its module:
    a run need not import the quantization or partitioning tooling)."""
    parser = _ArgumentParser(prog="qnnpasses", description=__doc__.split("\n\n")[0], epilog=EPILOG,
                             formatter_class=_Formatter)
    from qnnpasses import __version__

    parser.add_argument("--version", action="version", version=f"qnnpasses {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands",
                                       parser_class=_ArgumentParser)
    names = command_names()
    for name in [only] if only in names else names:
        try:
            module = importlib.import_module(f"qnnpasses.commands.{name}")
        except Exception as exc:  # noqa: BLE001 - a broken command is reported, never silently dropped
            sys.stderr.write(f"qnnpasses: error: the '{name}' command cannot load: {type(exc).__name__}: {exc}\n")
            broken = subparsers.add_parser(name, help=f"(cannot load: {type(exc).__name__})")
            broken.set_defaults(func=_broken_command(name, exc))
            continue
        before = set(subparsers.choices)
        module.register(subparsers)
        for added in set(subparsers.choices) - before:
            sub = subparsers.choices[added]
            sub.formatter_class = _Formatter
            sub.add_argument("-v", "--verbose", action="store_true",
                             help="also print the backend's own log lines (onnxruntime, QNN)")
            if added in BACKEND_COMMANDS:
                from qnnpasses.commands.common import add_target_args

                add_target_args(sub)
    return parser


def _activate_target(args) -> None:
    """The target the command's backend sessions name (default: X Elite; for generate: its bundle's)."""
    if not hasattr(args, "soc"):
        return
    from qnnpasses.backends.htp import check_target
    from qnnpasses.backends.targets import activate, resolve

    args.target_given = args.soc is not None or args.htp_arch is not None
    target = resolve(args.soc, args.htp_arch)
    if args.target_given:
        check_target(target)
    activate(target)


def _fewer_collections() -> None:
    """Graph rewriting allocates a great many small, long-lived objects (nodes, tensors, the
    pass manager's rollback copies); with Python's default thresholds the cyclic collector
    re-scans them every few hundred allocations, which made a pipeline run grow faster than
    the graph.  What the imports created is frozen out of the scans; collections stay on."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 10)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv[0] if argv else None)
    if not argv:
        parser.print_help(sys.stderr)
        return EXIT_BAD_INPUT
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_BAD_INPUT
    _fewer_collections()
    _clear_backend_log()
    try:
        _activate_target(args)
        return _run(args)
    except BrokenPipeError:
        # the reader went away (`qnnpasses lint ... | head`): stop quietly, like any Unix tool
        _silence_stdout()
        return 141
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
    finally:
        _report_backend_log(getattr(args, "verbose", False))


def _run(args) -> int:
    from qnnpasses.progress import listening, stderr_listener

    quiet = getattr(args, "quiet", False)
    if quiet:
        code = int(args.func(args) or 0)
    else:
        with listening(stderr_listener(sys.stderr)):
            code = int(args.func(args) or 0)
    sys.stdout.flush()  # a closed pipe shows here, inside the handler
    return code


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _clear_backend_log() -> None:
    """Forget backend lines logged before this command (by earlier work in the same process), so the
    summary after it speaks of this command only."""
    htp = sys.modules.get("qnnpasses.backends.htp")
    if htp is not None:
        del htp.BACKEND_LOG[:]


def _report_backend_log(verbose: bool) -> None:
    """The backend's log lines: all of them with -v, else one summary line."""
    htp = sys.modules.get("qnnpasses.backends.htp")
    lines = list(getattr(htp, "BACKEND_LOG", []) or [])
    if not lines:
        return
    del htp.BACKEND_LOG[:]
    try:
        if verbose:
            sys.stderr.write("".join(f"backend: {line}\n" for line in lines))
        else:
            warnings = sum(1 for line in lines if "[W:" in line or "WARNING" in line.upper())
            errors = sum(1 for line in lines if "[E:" in line or "<E>" in line or "ERROR" in line.upper())
            kinds = ", ".join(f"{n} {k}" for n, k in ((errors, "error(s)"), (warnings, "warning(s)")) if n)
            sys.stderr.write(f"qnnpasses: the backend logged {len(lines)} line(s)"
                             + (f" ({kinds})" if kinds else "") + "; -v shows them\n")
    except (BrokenPipeError, ValueError):
        pass


if __name__ == "__main__":
    raise SystemExit(main())
