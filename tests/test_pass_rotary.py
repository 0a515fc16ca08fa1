"""rotary: rotate_half spellings become one exact MatMul with a signed permutation; fixtures on CPU and HTP."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from conftest import (
    FIXTURE_NAMES,
    LLAMA_FAMILY,
    fixture_inputs,
    fixture_outputs,
    requires_htp,
)
from onnx import helper
from test_pass_layout import (
    assert_same_outputs,
    max_abs_vs_reference,
    op_counts,
    run_passes,
    simplified_fixture,
    tiny_model,
)

from qnnpasses.ir.model import save_model

SHAPE = [1, 2, 5, 8]
BIG = np.iinfo(np.int64).max


def _rope(rotate_nodes: list, rotated: str, extra_inits: dict) -> onnx.ModelProto:
    """``x*cos + rotate(x)*sin`` around the given rotate sub-graph (x -> ``rotated``)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Mul", ["x", "cos"], ["xc"]), *rotate_nodes,
             helper.make_node("Mul", ["sin", rotated], ["rs"]), helper.make_node("Add", ["rs", "xc"], ["y"])]
    inits = {"cos": rng.standard_normal([1, 1, 5, 8]).astype(np.float32),
             "sin": rng.standard_normal([1, 1, 5, 8]).astype(np.float32), **extra_inits}
    return tiny_model(nodes, [("x", SHAPE)], [("y", SHAPE)], inits)


def _half(axis_value: int, end, negate: str = "Neg") -> onnx.ModelProto:
    neg = (helper.make_node("Neg", ["hi"], ["nhi"]) if negate == "Neg"
           else helper.make_node("Mul", ["hi", "m1"], ["nhi"]))
    nodes = [helper.make_node("Slice", ["x", "zero", "half", "ax"], ["lo"]),
             helper.make_node("Slice", ["x", "half", "end", "ax"], ["hi"]), neg,
             helper.make_node("Concat", ["nhi", "lo"], ["rot"], axis=-1)]
    inits = {"zero": np.array([0]), "half": np.array([4]), "end": np.array([end]), "ax": np.array([axis_value]),
             "m1": np.array(-1.0, dtype=np.float32)}
    return _rope(nodes, "rot", inits)


def _interleaved() -> onnx.ModelProto:
    """GPT-J/NeoX rotate_every_two: stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)."""
    nodes = [helper.make_node("Slice", ["x", "zero", "end", "ax", "two"], ["ev"]),
             helper.make_node("Slice", ["x", "one", "end", "ax", "two"], ["od"]),
             helper.make_node("Neg", ["od"], ["nod"]),
             helper.make_node("Unsqueeze", ["nod", "last"], ["a"]), helper.make_node("Unsqueeze", ["ev", "last"], ["b"]),
             helper.make_node("Concat", ["a", "b"], ["ab"], axis=-1), helper.make_node("Reshape", ["ab", "shape"], ["rot"])]
    inits = {"zero": np.array([0]), "one": np.array([1]), "two": np.array([2]), "end": np.array([BIG]),
             "ax": np.array([-1]), "last": np.array([-1]), "shape": np.array(SHAPE)}
    return _rope(nodes, "rot", inits)


@pytest.mark.parametrize("model", [
    pytest.param(_half(3, BIG), id="torchscript-axis3-int64max"),
    pytest.param(_half(-1, 8), id="dynamo-axis-1-end8"),
    pytest.param(_half(-1, 8, negate="Mul"), id="mul-minus-one"),
    pytest.param(_interleaved(), id="interleaved"),
])
def test_rotation_becomes_one_exact_matmul(model):
    ir, records = run_passes(model, "rotary")
    assert records["rotary"].stats == {"rotations": 1}
    assert op_counts(ir) == Counter({"Mul": 2, "Add": 1, "MatMul": 1})
    matmul = next(n for n in ir.graph.nodes if n.op == "MatMul")
    r = matmul.inputs[1].values
    assert r.shape == (1, 1, 8, 8) and sorted(np.abs(r).sum(axis=-2).ravel().tolist()) == [1.0] * 8
    assert_same_outputs(model, ir, exact=True)  # +-x plus exact zeros: bit-identical


def test_half_rotation_matrix_is_the_textbook_one():
    ir, _ = run_passes(_half(3, BIG), "rotary")
    r = next(n for n in ir.graph.nodes if n.op == "MatMul").inputs[1].values[0, 0]
    expected = np.zeros((8, 8), np.float32)
    expected[4:, :4] = -np.eye(4)
    expected[:4, 4:] = np.eye(4)
    np.testing.assert_array_equal(r, expected)


def test_non_rotations_are_left_alone():
    """Duplicated halves (not a permutation) and halves of two different tensors."""
    dup = [helper.make_node("Slice", ["x", "zero", "half", "ax"], ["lo"]), helper.make_node("Neg", ["lo"], ["nlo"]),
           helper.make_node("Concat", ["nlo", "lo"], ["rot"], axis=-1)]
    inits = {"zero": np.array([0]), "half": np.array([4]), "ax": np.array([-1])}
    ir, records = run_passes(_rope(dup, "rot", inits), "rotary")
    assert records["rotary"].stats == {"rotations": 0} and "Concat" in op_counts(ir)
    assert any("not a signed permutation" in n for n in records["rotary"].notes)
    two = [helper.make_node("Slice", ["x", "zero", "half", "ax"], ["lo"]), helper.make_node("Neg", ["xc"], ["nxc"]),
           helper.make_node("Slice", ["nxc", "half", "end", "ax"], ["hi"]),
           helper.make_node("Concat", ["hi", "lo"], ["rot"], axis=-1)]
    ir, records = run_passes(_rope(two, "rot", {**inits, "end": np.array([8])}), "rotary")
    assert records["rotary"].stats == {"rotations": 0}
    assert any("2 different tensors" in n for n in records["rotary"].notes)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_rotary_on_fixture(name):
    ir, records = run_passes(simplified_fixture(name), "rotary")
    assert records["rotary"].stats["rotations"] == (4 if name in LLAMA_FAMILY else 0)  # Q and K in 2 layers
    if name in LLAMA_FAMILY:
        assert "Neg" not in op_counts(ir)
        assert max_abs_vs_reference(ir, name) <= 1e-4


@requires_htp
def test_rotary_on_htp_fewer_ops_same_fp16_numerics(tmp_path):
    from qnnpasses.backends.cpu import cosine_similarity
    from qnnpasses.backends.htp import probe_placement, run_on_htp

    name = "llama_gqa_ts"
    ir, _ = run_passes(simplified_fixture(name), "rotary")
    after_path = save_model(ir, tmp_path / "rotary.onnx")
    before, after = probe_placement(simplified_fixture(name)), probe_placement(after_path)
    b, a = before.qnn_graph_ops["by_type"], after.qnn_graph_ops["by_type"]
    print(f"composed QNN ops {name}: {before.qnn_graph_ops['total']} -> {after.qnn_graph_ops['total']}")
    assert after.ok and after.cpu_nodes == []
    assert before.qnn_graph_ops["total"] - after.qnn_graph_ops["total"] == 12  # 4 x (2 StridedSlice + Neg + Concat - MatMul)
    assert "ElementWiseNeg" not in a and a.get("StridedSlice", 0) == 0 and a["MatMul"] == b["MatMul"] + 4
    feeds, reference = fixture_inputs(name), fixture_outputs(name)
    for path in (simplified_fixture(name), after_path):
        got = run_on_htp(path, feeds)
        cos = cosine_similarity(got["logits"].astype(np.float64), reference["logits"].astype(np.float64))
        assert cos >= 0.9999, f"{path.name}: cosine {cos}"
