"""qnnpasses.quant.split_operand: a MatMul of two 16-bit activations becomes two MatMuls with 8-bit
second operands; the CPU computes what it computed, the HTP computes it closer to fp32."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from conftest import requires_htp
from onnx import helper, numpy_helper

from qnnpasses.quant.split_operand import find_matches, split_second_operands

RNG = np.random.default_rng(0)
A = RNG.standard_normal((1, 4, 16, 256)).astype(np.float32)
B = RNG.standard_normal((1, 4, 256, 128)).astype(np.float32)
EXACT = A.astype(np.float64) @ B


def _encoding(x: np.ndarray) -> tuple[float, int]:
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = (hi - lo) / 65535
    return scale, int(round(-lo / scale))


def _qdq_matmul(path) -> None:
    """MatMul(DQ(Q(A)), DQ(Q(B))) -> Q -> DQ, all uint16 per tensor, as onnxruntime's quantizer writes it."""
    nodes, inits = [], []

    def qdq(x: str, values: np.ndarray, tag: str) -> str:
        scale, zero = _encoding(values)
        inits.extend([numpy_helper.from_array(np.array(scale, np.float32), f"{tag}_s"),
                      numpy_helper.from_array(np.array(zero, np.uint16), f"{tag}_z")])
        nodes.extend([helper.make_node("QuantizeLinear", [x, f"{tag}_s", f"{tag}_z"], [f"{tag}_q"]),
                      helper.make_node("DequantizeLinear", [f"{tag}_q", f"{tag}_s", f"{tag}_z"], [f"{tag}_dq"])])
        return f"{tag}_dq"

    a, b = qdq("A", A, "a"), qdq("B", B, "b")
    nodes.append(helper.make_node("MatMul", [a, b], ["y"], name="scores"))
    out = qdq("y", EXACT, "y")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", 1, list(A.shape)),
                                           helper.make_tensor_value_info("B", 1, list(B.shape))],
                              [helper.make_tensor_value_info(out, 1, None)], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(path))


def _cpu(path) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, {"A": A, "B": B})[0]


def _error(x: np.ndarray) -> float:
    return float(np.sqrt(((x - EXACT) ** 2).mean() / (EXACT ** 2).mean()))


def test_the_split_keeps_the_cpus_result_with_8_bit_second_operands(tmp_path):
    plain, split = tmp_path / "plain.onnx", tmp_path / "split.onnx"
    _qdq_matmul(plain)
    _qdq_matmul(split)
    assert split_second_operands(split) == {"split": 1}
    model = onnx.load(str(split))
    assert [n.op_type for n in model.graph.node].count("MatMul") == 2 and not find_matches(model)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    b_scale, _ = _encoding(B)
    seconds = [n.input[1] for n in model.graph.node if n.op_type == "MatMul"]
    producers = {n.output[0]: n for n in model.graph.node}
    for name in seconds:  # both second operands are 8-bit
        assert inits[producers[name].input[2]].dtype == np.uint8
    coarse = producers[seconds[0]]
    assert np.isclose(float(inits[coarse.input[1]]), 257 * b_scale, rtol=1e-6)
    # the QDQ graph on the CPU: the split adds at most a few 16-bit steps of B to the plain graph's error
    assert _error(_cpu(plain)) < 1e-4 and _error(_cpu(split)) < 2e-4


@requires_htp
def test_the_htp_computes_the_split_closer_to_fp32(tmp_path):
    """Both on the HTP in integer mode, no CPU fallback (docs/act_matmul.md has the figures)."""
    from qnnpasses.backends.htp import htp_session

    plain, split = tmp_path / "plain.onnx", tmp_path / "split.onnx"
    _qdq_matmul(plain)
    _qdq_matmul(split)
    split_second_operands(split)
    errors = {}
    for name, path in (("plain", plain), ("split", split)):
        session = htp_session(str(path), fp16=False, extra_options={"offload_graph_io_quantization": "0"},
                              optimize=False, disable_cpu_fallback=True)
        errors[name] = _error(session.run(None, {"A": A, "B": B})[0])
    assert errors["plain"] > 5e-3  # the HTP reads B at 8 bits
    assert errors["split"] < errors["plain"] / 8, errors


def test_the_doc_is_what_the_tool_writes():
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import probe_act_matmul as tool

    doc = json.loads(tool.DOC_JSON.read_text())
    assert tool.render(doc) == tool.DOC_MD.read_text()
    assert [r["case"] for r in doc["rows"]] == [c[0] for c in tool.CASES]
