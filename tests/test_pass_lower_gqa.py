"""lower-gqa: com.microsoft.GroupQueryAttention => explicit attention with past/present KV as graph I/O,
verified against onnxruntime CPU running the original op (strict runner)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from pass_testing import op_counts, run_strictly

from qnnpasses.backends.cpu import make_inputs, run_cpu
from qnnpasses.ir.load import load_model
from qnnpasses.passmanager.api import PassContext, get_pass

D = 16  # head size (onnxruntime: a multiple of 16)
MAX_POS = 64


def gqa_model(*, heads=4, kv_heads=2, packed=True, rotary=True, interleaved=False, scale=0.0):
    """The builder's wiring: seqlens_k = ReduceSum(attention_mask) - 1, total = mask width."""
    nodes = [
        helper.make_node("ReduceSum", ["attention_mask", "one"], ["valid"], keepdims=0),
        helper.make_node("Sub", ["valid", "one"], ["valid1"]),
        helper.make_node("Cast", ["valid1"], ["seqlens_k"], to=TensorProto.INT32),
        helper.make_node("Shape", ["attention_mask"], ["mask_shape"]),
        helper.make_node("Gather", ["mask_shape", "one"], ["total"], axis=0),
        helper.make_node("Cast", ["total"], ["total32"], to=TensorProto.INT32),
    ]
    q_inputs = ["query", "", ""] if packed else ["query", "key", "value"]
    caches = ["cos_cache", "sin_cache"] if rotary else ["", ""]
    nodes.append(helper.make_node(
        "GroupQueryAttention", [*q_inputs, "past_key", "past_value", "seqlens_k", "total32", *caches],
        ["out", "present_key", "present_value"], domain="com.microsoft", num_heads=heads, kv_num_heads=kv_heads,
        do_rotary=int(rotary), rotary_interleaved=int(interleaved), scale=scale))
    inv = 1.0 / (10000 ** (np.arange(0, D, 2) / D))
    angles = np.outer(np.arange(MAX_POS), inv)
    inits = [onnx.numpy_helper.from_array(np.array([1], np.int64), "one"),
             onnx.numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos_cache"),
             onnx.numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin_cache")]
    if not rotary:
        inits = inits[:1]
    width = (heads + 2 * kv_heads) * D if packed else heads * D
    vi = helper.make_tensor_value_info
    inputs = [vi("query", TensorProto.FLOAT, ["batch_size", "sequence_length", width])]
    if not packed:
        inputs += [vi(n, TensorProto.FLOAT, ["batch_size", "sequence_length", kv_heads * D]) for n in ("key", "value")]
    inputs += [vi("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]),
               vi("past_key", TensorProto.FLOAT, ["batch_size", kv_heads, "past_sequence_length", D]),
               vi("past_value", TensorProto.FLOAT, ["batch_size", kv_heads, "past_sequence_length", D])]
    outputs = [vi("out", TensorProto.FLOAT, ["batch_size", "sequence_length", heads * D]),
               vi("present_key", TensorProto.FLOAT, ["batch_size", kv_heads, "total_sequence_length", D]),
               vi("present_value", TensorProto.FLOAT, ["batch_size", kv_heads, "total_sequence_length", D])]
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("variant", [
    {},
    {"packed": False},
    {"interleaved": True},
    {"rotary": False, "scale": 0.5},
    {"heads": 2, "kv_heads": 2},
], ids=["packed-rotary", "separate-qkv", "interleaved", "no-rotary-scale", "mha"])
def test_lowered_attention_matches_onnxruntime(variant):
    ir, record = run_strictly(gqa_model(**variant), "lower-gqa")
    assert record.stats == {"lowered": 1, "left": 0}
    ops = op_counts(ir)
    assert ops["Softmax"] == 1 and ops["Concat"] == 2 and "GroupQueryAttention" not in ops
    assert record.verification["ok"] and record.verification["cosine"] > 0.99999
    # past in, present out: the KV cache stays graph I/O, its length past + sequence
    assert [t.name for t in ir.graph.outputs] == ["out", "present_key", "present_value"]
    assert ir.graph.outputs[1].shape[2] == "past_sequence_length + sequence_length"
    assert {t.name for t in ir.graph.inputs} >= {"past_key", "past_value", "attention_mask"}


def test_decode_step_with_longer_past_matches():
    """One new token after 20 cached ones (the decode shape), not just the verification default."""
    model = gqa_model()
    inputs = make_inputs(load_model(model), 3, {"query": [1, 1, 128], "attention_mask": [1, 21],
                                                "past_key": [1, 2, 20, D], "past_value": [1, 2, 20, D]})
    ir, _ = run_strictly(model, "lower-gqa", inputs=inputs)
    expected, got = run_cpu(load_model(model), inputs), run_cpu(ir, inputs)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], atol=1e-5, rtol=1e-5)


def test_verification_shapes_bind_mask_to_past_plus_sequence():
    ir = load_model(gqa_model())
    planned = get_pass("lower-gqa")().planned_input_shapes(ir, PassContext(shapes={"query": [1, 5, 128]}))
    assert planned["attention_mask"] == [1, planned["past_key"][2] + 5]
    assert planned["past_key"][3] == D


def test_unsupported_variant_is_left_with_the_reason():
    model = gqa_model()
    node = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    node.attribute.append(helper.make_attribute("local_window_size", 4))
    _, record = run_strictly(model, "lower-gqa")
    assert record.stats == {"lowered": 0, "left": 1}
    assert "local_window_size" in record.notes[0]
