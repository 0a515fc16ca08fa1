"""weight-only-dq: Cast(q int8)[->Sub(zp)]->Mul(scale) on a MatMul weight => DequantizeLinear, exactly;
and what it buys: `qnnpasses quantize` then keeps the model's own int8 weights instead of re-quantizing."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper
from pass_testing import op_counts, run_strictly

from qnnpasses.cli import main

K, N = 32, 48


def cast_mul_model(*, scale_shape=(1, N), zero_point=False, dtype=np.int8, scale_first=False, seed=0):
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    q = rng.integers(info.min, info.max + 1, (K, N)).astype(dtype)
    inits = [onnx.numpy_helper.from_array(q, "q"),
             onnx.numpy_helper.from_array((rng.random(scale_shape) * 0.01 + 0.002).astype(np.float32), "s")]
    nodes = [helper.make_node("Cast", ["q"], ["qf"], to=onnx.TensorProto.FLOAT)]
    value = "qf"
    if zero_point:
        zp = rng.integers(info.min // 2, info.max // 2, scale_shape).astype(np.float32)
        inits.append(onnx.numpy_helper.from_array(zp, "zp"))
        nodes.append(helper.make_node("Sub", ["qf", "zp"], ["centered"]))
        value = "centered"
    nodes += [helper.make_node("Mul", ["s", value] if scale_first else [value, "s"], ["w"]),
              helper.make_node("MatMul", ["x", "w"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 8, K])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 8, N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("variant", [
    {}, {"scale_first": True}, {"scale_shape": (1,)}, {"scale_shape": (K, 1)}, {"zero_point": True},
    {"dtype": np.uint8, "zero_point": True},
], ids=["per-channel", "scale-first", "per-tensor", "per-row", "zero-point", "uint8"])
def test_becomes_dequantize_linear_exactly(variant):
    ir, record = run_strictly(cast_mul_model(**variant), "weight-only-dq")
    assert record.stats == {"rewritten": 1} and record.verification["max_abs"] == 0.0  # bit-exact, every case
    assert op_counts(ir) == {"DequantizeLinear": 1, "MatMul": 1}
    dq = next(n for n in ir.graph.nodes if n.op == "DequantizeLinear")
    assert np.dtype(dq.inputs[0].dtype) == np.dtype(variant.get("dtype", np.int8))


def test_scale_that_is_not_per_axis_is_left_alone():
    ir, record = run_strictly(cast_mul_model(scale_shape=(K, N)), "weight-only-dq")
    assert op_counts(ir)["Cast"] == 1 and "neither per-tensor nor per-axis" in record.notes[0]


def test_quantize_keeps_the_models_own_int8_weights(tmp_path):
    model, calib = tmp_path / "m.onnx", tmp_path / "c.npz"
    onnx.save(cast_mul_model(), str(model))
    np.savez(calib, x=np.random.default_rng(1).standard_normal((1, 8, K)).astype(np.float32))
    assert main(["run", "-q", "--passes", "weight-only-dq,cleanup", str(model), "-o", str(tmp_path / "dq.onnx")]) == 0
    assert main(["quantize", str(tmp_path / "dq.onnx"), "--calib", str(calib), "-o", str(tmp_path / "q.onnx")]) == 0
    original = onnx.numpy_helper.to_array(next(t for t in onnx.load(str(model)).graph.initializer if t.name == "q"))
    kept = [onnx.numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "q.onnx")).graph.initializer
            if t.data_type == onnx.TensorProto.INT8 and tuple(t.dims) == (K, N)]
    assert len(kept) == 1 and np.array_equal(kept[0], original)  # not re-quantized from floats
