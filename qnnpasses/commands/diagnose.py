"""``qnnpasses diagnose``: which node makes the real QNN HTP reject a model as a whole.

Compiles the model on the HTP backend (onnxruntime-qnn, in child processes) and, when it
fails, bisects over sub-models to name the smallest culprit, with the backend's own error
lines and the lint findings on it.  Exit code 0 when the model compiles, 1 when it does not,
2 for bad input or no backend.
"""

from __future__ import annotations

import json

from qnnpasses.commands.common import add_format_arg, add_on_arg, add_shape_arg, shaped_path
from qnnpasses.errors import EXIT_CHECK_FAILED, BackendUnavailableError, BadInputError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "diagnose", help="find the node(s) that make the real HTP reject a model",
        description="Load the model on the real HTP backend; when it fails, try ever smaller pieces of it to "
                    "name the node that makes it fail, with the backend's own error and the lint finding on "
                    "it.  Exit 0 when the model loads and runs on the HTP, 1 when it does not.")
    parser.add_argument("model", help="ONNX model")
    add_on_arg(parser, ("htp",), "htp", "the backend to diagnose on (the HTP)")
    parser.add_argument("--timeout", type=float, default=120.0, metavar="S", help="seconds per HTP probe (default 120)")
    add_shape_arg(parser)
    add_format_arg(parser)
    parser.add_argument("--no-lint", action="store_true", help="do not cross-reference lint findings on the culprit")
    parser.set_defaults(func=main)


def main(args) -> int:
    from qnnpasses.backends.htp import htp_available
    from qnnpasses.debug.diagnose import diagnose, render_text

    if args.timeout <= 0:
        raise BadInputError("--timeout must be a positive number of seconds")
    if not htp_available():
        raise BackendUnavailableError("diagnose needs onnxruntime-qnn with a working QNN HTP backend")
    with shaped_path(args) as path:
        result = diagnose(path, timeout=args.timeout, lint=not args.no_lint)
    result.model = args.model
    print(json.dumps(result.to_dict(), indent=2) if args.format == "json" else render_text(result))
    return 0 if result.ok else EXIT_CHECK_FAILED
