"""``qnnpasses convert``: write the converter package for the QNN SDK tools (and run them if present).

DIR gets ``model.onnx``, ``input_list.txt`` + raw calibration files (``--calib``: a .npz,
a folder of .npz files keyed by input name, or an existing input_list.txt),
``quant_overrides.json`` (``--overrides``; by default with ``--calib`` the mixed-precision plan,
quantized here, plus its AIMET 2.0.0 form ``quant_overrides.v2.json``) and ``convert.sh`` with the documented
``qnn-onnx-converter`` / ``qnn-model-lib-generator`` / ``qnn-context-binary-generator``
commands.  With an SDK (``--sdk DIR`` or ``$QNN_SDK_ROOT``) the commands run now.
"""

from __future__ import annotations

import argparse
import json

from qnnpasses.commands.common import (
    add_deprecated,
    add_format_arg,
    add_shape_arg,
    shaped_path,
)
from qnnpasses.errors import BadInputError, CheckFailedError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="write a package for Qualcomm's qnn-onnx-converter (input list, raw files, convert.sh)",
        description="Write everything Qualcomm's QNN SDK tools need to convert the model (the model, "
                    "input_list.txt with raw calibration files, quantization overrides, convert.sh) and run "
                    "them when an SDK is found.")
    p.add_argument("model", help="ONNX model (never modified)")
    p.add_argument("--out-dir", metavar="DIR", help="folder to write the package into")
    add_deprecated(p, "-o", "out_dir", "--out-dir VALUE")
    add_deprecated(p, "--output", "out_dir", "--out-dir VALUE")
    p.add_argument("--calib", metavar="DATA", help="calibration samples: X.npz, a folder of .npz, or an input_list.txt")
    p.add_argument("--overrides", metavar="FILE", help="quantization overrides JSON to pass to the converter")
    p.add_argument("--plan", action=argparse.BooleanOptionalAction, default=True,
                   help="with --calib and no --overrides, quantize first and put the mixed-precision plan in as "
                        "quant_overrides.json (default on; model.onnx is then the prepared model it names)")
    p.add_argument("--precision", choices=("w8a16", "w4a16"), default="w8a16", help="the plan's precision (default w8a16)")
    p.add_argument("--sdk", metavar="SDK_ROOT", help="QNN SDK root (default $QNN_SDK_ROOT); the tools run when found")
    add_shape_arg(p)
    add_format_arg(p)
    p.set_defaults(func=main)


def main(args) -> int:
    from qnnpasses.handoff.package import write_package
    from qnnpasses.handoff.sdk import find_sdk

    if not args.out_dir:
        raise BadInputError("convert needs --out-dir DIR (the folder to write the package into)")
    if args.sdk and find_sdk(args.sdk) is None:
        raise BadInputError(f"--sdk {args.sdk}: no bin/x86_64-linux-clang/qnn-onnx-converter there")
    with shaped_path(args) as path:
        policy = None
        if args.calib and not args.overrides and args.plan:
            from qnnpasses.quant.shared import precision_policy

            policy = precision_policy(args.precision)
        report = write_package(path, args.out_dir, calib=args.calib, overrides=args.overrides, sdk=args.sdk,
                               plan=args.plan, policy=policy)
    print(json.dumps(report, indent=2) if args.format == "json" else render_text(report))
    failed = [s for s in report.get("steps", []) if s["returncode"] != 0]
    if failed:
        raise CheckFailedError(f"{failed[0]['step']} failed (exit {failed[0]['returncode']}); see {args.out_dir}/{failed[0]['log']}")
    return 0


def render_text(report: dict) -> str:
    lines = [f"{report['package']}: model.onnx, {report['samples']} calibration sample(s)"
             + (", input_list.txt" if report.get("input_list") else "")
             + (", quant_overrides.json" if report.get("overrides") else "") + ", convert.sh"]
    if report.get("plan"):
        plan = report["plan"]
        lines.append(f"  plan: {plan['policy']} from {plan['calibration_samples']} calibration sample(s); "
                     f"quant_overrides.json (AIMET 1.0.0) and {plan['v2']} (2.0.0)")
    for item in report["inputs"]:
        lines.append(f"  input {item['name']}: raw {item['raw_dtype']}")
    if report.get("sdk") is None:
        lines.append(report["sdk_message"])
    else:
        for step in report.get("steps", []):
            status = "ok" if step["returncode"] == 0 else f"FAILED (exit {step['returncode']})"
            lines.append(f"  {step['step']}: {status} in {step['seconds']} s (log {step['log']})")
        if report.get("context_binary"):
            lines.append(f"  context binary: {report['context_binary']}")
    return "\n".join(lines)
