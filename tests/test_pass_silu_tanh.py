"""silu-tanh: x*Sigmoid(x) => h*Tanh(h)+h (h = x/2): the same SiLU, to fp32 rounding; closer to fp32 on the HTP."""

from __future__ import annotations

import numpy as np
import onnx.parser
import pytest
from conftest import requires_htp
from pass_testing import htp_fp16_errors, op_counts, run_strictly

from qnnpasses.backends.cpu import run_cpu
from qnnpasses.ir.load import load_model

X = {"x": np.linspace(-30.0, 30.0, 16 * 96, dtype=np.float32).reshape(1, 16, 96)}


def model(body: str, outputs: str = "float[1,16,96] y", opset: int = 18):
    return onnx.parser.parse_model(f"<ir_version: 9, opset_import: [\"\" : {opset}]> "
                                   f"g (float[1,16,96] x) => ({outputs}) {{ {body} }}")


def silu(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


@pytest.mark.parametrize("body", ["s = Sigmoid(x) y = Mul(x, s)", "s = Sigmoid(x) y = Mul(s, x)"], ids=["x*s", "s*x"])
def test_silu_becomes_tanh_form_with_the_same_values(body):
    ir, record = run_strictly(model(body), "silu-tanh")
    assert record.stats["silu"] == 1
    counts = op_counts(ir)
    assert counts["Sigmoid"] == 0 and counts["Tanh"] == 1 and counts["Mul"] == 2 and counts["Add"] == 1
    got = run_cpu(ir, X)["y"].astype(np.float64)
    # h*Tanh(h)+h cancels for negative x: the error is fp32 rounding of h = x/2, not of the result
    scale = np.maximum(np.abs(silu(X["x"])), np.abs(X["x"] / 2)).astype(np.float32)
    bound = 4 * np.spacing(scale).astype(np.float64)
    assert np.all(np.abs(got - silu(X["x"])) <= bound)


def test_gated_sigmoid_is_not_a_silu_and_is_kept_by_default():
    # Sigmoid(x) * z (a gate, not a SiLU) and a Sigmoid with two readers stay as they are
    body = "s = Sigmoid(x) z = Add(x, x) y = Mul(z, s) w = Add(s, s)"
    ir, record = run_strictly(model(body, "float[1,16,96] y, float[1,16,96] w"), "silu-tanh")
    assert record.stats == {"silu": 0, "sigmoid": 0, "kept": 1}
    assert op_counts(ir)["Sigmoid"] == 1


def test_other_sigmoids_with_option_become_half_tanh():
    body = "s = Sigmoid(x) z = Add(x, x) y = Mul(z, s)"
    ir, record = run_strictly(model(body), "silu-tanh{sigmoid=true}")
    assert record.stats["sigmoid"] == 1 and op_counts(ir)["Sigmoid"] == 0
    got = run_cpu(ir, X)["y"].astype(np.float64)
    np.testing.assert_allclose(got, 2.0 * X["x"] * sigmoid(X["x"]), rtol=1e-6, atol=1e-5)


def test_silu_as_graph_output_keeps_the_interface():
    ir, _ = run_strictly(model("s = Sigmoid(x) y = Mul(x, s)"), "silu-tanh")
    assert [o.name for o in ir.graph.outputs] == ["y"]


def test_fp16_graph_keeps_fp16_and_stays_within_fp16_rounding():
    src = onnx.parser.parse_model("<ir_version: 9, opset_import: [\"\" : 18]> "
                                  "g (float16[1,16,96] x) => (float16[1,16,96] y) { s = Sigmoid(x) y = Mul(x, s) }")
    x16 = {"x": X["x"].astype(np.float16)}
    ir, record = run_strictly(src, "silu-tanh", inputs=x16)
    assert record.stats["silu"] == 1
    got = run_cpu(ir, x16)["y"].astype(np.float64)
    want = silu(x16["x"])
    # within fp16 rounding of the larger of the result and h = x/2 (the cancellation for x < 0)
    scale = np.maximum(np.abs(want), np.abs(x16["x"].astype(np.float64)) / 2).astype(np.float16)
    assert np.all(np.abs(got - want) <= 2 * np.spacing(scale).astype(np.float64))


@requires_htp
def test_one_token_mlp_gate_is_closer_to_fp32_on_the_htp(tmp_path):
    """The decode-shaped MLP gate (one row, MatMul -> SiLU) on the HTP in fp16: the Tanh form's
    error against fp32 is well below the Sigmoid form's, which the HTP fuses into a less precise kernel."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((576, 1536)) * 0.05).astype(np.float32)
    x = (rng.standard_normal((1, 576)) * 1.5).astype(np.float32)
    src = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["g"]), onnx.helper.make_node("Sigmoid", ["g"], ["s"]),
         onnx.helper.make_node("Mul", ["g", "s"], ["y"])], "mlp",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 576])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 1536])],
        [onnx.numpy_helper.from_array(w, "w")]), opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=9)
    want = silu(x.astype(np.float64) @ w.astype(np.float64))
    irs = {"sigmoid": load_model(src), "tanh": run_strictly(src, "silu-tanh", inputs={"x": x})[0]}
    errors = htp_fp16_errors(irs, {"x": x}, want, tmp_path)
    assert errors["tanh"] < 1e-3  # fp16 rounding of the inputs, the weights and the result
    assert errors["tanh"] < 0.5 * errors["sigmoid"], errors  # measured: 4.9e-4 against 3.3e-3
