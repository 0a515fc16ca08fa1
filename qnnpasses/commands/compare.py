"""``qnnpasses compare``: accuracy of model B against reference A, optionally bisected layer by layer."""

from __future__ import annotations

import json
from pathlib import Path

from qnnpasses.analysis.text import table
from qnnpasses.commands.common import add_format_arg, add_shape_arg, load_shaped
from qnnpasses.debug.compare import TOLERANCES, bisect, compare_models
from qnnpasses.errors import BadInputError, CheckFailedError
from qnnpasses.passmanager.report import json_safe


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "compare", help="compare a model's outputs with a reference model's; --bisect finds the first bad node",
        description="Run the reference A on the CPU (fp32) and B on the CPU or the HTP with the same inputs, "
                    "and compare every output.  When they disagree, --bisect compares the intermediate "
                    "tensors layer by layer and names the first node that goes wrong.")
    parser.add_argument("a", metavar="A.onnx", help="reference model (runs on onnxruntime CPU, fp32)")
    parser.add_argument("b", metavar="B.onnx", help="model under test")
    parser.add_argument("--inputs", metavar="X.npz", help="inputs (default: seeded random inputs for A)")
    parser.add_argument("--on", choices=("cpu", "htp"), default="cpu",
                        help="where B runs: onnxruntime CPU, or the QNN HTP (fp16; integer for QDQ models)")
    parser.add_argument("--bisect", action="store_true",
                        help="when the outputs disagree, compare intermediate tensors layer by layer and name "
                             "the first bad node")
    parser.add_argument("--map", metavar="FILE.json",
                        help='extra tensor name mapping {"A name": "B name"} for --bisect')
    cpu, htp = TOLERANCES["cpu"], TOLERANCES["htp"]
    parser.add_argument("--atol", type=float, default=None,
                        help=f"absolute tolerance (default {cpu[0]:g} on cpu, {htp[0]:g} on htp)")
    parser.add_argument("--rtol", type=float, default=None,
                        help=f"tolerance relative to max|reference| (default {cpu[1]:g} on cpu, {htp[1]:g} on htp)")
    parser.add_argument("--min-cosine", type=float, default=None,
                        help=f"minimum cosine similarity (default {cpu[2]} on cpu, {htp[2]} on htp)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    add_shape_arg(parser)
    add_format_arg(parser)
    parser.add_argument("--strict", action="store_true", help="exit 1 when an output is beyond tolerance")
    parser.set_defaults(func=main)


def _load_map(path: str | None) -> dict[str, str] | None:
    if not path:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise BadInputError(f"cannot read the mapping {path}: {exc}") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise BadInputError(f'{path} must be a JSON object of tensor names {{"A name": "B name"}}')
    return data


def main(args) -> int:
    for name in ("atol", "rtol", "min_cosine"):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise BadInputError(f"--{name.replace('_', '-')} must not be negative")
    if args.map and not args.bisect:
        raise BadInputError("--map is used by --bisect only")
    options = {"on": args.on, "atol": args.atol, "rtol": args.rtol, "min_cosine": args.min_cosine, "seed": args.seed}
    a, b = args.a, args.b
    if args.shape:  # both models get the same static input shapes
        a, b = load_shaped(args, args.a), load_shaped(args, args.b)
    if args.bisect:
        result = bisect(a, b, args.inputs, mapping=_load_map(args.map), **options)
        report, outputs = result.as_dict(), result.outputs
    else:
        report = outputs = compare_models(a, b, args.inputs, **options)
    if args.format == "json":
        print(json.dumps(json_safe(report), indent=2))
    else:
        print(render(args.a, args.b, outputs, report if args.bisect else None))
    if args.strict and not outputs["ok"]:
        raise CheckFailedError("outputs differ beyond tolerance")
    return 0


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def _cos(value) -> str:
    return "-" if value is None else f"{value:.6f}"


def render(a: str, b: str, outputs: dict, bisected: dict | None) -> str:
    """The per-output table, then (with ``bisected``) the per-layer table and the first bad node."""
    tol = outputs["tolerance"]
    where = outputs["on"] + (", fp16" if outputs["fp16"] else ", integer" if outputs["on"] == "htp" else "")
    lines = [f"A {a} (CPU fp32) vs B {b} ({where}); tolerance atol {tol['atol']:g}, rtol {tol['rtol']:g}, "
             f"cosine >= {tol['min_cosine']}"]
    rows = [[o["name"], _fmt(o["max_abs"]), _cos(o["cosine"]),
             f"{o['top1_agreement']:.1%}" if "top1_agreement" in o else "-", "ok" if o["ok"] else "DIFFERS"]
            for o in outputs["outputs"]]
    lines += table(["output", "max abs", "cosine", "top-1", "status"], rows)
    if bisected is None:
        return "\n".join(lines)
    if bisected.get("skipped"):
        lines.append(f"bisect: not needed, {bisected['skipped']}")
        return "\n".join(lines)
    lines += ["", f"bisect: {len(bisected['compared'])} intermediate tensors compared"]
    rows = [[r["layer"], str(r["tensors"]), r["first_divergent"] or "(all agree)", _fmt(r["max_abs"]),
             _cos(r["cosine"]), _cos(r["worst_cosine"])] for r in bisected["layers"]]
    lines += table(["layer", "tensors", "first divergent tensor", "max abs", "cosine", "worst cosine"], rows)
    first = bisected["first_divergent"]
    if first is None:
        lines.append("no intermediate tensor diverges beyond tolerance")
        return "\n".join(lines)
    lines.append(f"first bad node: {bisected['first_bad_node']} ({bisected['first_bad_op']}) -> {first['name']}: "
                 f"max abs {_fmt(first['max_abs'])}, cosine {_cos(first['cosine'])}")
    if bisected["unmapped_inputs"]:
        lines.append(f"  (inputs not compared, may have diverged earlier: {', '.join(bisected['unmapped_inputs'])})")
    return "\n".join(lines)
