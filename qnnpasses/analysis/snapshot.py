"""The figures a run report compares before and after a pipeline (``qnnpasses run --report-dir``)."""

from __future__ import annotations

from typing import Any

from qnnpasses.analysis import analyze
from qnnpasses.ir.model import IRModel
from qnnpasses.op_support import check_graph, summarize


def model_snapshot(ir: IRModel) -> dict[str, Any]:
    """What the report compares before and after the pipeline: predicted HTP support and the
    analysis figures that matter on device (weights, activation memory, KV cache)."""
    verdicts = check_graph(ir.graph)
    support = summarize(ir.graph, verdicts).to_dict()
    support.pop("by_op_type", None)
    unsupported = [r for r in verdicts if not r.supported]
    support["unsupported_nodes"] = [{"name": r.name, "op_type": r.op_type, "reasons": r.reasons} for r in unsupported][:50]
    figures = analyze(ir)
    activations, kv = figures["activations"], figures.get("kv_cache") or {}
    return {
        "support": support,
        "weights_bytes": figures["weights"]["total_bytes"],
        "activation_peak_bytes_no_reuse": activations["peak_bytes_no_reuse"],
        "activation_peak_bytes_reuse": activations["peak_bytes_reuse"],
        "kv_cache_bytes_fp16": kv.get("bytes_fp16"),
    }
