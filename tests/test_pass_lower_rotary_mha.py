"""lower-rotary-embedding and lower-mha: onnxruntime's RotaryEmbedding and MultiHeadAttention (what
the model builder writes for its fp16/CPU graphs) => standard ONNX, verified against onnxruntime CPU
running the original ops (strict runner)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from pass_testing import op_counts, run_strictly

D, HEADS, MAX_POS = 16, 4, 64


def _model(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


def _caches():
    angles = np.outer(np.arange(MAX_POS), 1.0 / (10000 ** (np.arange(0, D, 2) / D)))
    return [onnx.numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
            onnx.numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin")]


@pytest.mark.parametrize("rank,interleaved", [(3, False), (3, True), (4, False)])
def test_rotary_embedding_matches_onnxruntime(rank, interleaved):
    shape = [1, "seq", HEADS * D] if rank == 3 else [1, HEADS, "seq", D]
    node = helper.make_node("RotaryEmbedding", ["x", "position_ids", "cos", "sin"], ["y"], domain="com.microsoft",
                            interleaved=int(interleaved))
    model = _model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
                            helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "seq"])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], _caches())
    ir, record = run_strictly(model, "lower-rotary-embedding")
    assert record.stats == {"lowered": 1, "left": 0}
    ops = op_counts(ir)
    assert ops["MatMul"] == 1 and "RotaryEmbedding" not in ops  # rotate_half as x @ R, no Slice/Neg/Concat
    assert record.verification["cases"]["random"]["max_abs"] <= 1e-5  # unit-scale inputs; x1000 ones within rtol


@pytest.mark.parametrize("with_bias", [True, False])
def test_multi_head_attention_matches_onnxruntime(with_bias):
    inputs = ["q", "k", "v", "", "", "bias"] if with_bias else ["q", "k", "v"]
    node = helper.make_node("MultiHeadAttention", inputs, ["out"], domain="com.microsoft", num_heads=HEADS, scale=0.3)
    vi = helper.make_tensor_value_info
    graph_inputs = [vi("q", TensorProto.FLOAT, [1, 8, HEADS * D]), vi("k", TensorProto.FLOAT, [1, 12, HEADS * D]),
                    vi("v", TensorProto.FLOAT, [1, 12, HEADS * D])]
    if with_bias:
        graph_inputs.append(vi("bias", TensorProto.FLOAT, [1, HEADS, 8, 12]))
    model = _model([node], graph_inputs, [vi("out", TensorProto.FLOAT, [1, 8, HEADS * D])])
    ir, record = run_strictly(model, "lower-mha")
    assert record.stats == {"lowered": 1, "left": 0}
    assert op_counts(ir)["Softmax"] == 1 and record.verification["cases"]["random"]["max_abs"] <= 1e-5


def test_unidirectional_attention_is_left_with_the_reason():
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["out"], domain="com.microsoft", num_heads=HEADS,
                            unidirectional=1)
    vi = helper.make_tensor_value_info
    model = _model([node], [vi(n, TensorProto.FLOAT, [1, 8, HEADS * D]) for n in "qkv"],
                   [vi("out", TensorProto.FLOAT, [1, 8, HEADS * D])])
    _, record = run_strictly(model, "lower-mha")
    assert record.stats == {"lowered": 0, "left": 1} and "unidirectional" in record.notes[0]
