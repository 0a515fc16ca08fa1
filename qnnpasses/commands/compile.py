"""``qnnpasses compile``: compile for the HTP through the ONNX Runtime QNN EP into an EPContext model.

The output holds the HTP context binary (embedded below 2 GB of weights, else in
``<name>_qnn.bin`` beside it).  It is then loaded in a fresh process and checked against
the original's fp32 CPU outputs (fp16: cosine >= 0.999), and the load time is compared
with creating a session from the ONNX graph (each measured in a fresh process).  In integer
mode (``--qdq``) the HTP is given the QDQ graph with each MatMul after an RmsNorm compensated
for the backend's one-way rounding (:mod:`qnnpasses.quant.norm_rounding`), as ``qnnpasses llm``
compiles its quantized pairs.
"""

from __future__ import annotations

import json

from qnnpasses.commands.common import add_format_arg, add_on_arg, add_shape_arg, load_shaped, shaped_path
from qnnpasses.errors import BackendUnavailableError, BadInputError, CheckFailedError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compile", help="compile for the HTP into a ready-to-load model (EPContext) and check its outputs",
        description="Compile the model for the HTP into an EPContext model (the HTP context binary inside, or "
                    "beside it above 2 GB), load it in a fresh process and compare its outputs with the "
                    "original's on the CPU.")
    p.add_argument("model", help="ONNX model (never modified)")
    add_on_arg(p, ("htp",), "htp", "the backend to compile for (the HTP)")
    p.add_argument("-o", "--output", required=True, metavar="OUT_ctx.onnx", help="EPContext model to write")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--fp16", dest="mode", action="store_const", const="fp16", help="float model in fp16 (default)")
    precision.add_argument("--qdq", dest="mode", action="store_const", const="qdq",
                           help="quantize to QDQ first (onnxruntime QNN recipe: uint16 activations, uint8 weights)")
    p.add_argument("--embed", choices=("auto", "yes", "no"), default="auto",
                   help="context binary inside the model (auto: yes below 2 GB of weights)")
    p.add_argument("--inputs", metavar="X.npz", help="inputs for the check (default: seeded random inputs)")
    p.add_argument("--calib", metavar="DATA", help="--qdq calibration samples (.npz, folder of .npz, input_list.txt)")
    p.add_argument("--no-timing", action="store_true", help="skip the load-time comparison")
    add_shape_arg(p)
    add_format_arg(p)
    p.set_defaults(func=main, mode="fp16")


def main(args) -> int:
    from qnnpasses.backends.cpu import check_inputs, load_inputs
    from qnnpasses.backends.htp import htp_available
    from qnnpasses.handoff.compile import compile_and_verify

    if not htp_available():
        raise BackendUnavailableError("compile needs onnxruntime-qnn with a working QNN HTP backend")
    if not args.output.endswith(".onnx"):
        raise BadInputError("-o must name an .onnx file")
    inputs = calibration = None
    if args.inputs or args.calib:
        ir = load_shaped(args)
        if args.inputs:
            inputs = load_inputs(args.inputs)
            check_inputs(ir, inputs)
        if args.calib:
            from qnnpasses.handoff.inputs import input_specs, load_calibration

            calibration = load_calibration(args.calib, input_specs(ir))
    embed = {"auto": None, "yes": True, "no": False}[args.embed]
    with shaped_path(args) as path:
        report = compile_and_verify(path, args.output, mode=args.mode, embed=embed, inputs=inputs,
                                    calibration=calibration, measure=not args.no_timing)
    report["model"] = args.model
    from qnnpasses.backends.targets import active

    report["target"] = active().as_dict()
    print(json.dumps(report, indent=2, default=str) if args.format == "json" else render_text(report))
    if not report.get("compile", {}).get("ok"):
        raise CheckFailedError(f"compile failed: {report['compile'].get('error')}")
    if not report["ok"]:
        raise CheckFailedError(f"the compiled model's outputs are off (cosine < {report['min_cosine']}) "
                               "or it did not load")
    return 0


def render_text(report: dict) -> str:
    c = report.get("context", {})
    where = "embedded" if report["compile"].get("embedded") else "beside the model"
    target = report.get("target") or {}
    head = (f"{report['output']}: {c.get('epcontext_nodes', 0)} EPContext node(s), {c.get('other_nodes', 0)} other "
            f"node(s) ({report['mode']}, context binary {where}; for {target.get('product', '?')}, "
            f"HTP {target.get('htp_arch', '?')})")
    lines = [head]
    if report.get("calibration_samples"):
        lines.append(f"  quantized (QDQ) with {report['calibration_samples']} calibration sample(s) from "
                     f"{report['calibrated_on']}")
    if report["compile"].get("norm_rounding_matmuls"):
        lines.append(f"  {report['compile']['norm_rounding_matmuls']} MatMul(s) after an RmsNorm given back the half "
                     "step the HTP's RmsNorm rounds away (qnnpasses.quant.norm_rounding)")
    if c.get("other_op_types"):
        lines.append(f"  not compiled for the HTP (CPU): {', '.join(c['other_op_types'])}")
    for name, d in report.get("accuracy", {}).items():
        lines.append(f"  {name}: max abs {d['max_abs']:.3g}, cosine {d['cosine']:.7f} vs fp32 CPU")
    onnx_load, ctx_load = report.get("load_from_onnx"), report.get("load_from_context")
    if onnx_load and ctx_load and onnx_load.get("ok") and ctx_load.get("ok"):
        lines.append(f"  session creation: {onnx_load['session_seconds']:.3f} s from ONNX, "
                     f"{ctx_load['session_seconds']:.3f} s from the EPContext model ({report['load_speedup']:.1f}x)")
    lines.append("  OK" if report.get("ok") else "  FAILED")
    return "\n".join(lines)
