"""``qnnpasses analyze``: weight, activation and KV-cache memory, and per-op cost of a model."""

from __future__ import annotations

import json

from qnnpasses.analysis import DEFAULT_RIDGE, run_analysis
from qnnpasses.commands.common import add_deprecated, add_format_arg, add_shape_arg, parse_shape_args
from qnnpasses.errors import BadInputError
from qnnpasses.ir.load import load_model
from qnnpasses.passmanager.report import json_safe


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "analyze", help="how much memory a model needs on device (weights, activations, KV cache) and where it "
                        "spends its work",
        description="Weights, activation memory with and without buffer reuse, KV-cache size and per-op cost, "
                    "from the graph alone (nothing runs).")
    parser.add_argument("model", help="ONNX model")
    parser.add_argument("--context", type=int, default=None, metavar="N",
                        help="context length (tokens) for the KV-cache figures (default: the model's key length)")
    add_format_arg(parser)
    parser.add_argument("--picture", metavar="FILE.png|FILE.svg",
                        help="draw activation memory over the schedule, peak and layers labelled (needs matplotlib)")
    add_deprecated(parser, "--plot", "picture", "--picture VALUE")
    parser.add_argument("--top", type=int, default=10, metavar="N",
                        help="hotspots and live tensors to list (default 10)")
    parser.add_argument("--ridge", type=float, default=DEFAULT_RIDGE, metavar="FLOPS_PER_BYTE",
                        help=f"ridge point of the target: nodes below it are memory bound (default {DEFAULT_RIDGE:g})")
    add_shape_arg(parser)
    parser.set_defaults(func=main, picture=None)


def main(args) -> int:
    if args.top <= 0:
        raise BadInputError(f"--top must be positive (got {args.top})")
    shapes = parse_shape_args(args.shape)
    ir = load_model(args.model)
    unknown = sorted(set(shapes) - {t.name for t in ir.graph.inputs})
    if unknown:
        raise BadInputError(f"--shape names unknown inputs {unknown}")
    picture = getattr(args, "picture", None)
    if picture:  # fail on a bad name or a missing matplotlib before the work, not after
        from qnnpasses.analysis.plot import _pyplot, check_path

        check_path(picture)
        _pyplot()
    report, trace = run_analysis(ir, args.context, top=args.top, ridge=args.ridge, shapes=shapes)
    if picture:
        from qnnpasses.analysis.plot import plot_memory

        plot_memory(trace, picture, title=f"{args.model}: activation memory")
    if args.format == "json":
        print(json.dumps(json_safe(report), indent=2))
    else:
        from qnnpasses.analysis.text import render_text

        print(render_text(report, args.top))
        if picture:
            print(f"picture written to {picture}")
    return 0
