"""lower-simplified-norm: onnxruntime's (Skip)SimplifiedLayerNormalization => RMSNormalization,
verified against onnxruntime CPU running the original ops (strict runner: every case)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper
from pass_testing import op_counts, run_strictly

from qnnpasses.ir.load import load_model

H = 16


def _model(nodes, inputs, outputs, inits, opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model


def _vi(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def _weight(name, seed=0):
    return onnx.numpy_helper.from_array(np.random.default_rng(seed).uniform(0.5, 1.5, H).astype(np.float32), name)


def test_simplified_layer_normalization_loads_and_becomes_rmsnorm(capsys, tmp_path):
    model = _model([helper.make_node("SimplifiedLayerNormalization", ["x", "w"], ["y"], axis=-1, epsilon=1e-6, stash_type=1)],
                   [_vi("x", ["batch", "seq", H])], [_vi("y", ["batch", "seq", H])], [_weight("w")])
    onnx.save(model, str(tmp_path / "m.onnx"))
    load_model(tmp_path / "m.onnx")  # the checker does not know the op; onnxruntime runs it: loaded, reported
    assert "SimplifiedLayerNormalization (1)" in capsys.readouterr().err
    ir, record = run_strictly(model, "lower-simplified-norm")
    assert record.stats["lowered"] == 1 and ir.opset == 23
    assert op_counts(ir) == {"RMSNormalization": 1}
    assert record.verification["cases"]["extreme"]["ok"]  # x1000 inputs: same as onnxruntime's kernel


def test_skip_form_keeps_the_residual_sum_and_adds_the_bias():
    bias = onnx.numpy_helper.from_array(np.linspace(-1, 1, H).astype(np.float32), "bias")
    node = helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "w", "bias"], ["y", "", "", "sum"],
                            domain="com.microsoft", epsilon=1e-6)
    after = helper.make_node("Mul", ["sum", "y"], ["z"])  # the residual stream feeds the next block
    model = _model([node, after], [_vi("x", [1, 4, H]), _vi("skip", [1, 4, H])], [_vi("z", [1, 4, H]), _vi("sum", [1, 4, H])],
                   [_weight("w"), bias])
    ir, record = run_strictly(model, "lower-simplified-norm")
    assert record.stats == {"lowered": 1, "left": 0, "opset": "17->23"}
    assert op_counts(ir) == {"Add": 2, "RMSNormalization": 1, "Mul": 1}
    assert [t.name for t in ir.graph.outputs] == ["z", "sum"]


def test_used_statistics_outputs_are_left_alone():
    node = helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "w"], ["y", "mean", "inv"],
                            domain="com.microsoft", epsilon=1e-6)
    model = _model([node], [_vi("x", [1, 4, H]), _vi("skip", [1, 4, H])], [_vi("y", [1, 4, H]), _vi("inv", [1, 4, 1])],
                   [_weight("w")])
    ir, record = run_strictly(model, "lower-simplified-norm")
    assert record.stats["left"] == 1 and "inv_std_var" in record.notes[0]
    assert op_counts(ir) == {"SkipSimplifiedLayerNormalization": 1}
