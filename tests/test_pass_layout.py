"""layout: exact rewrites per family on tiny graphs, all fixtures on CPU, the composed QNN graph on HTP.

Also home of the helpers the rotary / gathernd tests share: the onnxsim'd fixtures (cached
on disk per fixture content) and tiny-model builders.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import (
    FIXTURE_NAMES,
    LLAMA_FAMILY,
    fixture_inputs,
    fixture_outputs,
    fixture_path,
    requires_htp,
)
from onnx import TensorProto, helper, numpy_helper

from qnnpasses.backends.cpu import run_cpu
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import save_model
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.manager import PassManager, RunConfig
from qnnpasses.passmanager.spec import parse_pipeline

CACHE = Path(tempfile.gettempdir()) / "qnnpasses_test_simplified"
TOLERANCE = 1e-4
F32 = TensorProto.FLOAT


# --------------------------------------------------------------------------- shared helpers


def simplified_fixture(name: str) -> Path:
    """The fixture after onnxsim (what ``simplify`` leaves for the layout passes), cached on disk."""
    source = fixture_path(name)
    digest = hashlib.sha1(source.read_bytes()).hexdigest()[:12]
    target = CACHE / f"{name}.{digest}.onnx"
    if not target.exists():
        import onnxsim

        CACHE.mkdir(parents=True, exist_ok=True)
        model, ok = onnxsim.simplify(onnx.load(source))
        assert ok, f"onnxsim failed on {name}"
        tmp = target.with_suffix(f".{os.getpid()}.tmp")  # parallel workers never share a half-written file
        onnx.save(model, tmp)
        tmp.replace(target)
    return target


def run_passes(model, spec: str, inputs=None):
    """``(ir, records by pass name)`` after running ``spec``; a path or ModelProto goes in."""
    ir = load_model(model)
    config = RunConfig(verify=inputs is not None, inputs=inputs)
    manager = PassManager(parse_pipeline(spec), config, context=PassContext(verbose=True))
    manager.run(ir)
    return ir, {r.name: r for r in manager.records}


def op_counts(ir) -> Counter:
    return Counter(n.op for n in ir.graph.nodes)


def tiny_model(nodes, inputs, outputs, inits=None, opset: int = 17, dtype=F32) -> onnx.ModelProto:
    """A one-graph model; ``inputs``/``outputs`` are ``(name, shape)`` pairs."""
    graph = helper.make_graph(
        nodes, "tiny",
        [helper.make_tensor_value_info(n, dtype, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, dtype, s) for n, s in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def random_feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def assert_same_outputs(before: onnx.ModelProto, ir, feeds=None, exact: bool = True) -> None:
    feeds = feeds or random_feeds(before)
    session = ort.InferenceSession(before.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    got = run_cpu(ir, feeds)
    for name, value in expected.items():
        assert got[name].shape == value.shape
        if exact:
            np.testing.assert_array_equal(got[name], value)
        else:
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6)


def max_abs_vs_reference(ir, name: str) -> float:
    got, ref = run_cpu(ir, fixture_inputs(name)), fixture_outputs(name)
    return max(float(np.max(np.abs(got[k].astype(np.float64) - ref[k]))) for k in ref)


# --------------------------------------------------------------------------- chains


def _layout(model, spec="layout"):
    ir, records = run_passes(model, spec)
    return ir, records["layout"]


def test_inverse_transposes_cancel_and_merge():
    nodes = [helper.make_node("Transpose", ["x"], ["a"], perm=[1, 0, 2]),
             helper.make_node("Transpose", ["a"], ["b"], perm=[1, 0, 2]),
             helper.make_node("Transpose", ["b"], ["c"], perm=[0, 2, 1]),
             helper.make_node("Transpose", ["c"], ["y"], perm=[2, 1, 0])]
    model = tiny_model(nodes, [("x", [2, 3, 4])], [("y", [3, 4, 2])])
    ir, record = _layout(model)
    assert op_counts(ir) == Counter({"Transpose": 1})
    assert ir.graph.nodes[0].attrs["perm"] == [1, 2, 0]
    assert record.stats["chains_to_transpose"] == 1
    assert_same_outputs(model, ir)


def test_reshape_squeeze_unsqueeze_chain_becomes_one_reshape_or_nothing():
    nodes = [helper.make_node("Unsqueeze", ["x", "ax"], ["a"]),
             helper.make_node("Reshape", ["a", "s"], ["b"]),
             helper.make_node("Flatten", ["b"], ["c"], axis=1),
             helper.make_node("Reshape", ["c", "s2"], ["d"]),
             helper.make_node("Relu", ["d"], ["y"])]
    inits = {"ax": np.array([0]), "s": np.array([0, 0, 4, 3]), "s2": np.array([2, 3, 4])}
    model = tiny_model(nodes, [("x", [2, 12])], [("y", [2, 3, 4])], inits)
    ir, _ = _layout(model)
    assert op_counts(ir) == Counter({"Reshape": 1, "Relu": 1})
    assert_same_outputs(model, ir)

    identity = tiny_model([helper.make_node("Unsqueeze", ["x", "ax"], ["a"]), helper.make_node("Squeeze", ["a", "ax"], ["b"]),
                           helper.make_node("Relu", ["b"], ["y"])], [("x", [2, 12])], [("y", [2, 12])], {"ax": np.array([1])})
    ir, record = _layout(identity)
    assert op_counts(ir) == Counter({"Relu": 1}) and record.stats["chains_to_identity"] == 1


def test_transpose_of_unit_axes_is_a_reshape():
    """Decode head split: [1,1,64] -> [1,1,4,16] -> Transpose(0,2,1,3) only moves a size-1 axis."""
    nodes = [helper.make_node("Reshape", ["x", "s"], ["a"]), helper.make_node("Transpose", ["a"], ["b"], perm=[0, 2, 1, 3]),
             helper.make_node("Relu", ["b"], ["y"])]
    model = tiny_model(nodes, [("x", [1, 1, 64])], [("y", [1, 4, 1, 16])], {"s": np.array([1, 1, 4, 16])})
    ir, _ = _layout(model)
    assert op_counts(ir) == Counter({"Reshape": 1, "Relu": 1})
    assert_same_outputs(model, ir)


def test_repeat_kv_becomes_one_gather():
    nodes = [helper.make_node("Unsqueeze", ["x", "ax"], ["a"]), helper.make_node("Expand", ["a", "e"], ["b"]),
             helper.make_node("Reshape", ["b", "s"], ["c"]), helper.make_node("Relu", ["c"], ["y"])]
    inits = {"ax": np.array([2]), "e": np.array([1, 2, 3, 5, 4]), "s": np.array([1, 6, 5, 4])}
    model = tiny_model(nodes, [("x", [1, 2, 5, 4])], [("y", [1, 6, 5, 4])], inits)
    ir, record = _layout(model)
    assert op_counts(ir) == Counter({"Gather": 1, "Relu": 1})
    gather = next(n for n in ir.graph.nodes if n.op == "Gather")
    assert gather.attrs["axis"] == 1 and gather.inputs[1].values.tolist() == [0, 0, 0, 1, 1, 1]
    assert_same_outputs(model, ir)


def test_transposes_never_become_element_gathers():
    """A Transpose stays a Transpose even inside a chain a big Gather could replace."""
    nodes = [helper.make_node("Transpose", ["x"], ["a"], perm=[0, 2, 1, 3]), helper.make_node("Unsqueeze", ["a", "ax"], ["b"]),
             helper.make_node("Expand", ["b", "e"], ["c"]), helper.make_node("Reshape", ["c", "s"], ["y"])]
    inits = {"ax": np.array([2]), "e": np.array([1, 2, 2, 16, 8]), "s": np.array([1, 4, 16, 8])}
    model = tiny_model(nodes, [("x", [1, 16, 2, 8])], [("y", [1, 4, 16, 8])], inits)
    ir, _ = _layout(model)
    assert op_counts(ir) == Counter({"Transpose": 1, "Gather": 1})
    assert_same_outputs(model, ir)


def test_gather_of_arange_is_a_reshape():
    """TorchScript's padding mask: Flatten -> Gather(arange indices) -> Reshape."""
    nodes = [helper.make_node("Flatten", ["x"], ["a"], axis=2), helper.make_node("Gather", ["a", "i"], ["b"], axis=0),
             helper.make_node("Reshape", ["b", "s"], ["c"]), helper.make_node("Relu", ["c"], ["y"])]
    inits = {"i": np.arange(16).reshape(1, 1, 1, 16), "s": np.array([1, 1, 1, 16])}
    model = tiny_model(nodes, [("x", [1, 16])], [("y", [1, 1, 1, 16])], inits)
    ir, _ = _layout(model)
    assert op_counts(ir) == Counter({"Reshape": 1, "Relu": 1})
    assert_same_outputs(model, ir)


# --------------------------------------------------------------------------- identity


def test_empty_concat_operand_and_full_slice_are_dropped():
    """Phi-3's partial rotary: Concat(rotated, x[..., 16:]) with a 16-wide head."""
    nodes = [helper.make_node("Slice", ["x", "z", "e", "a3"], ["full"]),
             helper.make_node("Slice", ["x", "e", "big", "a3"], ["empty"]),
             helper.make_node("Relu", ["full"], ["r"]), helper.make_node("Concat", ["r", "empty"], ["y"], axis=-1)]
    inits = {"z": np.array([0]), "e": np.array([16]), "big": np.array([2**62]), "a3": np.array([3])}
    model = tiny_model(nodes, [("x", [1, 2, 4, 16])], [("y", [1, 2, 4, 16])], inits)
    ir, record = _layout(model)
    assert op_counts(ir) == Counter({"Relu": 1})
    assert record.stats["identity_empty_operands"] == 1 and record.stats["identity_concat"] == 1
    assert_same_outputs(model, ir)


@pytest.mark.parametrize("mid,removed", [(TensorProto.FLOAT, True), (TensorProto.INT8, False)])
def test_cast_round_trip_dropped_only_when_exact(mid, removed):
    nodes = [helper.make_node("Cast", ["x"], ["a"], to=mid), helper.make_node("Cast", ["a"], ["b"], to=TensorProto.FLOAT16),
             helper.make_node("Relu", ["b"], ["y"])]
    model = tiny_model(nodes, [("x", [3, 4])], [("y", [3, 4])], dtype=TensorProto.FLOAT16)
    ir, _ = _layout(model)
    assert ("Cast" in op_counts(ir)) != removed
    assert_same_outputs(model, ir)


# --------------------------------------------------------------------------- rows2d / weights


def _mlp_model():
    """Norm-free LLaMA-ish block on [1, S, H]: three projections read the residual stream."""
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["x", "w3"], ["u"]),
             helper.make_node("Sigmoid", ["h"], ["g"]), helper.make_node("Mul", ["h", "g"], ["s"]),
             helper.make_node("Mul", ["s", "u"], ["su"]), helper.make_node("MatMul", ["su", "w2"], ["o"]),
             helper.make_node("Add", ["x", "o"], ["r"]), helper.make_node("ReduceMean", ["r"], ["m"], axes=[-1]),
             helper.make_node("Sub", ["r", "m"], ["y"])]
    inits = {name: rng.standard_normal(shape).astype(np.float32)
             for name, shape in (("w1", (16, 32)), ("w3", (16, 32)), ("w2", (32, 16)))}
    return tiny_model(nodes, [("x", [1, 8, 16])], [("y", [1, 8, 16])], inits)


def test_rows2d_computes_the_residual_region_in_2d():
    model = _mlp_model()
    ir, record = _layout(model)
    shapes = {n.op: list(n.outputs[0].shape) for n in ir.graph.nodes}
    assert shapes["MatMul"] == [8, 16] and shapes["ReduceMean"] == [8, 1]
    assert op_counts(ir)["Reshape"] == 2  # one in, one out, instead of one per projection on the HTP
    assert record.stats["rows2d_regions"] == 1 and record.stats["rows2d_ops_saved"] == 1
    assert_same_outputs(model, ir, exact=False)
    ir_off, _ = _layout(model, "layout{rows2d=false}")
    assert "Reshape" not in op_counts(ir_off)


def test_split_proj_slices_the_weight():
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Split", ["p", "sz"], ["a", "b", "c"], axis=-1),
             helper.make_node("Add", ["a", "b"], ["ab"]), helper.make_node("Mul", ["ab", "c"], ["y"])]
    inits = {"w": rng.standard_normal((16, 48)).astype(np.float32), "sz": np.array([16, 16, 16])}
    model = tiny_model(nodes, [("x", [8, 16])], [("y", [8, 16])], inits)
    ir, record = _layout(model)
    assert op_counts(ir) == Counter({"MatMul": 3, "Add": 1, "Mul": 1}) and record.stats["split_proj"] == 1
    assert_same_outputs(model, ir, exact=False)


def test_head_proj_folds_the_head_split_into_the_weight():
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["pb"]),
             helper.make_node("Reshape", ["pb", "s"], ["r"]), helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3]),
             helper.make_node("Softmax", ["t"], ["y"], axis=-1)]
    inits = {"w": rng.standard_normal((16, 32)).astype(np.float32), "b": rng.standard_normal(32).astype(np.float32),
             "s": np.array([1, 8, 4, 8])}
    model = tiny_model(nodes, [("x", [8, 16])], [("y", [1, 4, 8, 8])], inits)
    ir, record = _layout(model)
    assert op_counts(ir) == Counter({"MatMul": 1, "Add": 1, "Softmax": 1}) and record.stats["head_proj"] == 1
    weight = next(n for n in ir.graph.nodes if n.op == "MatMul").inputs[1]
    assert tuple(weight.shape) == (1, 4, 16, 8)
    assert_same_outputs(model, ir, exact=False)


def test_transposed_constant_weights_are_folded():
    rng = np.random.default_rng(4)
    inits = {"wg": rng.standard_normal((16, 32)).astype(np.float32), "wm": rng.standard_normal((32, 16)).astype(np.float32)}
    nodes = [helper.make_node("Transpose", ["wg"], ["wt"]), helper.make_node("Gemm", ["x", "wt"], ["g"], transB=1),
             helper.make_node("Transpose", ["wm"], ["wt2"]), helper.make_node("MatMul", ["x", "wt2"], ["m"]),
             helper.make_node("Add", ["m", "g"], ["y"])]
    model = tiny_model(nodes, [("x", [8, 16])], [("y", [8, 32])], inits)
    ir, record = _layout(model, "layout{chains=false}")
    assert "Transpose" not in op_counts(ir) and record.stats["weights_folded"] == 2
    gemm = next(n for n in ir.graph.nodes if n.op == "Gemm")
    assert gemm.attrs["transB"] == 0
    assert_same_outputs(model, ir, exact=False)


# --------------------------------------------------------------------------- sink / norm_axis


def test_transpose_sinks_through_elementwise_ops_and_cancels():
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2]), helper.make_node("Mul", ["t", "c"], ["m"]),
             helper.make_node("Add", ["m", "k"], ["a"]), helper.make_node("Softmax", ["a"], ["s"], axis=-1),
             helper.make_node("Transpose", ["s"], ["y"], perm=[1, 0, 2])]
    inits = {"c": rng.standard_normal((5, 1, 6)).astype(np.float32), "k": np.float32(0.5)}
    model = tiny_model(nodes, [("x", [2, 5, 6])], [("y", [2, 5, 6])], inits)
    ir, record = _layout(model, "layout{chains=false}")
    assert op_counts(ir) == Counter({"Mul": 1, "Add": 1, "Softmax": 1}) and record.stats["sink_transposes"] == 1
    mul = next(n for n in ir.graph.nodes if n.op == "Mul")
    assert mul.inputs[0].name == "x" and tuple(mul.inputs[1].shape) == (1, 5, 6)
    assert_same_outputs(model, ir, exact=False)


def test_two_transposed_operands_share_one_transpose():
    nodes = [helper.make_node("Transpose", ["x"], ["a"], perm=[1, 0]), helper.make_node("Transpose", ["z"], ["b"], perm=[1, 0]),
             helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Transpose", ["s"], ["y"], perm=[1, 0])]
    model = tiny_model(nodes, [("x", [3, 4]), ("z", [3, 4])], [("y", [3, 4])])
    ir, _ = _layout(model, "layout{chains=false}")
    assert op_counts(ir) == Counter({"Add": 1})
    assert_same_outputs(model, ir)


def test_softmax_over_a_transposed_axis_is_made_contiguous():
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]), helper.make_node("Softmax", ["t"], ["y"], axis=1)]
    model = tiny_model(nodes, [("x", [2, 5, 6])], [("y", [2, 6, 5])], opset=17)
    ir, record = _layout(model)
    softmax = next(n for n in ir.graph.nodes if n.op == "Softmax")
    assert softmax.attrs["axis"] == -1 and softmax.inputs[0].name == "x" and record.stats["norm_axis"] == 1
    assert_same_outputs(model, ir, exact=False)


# --------------------------------------------------------------------------- fixtures

#: (head_proj, split_proj, rows2d regions) per architecture after onnxsim; the rest: (6, 0, 1).
#: head_proj: Q, K, V of 2 layers (BERT/GPT-2 transpose K straight to K^T: Q, V only);
#: split_proj: the fused QKV (MHA TorchScript/dynamo, GPT-2) and gate-up (Phi-3) projections.
EXPECTED = {"bert": (4, 0, 1), "gpt2": (4, 2, 3), "llama_mha": (6, 2, 1), "phi3": (6, 4, 1)}


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_layout_on_fixture_is_exact_and_rewrites_the_expected_patterns(name):
    ir, records = run_passes(simplified_fixture(name), "layout")
    record = records["layout"]
    assert record.status == "changed", record.reason
    assert max_abs_vs_reference(ir, name) <= TOLERANCE
    arch = name.rsplit("_", 1)[0]
    head, split, regions = EXPECTED.get(arch, (6, 0, 1))
    assert (record.stats.get("head_proj", 0), record.stats.get("split_proj", 0), record.stats.get("rows2d_regions", 0)) \
        == (head, split, regions)
    if name == "phi3_ts":
        assert record.stats["identity_empty_operands"] == 4
    if name in LLAMA_FAMILY and "gqa" in name and "kv" not in name:
        assert record.stats["chains_to_gather"] == 4  # repeat_kv of K and V in both layers


# --------------------------------------------------------------------------- index maps vs onnxruntime

INDEX_CASES = [  # (op, attrs, x shape, constant inputs, opset)
    ("Reshape", {}, (2, 3, 4), [np.array([0, -1])], 17),
    ("Reshape", {"allowzero": 1}, (2, 3, 4), [np.array([4, 3, 2])], 17),
    ("Flatten", {"axis": 2}, (2, 3, 4), [], 17),
    ("Squeeze", {}, (1, 3, 1, 4), [np.array([-2])], 17),
    ("Squeeze", {"axes": [0]}, (1, 3, 1, 4), [], 11),
    ("Unsqueeze", {}, (3, 4), [np.array([-1, 0])], 17),
    ("Transpose", {}, (2, 3, 4), [], 17),
    ("Transpose", {"perm": [1, 2, 0]}, (2, 3, 4), [], 17),
    ("Expand", {}, (3, 1), [np.array([2, 1, 4])], 17),
    ("Tile", {}, (2, 3), [np.array([2, 2])], 17),
    ("Slice", {}, (4, 6), [np.array([-1, 1]), np.array([-2**63, 5]), np.array([0, 1]), np.array([-1, 2])], 17),
    ("Slice", {}, (4, 6), [np.array([2]), np.array([2**62]), np.array([-1])], 17),
    ("Gather", {"axis": 1}, (3, 5), [np.array([[4, -1], [0, 2]])], 17),
    ("GatherND", {"batch_dims": 1}, (2, 3, 4), [np.array([[[2], [0]], [[1], [-1]]])], 17),
    ("GatherND", {}, (1, 16), [np.stack([np.zeros(16, int), np.arange(16)], -1).reshape(1, 1, 1, 16, 2)], 17),
]


@pytest.mark.parametrize("op,attrs,shape,consts,opset", INDEX_CASES, ids=[c[0] for c in INDEX_CASES])
def test_index_semantics_match_onnxruntime(op, attrs, shape, consts, opset):
    from qnnpasses.ir.index_map import apply_op

    names = [f"c{i}" for i in range(len(consts))]
    model = tiny_model([helper.make_node(op, ["x", *names], ["y"], **attrs)], [("x", list(shape))], [("y", None)],
                       dict(zip(names, consts)), opset=opset)
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    class Node:  # the two fields apply_op reads
        pass

    node = Node()
    node.op, node.attrs = op, attrs
    got = apply_op(node, x, [None, *consts] + [None] * (5 - len(consts)), opset)
    np.testing.assert_array_equal(got, expected)


# --------------------------------------------------------------------------- HTP


@requires_htp
def test_data_movement_passes_cut_the_composed_qnn_graph_of_llama_gqa_ts(tmp_path):
    """onnxsim -> rotary, gathernd, layout: at most 0.75x the ops of onnxslim's composed QNN graph."""
    import onnxslim

    from qnnpasses.backends.htp import probe_placement

    name = "llama_gqa_ts"
    slim = tmp_path / "slim.onnx"
    onnx.save(onnxslim.slim(onnx.load(fixture_path(name))), slim)
    ir, records = run_passes(simplified_fixture(name), "rotary,gathernd,layout", inputs=fixture_inputs(name))
    assert records["layout"].status == "changed" and records["rotary"].status == "changed"
    ours = save_model(ir, tmp_path / "ours.onnx")
    counts = {label: probe_placement(path) for label, path in
              (("onnxsim", simplified_fixture(name)), ("onnxslim", slim), ("ours", ours))}
    totals = {label: p.qnn_graph_ops["total"] for label, p in counts.items()}
    print(f"composed QNN ops on {name}: {totals}; ours by type: {counts['ours'].qnn_graph_ops['by_type']}")
    assert all(p.ok for p in counts.values())
    assert counts["ours"].cpu_nodes == [] and counts["ours"].qnn_partitions == 1
    assert totals["ours"] <= 0.75 * totals["onnxslim"]
    assert totals["onnxsim"] - totals["ours"] >= 40
    by_type = counts["ours"].qnn_graph_ops["by_type"]
    assert "StridedSlice" not in by_type and "Concat" not in by_type and by_type.get("Reshape", 0) <= 12
