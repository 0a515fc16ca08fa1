"""fold-conv-affine: BatchNorm / per-channel Mul / Add after a Conv fold into its weights."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from pass_testing import op_counts, run_strictly

from qnnpasses.backends.cpu import run_cpu
from qnnpasses.ir.load import load_model


def _conv_chain(tail: list[str], scale_shape=(4, 1, 1), bias: bool = True) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(scale_shape).astype(np.float32), "s"),
             numpy_helper.from_array(rng.standard_normal(scale_shape).astype(np.float32), "t")]
    for name in ("g", "b2", "mean"):
        inits.append(numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), name))
    inits.append(numpy_helper.from_array((rng.random(4) + 0.5).astype(np.float32), "var"))
    conv_inputs = ["x", "W"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "B"))
        conv_inputs.append("B")
    nodes = [helper.make_node("Conv", conv_inputs, ["c0"], name="conv", pads=[1, 1, 1, 1])]
    for i, op in enumerate(tail):
        ins = {"BatchNormalization": [f"c{i}", "g", "b2", "mean", "var"], "Mul": [f"c{i}", "s"], "Add": ["t", f"c{i}"]}[op]
        nodes.append(helper.make_node(op, ins, [f"c{i + 1}"], name=f"{op}_{i}"))
    nodes.append(helper.make_node("Relu", [f"c{len(tail)}"], ["y"], name="relu"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("tail", [["BatchNormalization"], ["Mul"], ["Add"], ["BatchNormalization", "Mul", "Add"]])
@pytest.mark.parametrize("bias", [True, False])
def test_affine_after_conv_folds_into_one_conv(tail, bias):
    model = _conv_chain(tail, bias=bias)
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    ir, record = run_strictly(model, "simplify,fold-conv-affine", inputs={"x": x})
    assert record.stats["folded"] == len(tail)
    assert op_counts(ir) == {"Conv": 1, "Relu": 1}
    np.testing.assert_allclose(run_cpu(ir, {"x": x})["y"], run_cpu(load_model(model), {"x": x})["y"],
                               rtol=1e-5, atol=1e-5)


def test_non_per_channel_constant_stays():
    model = _conv_chain(["Mul"], scale_shape=(4, 8, 8))
    ir, record = run_strictly(model, "simplify,fold-conv-affine")
    assert record.stats["folded"] == 0 and op_counts(ir)["Mul"] == 1
