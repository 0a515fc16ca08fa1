"""``qnnpasses quantize``: prepare for the HTP, quantize statically to QDQ with a mixed-precision plan.

See :mod:`qnnpasses.quant.driver` (steps), :mod:`qnnpasses.quant.policy` (what gets 16 bit),
:mod:`qnnpasses.quant.calibration` (data formats) and :mod:`qnnpasses.quant.overrides`
(the converter's ``--quantization_overrides`` file).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from qnnpasses.analysis.text import table
from qnnpasses.commands.common import add_shape_arg, parse_shape_args
from qnnpasses.errors import BadInputError
from qnnpasses.quant.policy import CATEGORIES, PrecisionPolicy

SUMMARY = "quantize a model for the HTP (static QDQ, mixed precision); --evaluate scores it on the real HTP"


def register(subparsers) -> None:
    parser = subparsers.add_parser("quantize", help=SUMMARY, description=SUMMARY)
    parser.add_argument("model", help="float ONNX model (the htp-llm pipeline runs first unless it already ran)")
    parser.add_argument("--calib", required=True, metavar="DATA",
                        help=".npz/.npy file, a folder of them, or input_list.txt with raw files")
    parser.add_argument("-o", "--output", required=True, metavar="FILE.onnx", help="output QDQ model")
    parser.add_argument("--act", choices=("uint8", "uint16"), default="uint16", help="activation width (default uint16)")
    parser.add_argument("--weights", choices=("int8", "uint8", "int16", "int4"), default="int8",
                        help="weight type of MatMul/Gemm (default int8, symmetric; int4 keeps the lm_head and "
                             "non-projection constants at int8)")
    parser.add_argument("--block-size", type=int, default=None, metavar="B",
                        help="block-wise weight scales: one per B input rows of each output channel")
    parser.add_argument("--weight-scales", choices=("minmax", "mse"), default=None,
                        help="per-channel weight scales from max|w| or the MSE-optimal clip "
                             "(default mse for int4, minmax otherwise)")
    parser.add_argument("--weight-rounding", choices=("nearest", "gptq", "gptq-act"), default="nearest",
                        help="round weights to nearest, or with GPTQ: each input row's rounding error is "
                             "compensated by the rows after it, using the layer inputs of the --calib data "
                             "(gptq-act: rows in decreasing input energy); needs per-channel weights")
    parser.add_argument("--outliers", default="rotate", metavar="none|rotate|SPEC",
                        help="exact rewrites against activation outliers before quantization: rotate = "
                             "fold-norm-weights,rotate-residual (default; models without a pre-norm residual "
                             "stream are left as they are), none, or a textual pipeline")
    parser.add_argument("--per-channel", action=argparse.BooleanOptionalAction, default=True,
                        help="per-output-channel weights (default on)")
    parser.add_argument("--sensitive-16bit", action=argparse.BooleanOptionalAction, default=True,
                        help="embedding, lm_head, Q·Kᵀ/softmax and norm tensors at 16 bit (default on)")
    parser.add_argument("--sensitive", default=",".join(CATEGORIES), metavar="LIST",
                        help=f"which categories count as sensitive (default {','.join(CATEGORIES)})")
    parser.add_argument("--kv-bits", type=int, choices=(8, 16), default=None,
                        help="quantize the KV cache (past/present tensors) at this width")
    parser.add_argument("--head-bits", type=int, choices=(8, 16), default=8,
                        help="weight width of the lm_head, the layer whose output top-1 reads (default 8)")
    parser.add_argument("--calib-method", choices=("minmax", "percentile", "entropy"), default="minmax",
                        help="how activation ranges are chosen from the calibration data (default minmax)")
    parser.add_argument("--overrides", metavar="FILE.json",
                        help="also write the plan as qnn-onnx-converter --quantization_overrides (AIMET encodings); "
                             "the float model it names is written next to OUTPUT as *.prepared.onnx")
    parser.add_argument("--overrides-version", choices=("1.0.0", "0.6.1"), default="1.0.0",
                        help="AIMET encodings format of --overrides (default 1.0.0; 0.6.1 for older QNN SDKs); "
                             "the 2.0.0 layout is always written next to it as *.v2.json")
    parser.add_argument("--evaluate", metavar="EVAL_DATA",
                        help="score the QDQ model on the real HTP against the fp32 model on CPU (disjoint from --calib)")
    parser.add_argument("--eval-samples", type=int, default=None, metavar="N", help="evaluate at most this many samples")
    parser.add_argument("--target-top1", type=float, default=None, metavar="F",
                        help="raise the layers with the lowest SQNR (8-bit weights in an int4 plan, 16-bit outputs "
                             "with --act uint8) until top-1 agreement with fp32 reaches F on CPU (uses --evaluate data)")
    parser.add_argument("--target-ppl-ratio", type=float, default=None, metavar="R",
                        help="... until perplexity is at most R x fp32's")
    parser.add_argument("--target-cosine", type=float, default=None, metavar="C",
                        help="... until the first output's cosine with fp32 reaches C (encoders)")
    parser.add_argument("--layer-budget", type=int, default=None, metavar="N",
                        help="raise at most N layers (alone: raise exactly the N weakest)")
    parser.add_argument("--pipeline", default="htp-llm", metavar="NAME|SPEC",
                        help="pipeline run first, by name or textual (default htp-llm; skipped when the model "
                             "records that a qnnpasses pipeline already ran)")
    add_shape_arg(parser)
    parser.add_argument("--report", metavar="FILE.json", help="write what was done and measured as JSON")
    parser.set_defaults(func=main)


def _policy(args) -> PrecisionPolicy:
    sensitive = tuple(s.strip() for s in args.sensitive.split(",") if s.strip())
    scales = args.weight_scales or ("mse" if args.weights == "int4" else "minmax")
    return PrecisionPolicy(act=args.act, weights=args.weights, per_channel=args.per_channel,
                           sensitive_bits=16 if args.sensitive_16bit else None, sensitive=sensitive,
                           kv_bits=args.kv_bits, calibrate_method=args.calib_method, block_size=args.block_size,
                           weight_scales=scales, weight_rounding=args.weight_rounding, head_bits=args.head_bits,
                           outliers=outlier_spec(args.outliers))


def _sensitivity(args, policy: PrecisionPolicy, tmp: Path):
    """Prepare once, rank the layers by SQNR and raise the weakest until the target (qnnpasses.quant.sensitivity)."""
    from dataclasses import replace

    from qnnpasses.ir.load import load_model
    from qnnpasses.ir.model import save_model
    from qnnpasses.quant.calibration import CalibrationData, model_inputs
    from qnnpasses.quant.driver import ensure_pipeline, outlier_rewrites, quant_prep
    from qnnpasses.quant.sensitivity import raise_until

    if (args.target_top1 is not None or args.target_ppl_ratio is not None or args.target_cosine is not None) \
            and not args.evaluate:
        raise BadInputError("--target-top1/--target-ppl-ratio/--target-cosine need --evaluate DATA (held-out samples)")
    ir = load_model(args.model)
    ensure_pipeline(ir, pipeline=args.pipeline, shapes=parse_shape_args(args.shape))
    calib = CalibrationData(args.calib, model_inputs(ir))
    quant_prep(ir, calib)
    if policy.outliers:
        outlier_rewrites(ir, policy.outliers, calib)
    prepared = save_model(ir, tmp / "prepared.onnx")
    evals = CalibrationData(args.evaluate, model_inputs(ir)) if args.evaluate else calib
    search = raise_until(prepared, calib, evals, replace(policy, outliers=""), target_top1=args.target_top1,
                         target_ppl_ratio=args.target_ppl_ratio, target_cosine=args.target_cosine,
                         budget=args.layer_budget or 16,
                         eval_samples=args.eval_samples or 8)
    return prepared, search.chosen, search


def outlier_spec(text: str) -> str:
    """``--outliers`` as a textual pipeline ("" for none)."""
    from qnnpasses.quant.shared import ROTATE

    return {"none": "", "rotate": ROTATE}.get(text, text)


def main(args) -> int:
    from qnnpasses.quant.driver import quantize_model

    policy = _policy(args)
    if args.eval_samples is not None and args.eval_samples < 1:
        raise BadInputError("--eval-samples must be at least 1")
    if Path(args.output).resolve() == Path(args.model).resolve():
        raise BadInputError("refusing to overwrite the input model; choose another --output")
    out = Path(args.output)
    prepared = out.with_name(out.stem + ".prepared.onnx") if args.overrides else None
    model, search = args.model, None
    with tempfile.TemporaryDirectory(prefix="qnnpasses-sens-") as tmp:
        if args.target_top1 is not None or args.target_ppl_ratio is not None or args.target_cosine is not None \
                or args.layer_budget:
            model, policy, search = _sensitivity(args, policy, Path(tmp))
        result = quantize_model(model, args.calib, out, policy, shapes=parse_shape_args(args.shape),
                                keep_prepared=prepared, pipeline=args.pipeline, run_prep=search is None)
    report = result.as_dict()
    if search is not None:
        report["sensitivity"] = search.as_dict()
        met = search.steps[-1]["met"] if search.steps else None
        print(f"  sensitivity: raised {len(policy.raised)} layer(s) with the lowest SQNR "
              f"(weakest {next(iter(search.sqnr.items()), ('-', 0))[0]}: {next(iter(search.sqnr.values()), 0):.1f} dB)"
              + ("" if met is None else f"; target {'met' if met else 'NOT met within the budget'} on CPU"))
    print(f"{args.model} -> {out} ({policy.label()}, {result.seconds:.1f} s)")
    print(f"  calibrated on {result.calibration_samples} sample(s) from {args.calib} ({policy.calibrate_method})")
    plan = result.plan.summary()
    sensitive = ", ".join(f"{k} {v}" for k, v in (plan["sensitive"] or {}).items()) or "none"
    print(f"  tensors kept at 16 bit: {sensitive}; per-channel weights: {plan['per_channel_weights']}; "
          f"KV-cache tensors: {plan['kv_tensors']}" + (f"; 8-bit weights in the int4 plan: {plan['weights_8bit']}"
                                                        if policy.weight_bits == 4 else ""))
    for record in result.prep.records:
        if record["pass"] in ("fold-norm-weights", "rotate-residual"):
            print(f"  {record['pass']}: {record['status']}" + (f" ({record['reason']})" if record["reason"] else ""))
    if args.overrides:
        from qnnpasses.quant.overrides import write_overrides

        path = write_overrides(out, args.overrides, version=args.overrides_version,
                               quantizer_args=policy.quantizer_args(), for_model=prepared)
        v2 = write_overrides(out, Path(args.overrides).with_suffix(".v2.json"), version="2.0.0", for_model=prepared)
        report["overrides"] = {"file": str(path), "v2": str(v2), "prepared_model": str(prepared)}
        print(f"overrides: {path} and {v2.name} (AIMET 2.0.0), for {prepared}")
    if result.weights:
        w = result.weights
        print(f"  weight scales: {w['refined']} refined ({policy.weight_scales}; squared error x{w['mse_after_over_before']})"
              + (f", {w['blocked']} block-wise" if policy.block_size else "")
              + (f"; {policy.weight_rounding} rounding of {w['gptq']}: calibration output error "
                 f"x{w['output_error_gptq_over_nearest']} of round-to-nearest" if w.get("gptq") else ""))
    if args.evaluate:
        report["evaluation"] = _evaluate(args, out, policy)
    if args.report:
        from qnnpasses.passmanager.report import json_safe

        Path(args.report).write_text(json.dumps(json_safe(report), indent=2))
    return 0


def _evaluate(args, out: Path, policy: PrecisionPolicy) -> dict:
    """Scores of the output; with --kv-bits also of the same plan with the cache at activation width."""
    from qnnpasses.ir.load import load_model
    from qnnpasses.quant.calibration import CalibrationData, model_inputs
    from qnnpasses.quant.driver import quantize_model
    from qnnpasses.quant.evaluate import evaluate

    data = CalibrationData(args.evaluate, model_inputs(load_model(out)))
    ev = evaluate(args.model, out, data, limit=args.eval_samples)
    result = {"quantized": ev.as_dict()}
    rows = [_row(policy.label(), ev)]
    if policy.kv_bits:
        from dataclasses import replace

        with tempfile.TemporaryDirectory(prefix="qnnpasses-kv-") as tmp:
            base = Path(tmp) / "kv_at_act_width.onnx"
            quantize_model(args.model, args.calib, base, replace(policy, kv_bits=None),
                           shapes=parse_shape_args(args.shape), pipeline=args.pipeline)
            baseline = evaluate(args.model, base, data, limit=args.eval_samples)
        result["kv_baseline"] = baseline.as_dict()
        result["kv_cost"] = _kv_cost(ev, baseline)
        rows.append(_row(replace(policy, kv_bits=None).label() + " (KV at activation width)", baseline))
    placement = f"{ev.qnn_partitions} QNN partition(s), {len(ev.cpu_nodes)} CPU node(s)"
    print(f"\nHTP (integer mode) vs fp32 CPU over {ev.samples} samples; {placement}")
    print("\n".join(table(["model", "output", "cosine", "max abs", "top-1", "perplexity (fp32)"],
                          [r for rs in rows for r in rs])))
    if "kv_cost" in result:
        cost = result["kv_cost"]
        print(f"KV cache at {policy.kv_bits} bit costs: cosine {cost['cosine']:+.2e}, top-1 {cost['top1']:+.1%}"
              if cost.get("top1") is not None else f"KV cache at {policy.kv_bits} bit costs: cosine {cost['cosine']:+.2e}")
    sys.stdout.flush()
    return result


def _row(label: str, ev) -> list[list[str]]:
    rows = []
    for o in ev.outputs:
        ppl = "-" if o.perplexity is None else f"{o.perplexity:.3f} ({o.reference_perplexity:.3f})"
        rows.append([label, o.name, f"{o.cosine:.6f}", f"{o.max_abs:.4g}",
                     "-" if o.top1 is None else f"{o.top1:.1%}", ppl])
    return rows


def _kv_cost(ev, baseline) -> dict:
    a, b = ev.headline, baseline.headline
    cost = {"cosine": a.cosine - b.cosine, "max_abs": a.max_abs - b.max_abs}
    if a.top1 is not None and b.top1 is not None:
        cost["top1"] = a.top1 - b.top1
    if a.perplexity is not None and b.perplexity is not None:
        cost["perplexity"] = a.perplexity - b.perplexity
    return cost
