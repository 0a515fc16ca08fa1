"""``qnnpasses check``: which nodes of a model would run on the HTP, and why not.

The prediction uses the measured op-support table; ``--real`` also asks the real QNN HTP
backend (onnxruntime-qnn, in a child process) and shows both, so a wrong table entry is
visible as a disagreement rather than a silent misprediction.
"""

from __future__ import annotations

import json
from typing import Any

from qnnpasses.errors import BackendUnavailableError, BadInputError
from qnnpasses.ir.load import load_model


def register(subparsers) -> None:
    parser = subparsers.add_parser("check", help="predict per-node HTP support from the op-support table")
    parser.add_argument("model", help="ONNX model")
    parser.add_argument("--backend", choices=("htp",), default="htp", help="op-support table to check against")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--real", action="store_true",
                        help="also create a session on the real QNN HTP backend (graph optimizations off, so nodes "
                             "match) and report where each node actually ran")
    parser.set_defaults(func=main)


def main(args) -> int:
    from qnnpasses.op_support.checker import check_graph, summarize

    ir = load_model(args.model)
    results = check_graph(ir.graph, args.backend)
    report: dict[str, Any] = {
        "nodes": [{"name": r.name, "op_type": r.op_type, "supported": r.supported, "reasons": r.reasons,
                   "qnn_op": r.qnn_op, "notes": r.notes} for r in results],
        "summary": summarize(ir.graph, results).to_dict(),
    }
    if args.real:
        _add_real_placement(report, args.model)
    if args.format == "json":
        print(json.dumps(report, indent=2))
    else:
        print(render_text(args.model, report))
    return 0


def _add_real_placement(report: dict[str, Any], model_path: str) -> None:
    """Attach the backend's verdict per node and an agreement figure."""
    from qnnpasses.backends.htp import htp_available, probe_placement

    if not htp_available():
        raise BackendUnavailableError("--real needs onnxruntime-qnn with a working QNN HTP backend")
    # Graph optimizations off: the EP then sees the nodes the table was asked about (with them
    # on, fusions such as MatMul+Add -> Gemm rename nodes and nothing can be compared).
    placement = probe_placement(model_path, optimize=False)
    if placement.error and not placement.validation:
        raise BadInputError(f"the HTP backend could not load {model_path}: {placement.error}")
    agree = compared = 0
    for node in report["nodes"]:
        verdict, reason = placement.node_verdict(node["name"])
        node["real"] = {"placement": verdict, "reason": reason}
        if verdict != "unknown":  # Constant nodes and the like never reach an EP
            compared += 1
            agree += (verdict == "htp") == node["supported"]
    report["summary"]["real"] = {
        "ok": placement.ok,
        "error": placement.error,
        "qnn_partitions": placement.qnn_partitions,
        "cpu_nodes": len(placement.cpu_nodes),
        "qnn_graph_ops": placement.qnn_graph_ops["total"],
        "compared_nodes": compared,
        "agreement": round(agree / compared, 4) if compared else 1.0,
    }


def render_text(model: str, report: dict[str, Any]) -> str:
    """Summary first, then every node that will not run on the HTP, with its reasons."""
    s = report["summary"]
    headline = (f"{model}: {s['nodes']} nodes, {s['supported']} predicted on HTP, {s['unsupported']} not"
                f" (predicted partitions: HTP {s['partitions']['htp']}, CPU {s['partitions']['cpu']})")
    lines = [headline]
    if s.get("unknown"):
        lines.append(f"  {s['unknown']} node(s) with unknown dtype/shape: predictions there are optimistic")
    real = s.get("real")
    if real:
        status = "ran" if real["ok"] else f"FAILED: {real['error']}"
        lines.append(f"  real HTP backend: {status}; {real['qnn_partitions']} QNN partition(s), "
                     f"{real['cpu_nodes']} CPU node(s), agreement with the table {real['agreement']:.1%}")
    bad = [n for n in report["nodes"]
           if not n["supported"] or (n.get("real") and n["real"]["placement"] not in ("htp", "unknown"))]
    if bad:
        lines.append("nodes not on HTP:")
    for n in bad:
        predicted = "; ".join(n["reasons"]) or "predicted on HTP"
        lines.append(f"  {n['name']} ({n['op_type']}): {predicted}")
        if n.get("real"):
            lines.append(f"      real: {n['real']['placement']}" + (f" - {n['real']['reason']}" if n["real"]["reason"] else ""))
    unsupported_types = {op: c["unsupported"] for op, c in s["by_op_type"].items() if c["unsupported"]}
    if unsupported_types:
        lines.append("unsupported op types: " + ", ".join(f"{op} x{n}" for op, n in sorted(unsupported_types.items())))
    return "\n".join(lines)
