#!/usr/bin/env python
"""How the HTP computes a MatMul of two quantized activations, and what splitting its second operand buys.

One QDQ MatMul ``A[1, 4, 16, 256] · B[1, 4, 256, 128]`` (seeded normal data, the attention's
shapes at a small size), both operands and the output quantized per tensor over their own
ranges, run on onnxruntime's CPU provider (the QDQ graph as written) and on the simulated HTP in
integer mode (``offload_graph_io_quantization=0``, no CPU fallback).  Rows: both operands
16-bit; the second at 8 bits; the first at 8 bits; both at 8 bits; and both 16-bit with the
second split by :mod:`qnnpasses.quant.split_operand`.  Each figure is the relative RMS error
against the float64 product.

Writes ``docs/act_matmul.json`` and ``docs/act_matmul.md``.

    python tools/probe_act_matmul.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
DOC_JSON, DOC_MD = ROOT / "docs" / "act_matmul.json", ROOT / "docs" / "act_matmul.md"
SHAPES = ((1, 4, 16, 256), (1, 4, 256, 128))
CASES = (("16-bit x 16-bit", 16, 16, False), ("16-bit x 8-bit", 16, 8, False), ("8-bit x 16-bit", 8, 16, False),
         ("8-bit x 8-bit", 8, 8, False), ("16-bit x 16-bit, second operand split", 16, 16, True))


def _encoding(x: np.ndarray, bits: int) -> tuple[float, int]:
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = (hi - lo) / (2 ** bits - 1)
    return scale, int(round(-lo / scale))


def qdq_matmul(a: np.ndarray, b: np.ndarray, bits_a: int, bits_b: int) -> onnx.ModelProto:
    """``Q/DQ(A) · Q/DQ(B) -> Q/DQ``, as onnxruntime's quantizer writes it; the output at 16 bits."""
    nodes, inits = [], []

    def qdq(x: str, values: np.ndarray, bits: int, tag: str) -> str:
        scale, zero = _encoding(values, bits)
        inits.extend([numpy_helper.from_array(np.array(scale, np.float32), f"{tag}_s"),
                      numpy_helper.from_array(np.array(zero, np.uint16 if bits == 16 else np.uint8), f"{tag}_z")])
        nodes.extend([helper.make_node("QuantizeLinear", [x, f"{tag}_s", f"{tag}_z"], [f"{tag}_q"]),
                      helper.make_node("DequantizeLinear", [f"{tag}_q", f"{tag}_s", f"{tag}_z"], [f"{tag}_dq"])])
        return f"{tag}_dq"

    nodes_a, nodes_b = qdq("A", a, bits_a, "a"), qdq("B", b, bits_b, "b")
    nodes.append(helper.make_node("MatMul", [nodes_a, nodes_b], ["y"], name="matmul"))
    out = qdq("y", a.astype(np.float64) @ b, 16, "y")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", 1, list(a.shape)),
                                           helper.make_tensor_value_info("B", 1, list(b.shape))],
                              [helper.make_tensor_value_info(out, 1, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def measure() -> dict:
    from qnnpasses.backends.htp import htp_session
    from qnnpasses.quant.split_operand import split_model

    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in SHAPES)
    exact = a.astype(np.float64) @ b

    def error(x: np.ndarray) -> float:
        return float(np.sqrt(((x - exact) ** 2).mean() / (exact ** 2).mean()))

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, bits_a, bits_b, split in CASES:
            model = qdq_matmul(a, b, bits_a, bits_b)
            if split:
                split_model(model)
            path = Path(tmp) / "m.onnx"
            onnx.save(model, str(path))
            options = ort.SessionOptions()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            cpu = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            htp = htp_session(str(path), fp16=False, extra_options={"offload_graph_io_quantization": "0"},
                              optimize=False, disable_cpu_fallback=True)
            feed = {"A": a, "B": b}
            rows.append({"case": label, "cpu": error(cpu.run(None, feed)[0]), "htp": error(htp.run(None, feed)[0])})
    import onnxruntime_qnn

    return {"onnxruntime": ort.__version__, "onnxruntime_qnn": onnxruntime_qnn.__version__, "shapes": SHAPES,
            "rows": rows}


def render(doc: dict) -> str:
    lines = ["# A MatMul of two quantized activations on the HTP", "",
             "Written by `python tools/probe_act_matmul.py` from `docs/act_matmul.json`.  One QDQ MatMul "
             f"{list(doc['shapes'][0])} x {list(doc['shapes'][1])} of seeded normal data, each operand and the output "
             "quantized per tensor over its own range (the output at 16 bits), on onnxruntime's CPU provider (the "
             "QDQ graph as written) and on the simulated HTP in integer mode; relative RMS error against the "
             f"float64 product.  onnxruntime {doc['onnxruntime']}, onnxruntime-qnn {doc['onnxruntime_qnn']}.", "",
             "| operands | CPU | HTP |", "|---|---:|---:|"]
    lines += [f"| {r['case']} | {r['cpu']:.2e} | {r['htp']:.2e} |" for r in doc["rows"]]
    by = {r["case"]: r for r in doc["rows"]}
    plain, eight, split = by[CASES[0][0]], by[CASES[1][0]], by[CASES[4][0]]
    lines += ["", f"With both operands at 16 bits the HTP's error ({plain['htp']:.2e}) is the CPU's with the second "
              f"operand at 8 bits ({eight['cpu']:.2e}): the HTP reads that operand at 8 bits.  Split into an 8-bit "
              f"coarse part and an 8-bit remainder (`qnnpasses/quant/split_operand.py`), the HTP's error is "
              f"{split['htp']:.2e}, {plain['htp'] / split['htp']:.0f}x smaller."]
    return "\n".join(lines) + "\n"


def write_docs(measure, render, doc_json: Path, doc_md: Path, argv: list[str] | None = None) -> int:
    """A probe's command line: ``measure()`` into ``doc_json`` (unless ``--doc-only``), ``render`` of it into ``doc_md``."""
    args = argv if argv is not None else sys.argv[1:]
    if "--doc-only" not in args:
        doc_json.write_text(json.dumps(measure(), indent=1) + "\n")
    doc_md.write_text(render(json.loads(doc_json.read_text())))
    print(f"wrote {doc_md.relative_to(ROOT)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return write_docs(measure, render, DOC_JSON, DOC_MD, argv)


if __name__ == "__main__":
    sys.exit(main())
