"""lower-matmulnbits: com.microsoft.MatMulNBits => DequantizeLinear (4/8-bit, block-wise) + MatMul.

Exactness is checked against onnxruntime's own kernel at accuracy_level=0 (float activations);
the builder's accuracy_level=4 (int8 activations on the CPU) is the reference's approximation,
recorded, not enforced (see the pass docstring)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from pass_testing import op_counts

from qnnpasses.backends.cpu import run_cpu
from qnnpasses.ir.load import load_model
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.manager import PassManager, RunConfig
from qnnpasses.passmanager.spec import parse_pipeline

N = 24


def run_strictly(model, spec):
    """Checked, verified and strict, with --allow-lossy (the contract states no bound)."""
    ir = load_model(model)
    config = RunConfig(verify=True, strict=True, allow_lossy=True)
    result = PassManager(parse_pipeline(spec), config, context=PassContext(verbose=True, allow_lossy=True)).run(ir)
    return ir, result.records[-1]


def nbits_model(*, k=64, block=32, bits=4, zero_points=False, bias=False, accuracy_level=0, seed=0):
    rng = np.random.default_rng(seed)
    blocks = -(-k // block)
    packed = rng.integers(0, 256, (N, blocks, block * bits // 8), dtype=np.uint8)
    inits = [onnx.numpy_helper.from_array(packed, "w_q"),
             onnx.numpy_helper.from_array((rng.random(N * blocks) * 0.05 + 0.01).astype(np.float32), "w_scales")]
    names = ["a", "w_q", "w_scales"]
    if zero_points:
        per_row = -(-blocks * bits // 8)
        inits.append(onnx.numpy_helper.from_array(rng.integers(0, 256, N * per_row, dtype=np.uint8), "w_zp"))
        names.append("w_zp")
    if bias:
        names += [""] * (5 - len(names)) + ["b"]
        inits.append(onnx.numpy_helper.from_array(rng.standard_normal(N).astype(np.float32), "b"))
    node = helper.make_node("MatMulNBits", names, ["y"], domain="com.microsoft", K=k, N=N, bits=bits, block_size=block,
                            accuracy_level=accuracy_level)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, "seq", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seq", N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("variant", [
    {},
    {"zero_points": True},
    {"bits": 8},
    {"bits": 8, "zero_points": True, "bias": True},
    {"k": 48, "block": 32, "bias": True},       # a last, partial block
    {"k": 32, "block": 32},                     # one block: per-channel DequantizeLinear
    {"block": 16, "zero_points": True},
], ids=["int4-sym", "uint4-zp", "int8", "uint8-zp-bias", "partial-block", "one-block", "block16-zp"])
def test_lowering_is_exact_against_the_float_kernel(variant):
    model = nbits_model(**variant)
    ir, record = run_strictly(model, "lower-matmulnbits")
    assert record.stats == {"lowered": 1, "left": 0}
    ops = op_counts(ir)
    assert ops["DequantizeLinear"] == 1 and ops["MatMul"] == 1 and "MatMulNBits" not in ops
    assert record.verification["max_abs"] <= 1e-5  # every case, extreme included
    weight = ir.graph.nodes[0].inputs[0] if ir.graph.nodes[0].op == "DequantizeLinear" else None
    assert weight is not None
    expected = {4: ("int4" if not variant.get("zero_points") else "uint4"), 8: ("int8" if not variant.get("zero_points") else "uint8")}
    assert onnx.helper.tensor_dtype_to_np_dtype(_proto_dtype(ir)).name == expected[variant.get("bits", 4)]


def _proto_dtype(ir) -> int:
    from qnnpasses.ir.model import to_model_bytes

    proto = onnx.load_from_string(to_model_bytes(ir))
    dq = next(n for n in proto.graph.node if n.op_type == "DequantizeLinear")
    return next(t.data_type for t in proto.graph.initializer if t.name == dq.input[0])


def test_accuracy_level_4_deviation_is_the_reference_kernels():
    """Against the builder's accuracy_level=4 the lowered float product differs by the kernel's
    int8 activation rounding; against accuracy_level=0 it is exact."""
    approx, exact = nbits_model(accuracy_level=4), nbits_model(accuracy_level=0)
    ir, _ = run_strictly(approx, "lower-matmulnbits")
    a = {"a": np.random.default_rng(1).standard_normal((1, 8, 64)).astype(np.float32)}
    got = run_cpu(ir, a)["y"]
    assert np.abs(got - run_cpu(load_model(exact), a)["y"]).max() <= 1e-5
    deviation = np.abs(got - run_cpu(load_model(approx), a)["y"]).max()
    assert 1e-5 < deviation < 0.05 * np.abs(got).max()


def test_act_order_is_left_with_the_reason():
    model = nbits_model()
    node = model.graph.node[0]
    node.input.extend(["", "g_idx"])
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros(64, np.int32), "g_idx"))
    _, record = run_strictly(model, "lower-matmulnbits")
    assert record.stats == {"lowered": 0, "left": 1} and "g_idx" in record.notes[0]
