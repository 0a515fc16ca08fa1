"""``qnnpasses check``: which nodes of a model would run on the HTP, and why not.

The prediction uses the measured op-support table; ``--on htp`` also asks the real QNN HTP
backend (onnxruntime-qnn, in a child process) and shows both, so a wrong table entry is
visible as a disagreement rather than a silent misprediction.
"""

from __future__ import annotations

import json
from typing import Any

from qnnpasses.commands.common import add_deprecated, add_format_arg, add_on_arg, add_shape_arg, inputs_static, load_shaped, shaped_path
from qnnpasses.errors import BackendUnavailableError, BadInputError
from qnnpasses.wording import explain


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "check", help="which nodes of a model would run on the HTP, and why the others would not",
        description="Predict, node by node, whether the HTP runs each node (from the measured op-support "
                    "table); with --on htp also ask the real backend and show both.")
    parser.add_argument("model", help="ONNX model")
    parser.add_argument("--backend", choices=("htp",), default="htp", help="accelerator to check against")
    add_on_arg(parser, ("htp",), None,
               "also load the model on the real HTP backend and report where each node actually ran")
    add_deprecated(parser, "--real", "on", "--on htp", value="htp")
    parser.add_argument("--as-written", action="store_true",
                        help="check the graph exactly as written, before onnxruntime folds its constants on load "
                             "(by default the graph the backend is handed is checked, as every session sees it)")
    add_shape_arg(parser)
    add_format_arg(parser)
    parser.set_defaults(func=main)


def main(args) -> int:
    from qnnpasses.op_support.checker import check_graph, summarize

    from qnnpasses.op_support.deployed import deployed_view

    written = load_shaped(args)  # validates the model (one-line errors) and applies --shape
    with shaped_path(args) as path:  # shaped as onnxruntime shapes it: that is what the EP sees
        view = deployed_view(path, [n.name for n in written.graph.nodes], fold=not args.as_written)
    ir = view.ir if view.ir is not None else written
    results = check_graph(ir.graph, args.backend)
    static = inputs_static(ir)
    report: dict[str, Any] = {
        "nodes": [{"name": r.name, "op_type": r.op_type, "supported": r.supported,
                   "reasons": [explain(x, r.name, static_inputs=static) for x in r.reasons],
                   "cause": cause(ir, r), "qnn_op": r.qnn_op, "notes": r.notes} for r in results],
        "summary": summarize(ir.graph, results).to_dict(),
    }
    report["summary"]["view"] = "as written" if args.as_written or view.ir is None else "onnxruntime"
    _add_target(report["summary"], args.backend)
    report["folded"] = view.folded
    if view.note:
        report["summary"]["view_note"] = view.note
    if view.folded:
        with shaped_path(args) as path:
            raw = check_graph(deployed_view(path, [], fold=False).ir.graph, args.backend)
        report["summary"]["as_written"] = {"nodes": len(raw), "unsupported": sum(not r.supported for r in raw)}
    if args.on == "htp":
        with shaped_path(args) as path:
            _add_real_placement(report, path, optimize=not args.as_written)
    if args.format == "json":
        print(json.dumps(report, indent=2))
    else:
        print(render_text(args.model, report))
    return 0


def _add_target(summary: dict[str, Any], backend: str) -> None:
    """The device checked for, and the one the op-support table was measured on when they differ."""
    from qnnpasses.backends.targets import active
    from qnnpasses.op_support import load_table

    target = active()
    summary["target"] = target.as_dict()
    table = load_table(backend)
    if backend == "htp" and (str(table.get("soc_model")), str(table.get("htp_arch")).lstrip("v")) != (
            str(target.soc_model), str(target.htp_arch)):
        summary["table_note"] = (f"the predictions come from the op-support table measured on soc_model "
                                 f"{table.get('soc_model')} / HTP {table.get('htp_arch')}; --on htp asks the backend "
                                 f"for {target}")


def cause(ir, verdict) -> str | None:
    """Why a node is off the HTP, as lint files it: "op", "rank", "constant" or "dynamic"."""
    if verdict.supported:
        return None
    from qnnpasses.lint.rules_support import classify
    from qnnpasses.op_support import load_table, lookup

    node = next((n for n in ir.graph.nodes if n.name == verdict.name), None)
    entry = lookup(load_table("htp"), node.op, node.domain) if node is not None else None
    kinds = [classify(r, entry) for r in verdict.reasons]
    return kinds[0] if kinds else "op"


def _add_real_placement(report: dict[str, Any], model_path: str, *, optimize: bool = True) -> None:
    """Attach the backend's verdict per node and the agreement figure, computed over the nodes
    the backend gave a verdict on (folded ``Constant``s and the like get none)."""
    from qnnpasses.backends.htp import htp_available, probe_placement

    if not htp_available():
        raise BackendUnavailableError("--on htp needs onnxruntime-qnn with a working QNN HTP backend")
    # As every session runs it (compile, diagnose, the device): onnxruntime folds constants
    # before the EP sees the graph, which is the graph ``report["nodes"]`` describes.  With
    # --as-written the optimizations are off, so the EP sees the nodes as written.
    from qnnpasses.progress import step

    step("asking the HTP backend where each node runs")
    placement = probe_placement(model_path, optimize=optimize)
    if placement.error and not placement.validation:
        raise BadInputError(f"the HTP backend could not load {model_path}: {placement.error}")
    agree = compared = 0
    for node in report["nodes"]:
        verdict, reason = placement.node_verdict(node["name"])
        node["real"] = {"placement": verdict, "reason": reason}
        if verdict in ("htp", "cpu"):
            compared += 1
            agree += (verdict == "htp") == node["supported"]
    report["summary"]["real"] = {
        "ok": placement.ok,
        "error": placement.error,
        "qnn_partitions": placement.qnn_partitions,
        "cpu_nodes": len(placement.cpu_nodes),
        "qnn_graph_ops": placement.qnn_graph_ops["total"],
        "compared_nodes": compared,
        "agreement": round(agree / compared, 4) if compared else None,
    }


CAUSES = {"op": "op not supported", "rank": "tensor rank too high", "constant": "operand must be a constant",
          "dynamic": "shape unknown until run time"}


def render_text(model: str, report: dict[str, Any]) -> str:
    """Summary first, then every node that will not run on the HTP, with its reasons."""
    s = report["summary"]
    headline = (f"{model}: {s['nodes']} nodes, {s['supported']} predicted on the HTP, {s['unsupported']} not"
                f" (predicted partitions: HTP {s['partitions']['htp']}, CPU {s['partitions']['cpu']})")
    lines = [headline]
    if s.get("unknown"):
        lines.append(f"  {s['unknown']} node(s) with unknown dtype/shape: predictions there are optimistic")
    real = s.get("real")
    if real:
        status = "ran" if real["ok"] else f"FAILED: {explain(real['error'] or '')}"
        agreement = (f"agreement with the table {real['agreement']:.1%} over {real['compared_nodes']} nodes"
                     if real["agreement"] is not None else "no node verdicts to compare")
        lines.append(f"  real HTP backend: {status}; {real['qnn_partitions']} QNN partition(s), "
                     f"{real['cpu_nodes']} CPU node(s), {agreement}")
    bad = [n for n in report["nodes"]
           if not n["supported"] or (n.get("real") and n["real"]["placement"] not in ("htp", "unknown"))]
    if bad:
        lines.append("nodes not on the HTP:")
    for n in bad:
        predicted = "; ".join(n["reasons"]) or "predicted on the HTP"
        lines.append(f"  {n['name']} ({n['op_type']}): {predicted}")
        if n.get("real"):
            reason = explain(n["real"]["reason"] or "", n["name"])
            lines.append(f"      real: {n['real']['placement']}" + (f" - {reason}" if reason else ""))
    by_cause: dict[str, dict[str, int]] = {}
    for n in report["nodes"]:
        if not n["supported"]:
            ops = by_cause.setdefault(n.get("cause") or "op", {})
            ops[n["op_type"]] = ops.get(n["op_type"], 0) + 1
    if by_cause:
        lines.append("why, by cause:")
        for key in ("op", "rank", "constant", "dynamic"):
            if key in by_cause:
                ops = ", ".join(f"{op} x{c}" for op, c in sorted(by_cause[key].items()))
                lines.append(f"  {CAUSES[key]}: {ops}")
    if s.get("view_note"):
        lines.append(f"note: {s['view_note']}")
    if s.get("table_note"):
        lines.append(f"note: {s['table_note']}")
    written = s.get("as_written")
    if written is not None and report.get("folded"):
        lines.append(f"checked as the backend is handed it: onnxruntime folds {len(report['folded'])} node(s) on load "
                     f"(as written, {written['unsupported']} of {written['nodes']} nodes would not be on the HTP; "
                     f"--as-written checks that graph)")
    return "\n".join(lines)
