"""``qnnpasses run``: load a model, run a pipeline with checks and records, write the result."""

from __future__ import annotations

import contextlib
import gc
import sys
from pathlib import Path

from qnnpasses.backends.cpu import ATOL, MIN_COSINE, RTOL, check_inputs, load_inputs
from qnnpasses.commands.common import add_deprecated, add_plugin_args, load_plugins, parse_shape_args
from qnnpasses.errors import BadInputError, CheckFailedError
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import save_model
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.manager import PassManager, RunConfig, RunResult
from qnnpasses.passmanager.named import get_pipeline
from qnnpasses.analysis.snapshot import model_snapshot
from qnnpasses.passmanager.report import build_report, op_histogram, write_report
from qnnpasses.passmanager.spec import Pipeline, parse_pipeline


def register(subparsers) -> None:
    parser = subparsers.add_parser("run", help="run a pipeline of passes on a model")
    parser.add_argument("model", help="input ONNX model (never modified)")
    parser.add_argument("-o", "--output", required=True, metavar="FILE.onnx", help="output ONNX model (written atomically)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--pipeline", default=None, help="a named pipeline (see `qnnpasses pipelines`); default htp-llm")
    which.add_argument("--passes", default=None, metavar="SPEC", help="a textual pipeline, e.g. 'fix-shapes{batch=1},simplify'")
    parser.add_argument("--report-dir", metavar="DIR", help="write report.json and report.md into this folder")
    parser.add_argument("--dump-ir", action="store_true", help="also write the canonical IR after each pass and per-pass diffs (needs --report-dir)")
    parser.add_argument("--verify", action="store_true", help="compare outputs before/after every pass on onnxruntime CPU; roll back passes that change them")
    parser.add_argument("--inputs", metavar="X.npz", help="inputs for --verify (default: seeded random inputs)")
    parser.add_argument("--shape", action="append", default=[], metavar="NAME=D0,D1,...", help="static shape for an input (repeatable)")
    parser.add_argument("--allow-lossy", action="store_true", help="allow passes that change outputs on purpose (e.g. mha-to-gqa)")
    parser.add_argument("--strict", action="store_true", help="exit 1 without writing the output when a pass is rolled "
                        "back or the end-to-end --verify comparison fails")
    parser.add_argument("--external-data", choices=("auto", "always", "never"), default="auto",
                        help="where weights go in the output (auto: as in the input, always above 1.8 GB)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random verification inputs")
    parser.add_argument("--atol", type=float, default=ATOL, help=f"absolute tolerance of --verify (default {ATOL})")
    parser.add_argument("--rtol", type=float, default=RTOL, help=f"tolerance relative to max|output| (default {RTOL})")
    parser.add_argument("--min-cosine", type=float, default=MIN_COSINE, help=f"minimum cosine of --verify (default {MIN_COSINE})")
    parser.add_argument("--emit-dir", dest="emit", metavar="DIR", help="end with the QNN converter package "
                        "(DIR/qnn_package) and the compiled HTP context model (DIR/model_ctx.onnx); without "
                        "onnxruntime-qnn only the package is written, with a warning (exit 1 under --strict)")
    add_deprecated(parser, "--emit", "emit", "--emit-dir VALUE")
    parser.add_argument("--target-opset", type=int, metavar="N", help="never raise the model's opset above N "
                        "(the newest your QNN SDK's converter accepts): fusions that need a newer op keep the "
                        "older, fp16-safe form")
    parser.add_argument("--calib", metavar="DATA", help="calibration samples (.npz, folder of .npz, or "
                        "input_list.txt): for --emit, for passes that measure ranges, and the first few for --verify")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines and no table")
    add_plugin_args(parser)
    parser.set_defaults(func=main)


def resolve_pipeline(args) -> Pipeline:
    if args.passes is not None:
        return parse_pipeline(args.passes)
    return get_pipeline(args.pipeline or "htp-llm")


def main(args) -> int:
    load_plugins(args.plugin)
    pipeline = resolve_pipeline(args)
    if args.dump_ir and not args.report_dir:
        raise BadInputError("--dump-ir needs --report-dir")
    shapes = parse_shape_args(args.shape)
    with _no_cyclic_collections():  # loading links every node and tensor both ways: all of it lives
        ir = load_model(args.model)
    # this process ends with the run: the loaded graph (tens of thousands of linked nodes and
    # tensors) need not be rescanned by every cyclic collection the passes trigger
    gc.freeze()
    _check_shape_names(ir, shapes)
    if args.target_opset is not None and ir.opset > args.target_opset:
        raise BadInputError(f"{args.model} already uses opset {ir.opset}, above --target-opset {args.target_opset}")
    inputs = None
    if args.inputs:
        inputs = load_inputs(args.inputs)
        check_inputs(ir, inputs)

    calibration = None
    if args.calib:  # streamed: passes that measure ranges read it, --verify uses its first samples
        from qnnpasses.quant.calibration import load_data

        calibration = load_data(args.calib, ir)

    instruments = _instruments(args)
    config = RunConfig(verify=args.verify, strict=args.strict, allow_lossy=args.allow_lossy, inputs=inputs,
                       seed=args.seed, atol=args.atol, rtol=args.rtol, min_cosine=args.min_cosine)
    manager = PassManager(pipeline, config, instruments, PassContext(allow_lossy=args.allow_lossy, shapes=shapes,
                                                                          calibration=calibration,
                                                                          target_opset=args.target_opset))
    ops_before = op_histogram(ir)
    before = model_snapshot(ir) if args.report_dir else None
    try:
        with _no_cyclic_collections():
            result = manager.run(ir)
    except CheckFailedError:
        if args.report_dir:
            partial = manager.result or RunResult(manager.records)
            write_report(build_report(input_path=args.model, output_path=None, pipeline_text=pipeline.to_text(),
                                      result=partial, before=ops_before, after=op_histogram(ir)), args.report_dir)
        raise

    if result.verified_ok is False:  # without --strict: the output is written, the failure is loud
        print(f"WARNING: end-to-end verification FAILED (output differs from the input model on onnxruntime CPU): "
              f"{result.final_verification['failure']}", file=sys.stderr)

    # lets later tools (quantize) see that the pipeline already ran, and which one
    ir.metadata_props["qnnpasses.passmanager.spec"] = pipeline.to_text()
    external = {"auto": None, "always": True, "never": False}[args.external_data]
    with _no_cyclic_collections():
        save_model(ir, args.output, external_data=external)
    report = build_report(input_path=args.model, output_path=args.output, pipeline_text=pipeline.to_text(),
                          result=result, before=ops_before, after=op_histogram(ir),
                          extra={"model_before": before, "model_after": model_snapshot(ir)} if before else None)
    if args.emit:
        from qnnpasses.handoff import emit

        report["emit"] = emit(args.output, args.emit, calib=args.calib)
        _tell_emit(report["emit"], args)
    if args.report_dir:
        write_report(report, args.report_dir)
    if not args.quiet:
        _print_table(report)
    return 0


@contextlib.contextmanager
def _no_cyclic_collections():
    """The cyclic garbage collector off while the model loads, the passes run and the output is
    written.  Rewrites allocate millions of small objects, each collection then rescans the
    young ones (8% of a 128-layer run's CPU); what they leave unreachable is freed by reference
    counting (a removed node's edges are cleared), and a 128-layer LLaMA's run peaks at the same
    memory either way.  Loading creates the graph's objects, all of which live: collections
    during it (a sixth of a 32-layer TorchScript LLaMA's load) find nothing to free."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _instruments(args) -> list:
    """Progress lines unless ``-q``, IR dumps with ``--dump-ir``.  Imported only then: the
    instruments bring the canonical IR text and its diffing (hashlib, difflib), which a
    quiet run never uses."""
    instruments = []
    if not args.quiet:
        from qnnpasses.passmanager.instruments import ProgressInstrument

        instruments.append(ProgressInstrument())
    if args.dump_ir:
        from qnnpasses.passmanager.instruments import IRDumpInstrument

        instruments.append(IRDumpInstrument(Path(args.report_dir) / "ir"))
    return instruments


def _check_shape_names(ir, shapes: dict[str, list[int]]) -> None:
    names = {t.name for t in ir.graph.inputs}
    unknown = sorted(set(shapes) - names)
    if unknown:
        raise BadInputError(f"--shape names unknown inputs {unknown} (inputs: {sorted(names)})")


def _print_table(report: dict) -> None:
    from qnnpasses.passmanager.instruments import render_summary

    print(render_summary(report))


def _tell_emit(emitted: dict, args) -> None:
    """What --emit-dir wrote; a missing backend is said out loud, a failed compile fails the run."""
    package = emitted.get("package") or {}
    print(f"converter package: {package.get('package', Path(args.emit) / 'qnn_package')}")
    compiled = emitted.get("compile") or {}
    if "skipped" in compiled:
        message = (f"--emit-dir wrote only the converter package: {compiled['skipped']}, so there is no compiled "
                   "context model (install onnxruntime-qnn)")
        if args.strict:
            raise CheckFailedError(message)
        sys.stderr.write(f"qnnpasses: warning: {message}\n")
    elif not compiled.get("ok"):
        error = (compiled.get("compile") or {}).get("error") or "outputs off or it did not load"
        raise CheckFailedError(f"--emit-dir: the HTP context model failed: {error}")
    else:
        print(f"HTP context model: {compiled['output']}")
