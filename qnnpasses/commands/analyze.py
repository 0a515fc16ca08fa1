"""``qnnpasses analyze``: weight, activation and KV-cache memory, and per-op cost of a model."""

from __future__ import annotations

import json

from qnnpasses.analysis import DEFAULT_RIDGE, run_analysis
from qnnpasses.commands.common import parse_shape_args
from qnnpasses.errors import BadInputError
from qnnpasses.ir.load import load_model
from qnnpasses.passmanager.report import json_safe


def register(subparsers) -> None:
    parser = subparsers.add_parser("analyze", help="memory plan (weights, activations, KV cache) and per-op cost")
    parser.add_argument("model", help="ONNX model")
    parser.add_argument("--context", type=int, default=None, metavar="N",
                        help="context length (tokens) for the KV-cache figures (default: the model's key length)")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="plot activation memory over the schedule (needs matplotlib)")
    parser.add_argument("--top", type=int, default=10, metavar="N",
                        help="hotspots and live tensors to list (default 10)")
    parser.add_argument("--ridge", type=float, default=DEFAULT_RIDGE, metavar="FLOPS_PER_BYTE",
                        help=f"ridge point of the target: nodes below it are memory bound (default {DEFAULT_RIDGE:g})")
    parser.add_argument("--shape", action="append", default=[], metavar="NAME=D0,D1,...",
                        help="static shape for an input with symbolic dims (repeatable)")
    parser.set_defaults(func=main)


def main(args) -> int:
    if args.top <= 0:
        raise BadInputError(f"--top must be positive (got {args.top})")
    shapes = parse_shape_args(args.shape)
    ir = load_model(args.model)
    unknown = sorted(set(shapes) - {t.name for t in ir.graph.inputs})
    if unknown:
        raise BadInputError(f"--shape names unknown inputs {unknown}")
    if args.plot:  # fail on a missing matplotlib before the work, not after
        from qnnpasses.analysis.plot import _pyplot

        _pyplot()
    report, trace = run_analysis(ir, args.context, top=args.top, ridge=args.ridge, shapes=shapes)
    if args.plot:
        from qnnpasses.analysis.plot import plot_memory

        plot_memory(trace, args.plot, title=f"{args.model}: activation memory")
    if args.format == "json":
        print(json.dumps(json_safe(report), indent=2))
    else:
        from qnnpasses.analysis.text import render_text

        print(render_text(report, args.top))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0
