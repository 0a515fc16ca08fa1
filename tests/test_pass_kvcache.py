"""kvcache passes on small graphs written in ONNX text: the cache Concat distributed over attention
(verified on CPU by the manager, strict), the present outputs replaced by the new K/V, and the
rotary positions exposed as an input."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from pass_testing import op_counts, run_strictly

from qnnpasses.ir.model import save_model

# One attention with a cache: GQA repeat_kv (Unsqueeze/Expand/Reshape), K transposed for Q·Kᵀ.
ATTENTION = """
<ir_version: 8, opset_import: ["" : 17]>
attn (float[1,4,3,8] q, float[1,2,5,8] past_k, float[1,2,5,8] past_v, float[1,2,3,8] k_raw, float[1,2,3,8] v_raw)
    => (float[1,4,3,8] out, float[1,2,8,8] present_k) {
    new_k = Neg (k_raw)
    new_v = Neg (v_raw)
    present_k = Concat <axis = -2> (past_k, new_k)
    present_v = Concat <axis = -2> (past_v, new_v)
    axes = Constant <value = int64[1] {2}> ()
    ku = Unsqueeze (present_k, axes)
    vu = Unsqueeze (present_v, axes)
    shape5 = Constant <value = int64[5] {1, 2, 2, 8, 8}> ()
    ke = Expand (ku, shape5)
    ve = Expand (vu, shape5)
    shape4 = Constant <value = int64[4] {1, 4, 8, 8}> ()
    k = Reshape (ke, shape4)
    v = Reshape (ve, shape4)
    kt = Transpose <perm = [0, 1, 3, 2]> (k)
    scores = MatMul (q, kt)
    probs = Softmax <axis = -1> (scores)
    out = MatMul (probs, v)
}
"""


def _model(tmp_path):
    path = tmp_path / "attn.onnx"
    onnx.save(onnx.parser.parse_model(ATTENTION), path)
    return path


def _inputs():
    rng = np.random.default_rng(0)
    shapes = {"q": (1, 4, 3, 8), "past_k": (1, 2, 5, 8), "past_v": (1, 2, 5, 8), "k_raw": (1, 2, 3, 8), "v_raw": (1, 2, 3, 8)}
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def test_split_concat_leaves_no_concat_of_a_graph_input(tmp_path):
    ir, record = run_strictly(_model(tmp_path), "kv-split-concat", inputs=_inputs())
    assert record.status == "changed", record.reason
    inputs = {t.name for t in ir.graph.inputs}
    cache_concats = [n for n in ir.graph.nodes if n.op == "Concat" and inputs & {t.name for t in n.inputs}]
    # present_k is a graph output: its Concat stays for the output, the attention reads the parts
    assert [n.outputs[0].name for n in cache_concats] == ["present_k"]
    assert all(c.op != "MatMul" for c in cache_concats[0].outputs[0].outputs)
    assert record.stats["matmul_concat"] == 1 and record.stats["matmul_split_sum"] == 1
    assert op_counts(ir)["MatMul"] == 4


def test_new_outputs_then_split_removes_every_cache_concat(tmp_path):
    from qnnpasses.passes.kvcache.kv_new_outputs import KvNewOutputs

    from qnnpasses.ir.load import load_model
    from qnnpasses.passmanager.api import PassContext

    ir = load_model(_model(tmp_path))
    assert KvNewOutputs(replace="present", by="new").run(ir, PassContext()).changed
    assert [t.name for t in ir.graph.outputs] == ["out", "new_k"]
    path = save_model(ir, tmp_path / "new.onnx")
    ir, _ = run_strictly(path, "kv-split-concat", inputs=_inputs())
    assert not [n for n in ir.graph.nodes if n.op == "Concat" and any(t.name.startswith("past") for t in n.inputs)]
    got = ort.InferenceSession(str(save_model(ir, tmp_path / "split.onnx"))).run(None, _inputs())
    ref = ort.InferenceSession(str(_model(tmp_path))).run(None, _inputs())
    np.testing.assert_allclose(got[0], ref[0], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(got[1], -_inputs()["k_raw"])
