"""Weights stay on disk through the pipeline: mapped when read, rewritten weights kept as
recipes (DerivedValues) and computed one at a time while saving; outputs unchanged."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.backends.cpu import run_cpu
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import DerivedValues, ExternalValues, save_model
from qnnpasses.passmanager.manager import PassManager
from qnnpasses.passmanager.named import get_pipeline
from qnnpasses.passmanager.spec import parse_pipeline

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from make_big_llm import LlamaShape, build  # noqa: E402


def test_htp_llm_on_external_weights_keeps_them_lazy_and_exact(tmp_path):
    src = build(LlamaShape(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=300, seq=16),
                tmp_path / "src" / "model.onnx", dtype="float32", weights="random")
    spec = get_pipeline("htp-llm").to_text()
    ir = load_model(src)
    PassManager(parse_pipeline(spec)).run(ir)
    constants = [t for t in ir.graph.tensors().values() if isinstance(t, gs.Constant)]
    derived = [t for t in constants if isinstance(t._values, DerivedValues)]
    assert len(derived) >= 2 * 3, "head-major q/k/v projections should be recipes, not arrays"
    out = save_model(ir, tmp_path / "out" / "model.onnx")
    assert (tmp_path / "out" / "model.onnx.data").exists()
    assert all(isinstance(t._values, DerivedValues) for t in derived), "saving must not cache computed weights"
    inputs = {"input_ids": np.arange(16, dtype=np.int64)[None] % 300}
    expected, got = run_cpu(src, inputs)["logits"], run_cpu(out, inputs)["logits"]
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_matching_reads_no_weight_it_leaves_alone(tmp_path):
    """Passes match projections on a weight's shape: a weight no pass rewrites is never read."""
    src = build(LlamaShape(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=300, seq=16),
                tmp_path / "src" / "model.onnx", dtype="float32", weights="random")
    ir = load_model(src)
    PassManager(parse_pipeline(get_pipeline("htp-llm").to_text())).run(ir)
    kept = {n.inputs[1].name: n.inputs[1] for n in ir.graph.nodes
            if n.op == "MatMul" and isinstance(n.inputs[1], gs.Constant) and n.inputs[1].name.endswith(".weight")}
    assert {"lm_head.weight", "model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight"} <= set(kept)
    assert {name for name, t in kept.items() if not isinstance(t._values, ExternalValues)} == set()


def test_saved_bytes_do_not_depend_on_which_weights_were_read(tmp_path):
    """A weight inlined at save (small) or written to the data file (large) gives the same
    bytes whether it is still lazy or a pass has read it."""
    model = Path(__file__).parent / "fixtures" / "genai" / "llama_fp32" / "model.onnx"
    lazy, read = load_model(model), load_model(model)
    for node in read.graph.nodes:
        for tensor in node.inputs:
            if isinstance(tensor, gs.Constant):
                assert tensor.values is not None  # loads it
    save_model(lazy, tmp_path / "lazy" / "m.onnx", external_data=True)
    save_model(read, tmp_path / "read" / "m.onnx", external_data=True)
    for name in ("m.onnx", "m.onnx.data"):
        assert (tmp_path / "lazy" / name).read_bytes() == (tmp_path / "read" / name).read_bytes()


def test_a_recipe_of_a_small_external_weight_keeps_its_values(tmp_path):
    """A recipe below the inlining size is still computed when saved (it was once written empty), in
    the data file or inline (the widening form is tested through ``write_float64``)."""
    from qnnpasses.ir.model import derived_from

    import onnx

    built = build(LlamaShape(layers=1, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=50, seq=8),
                  tmp_path / "built" / "model.onnx", dtype="float32", weights="random")
    src = tmp_path / "src.onnx"  # every weight external, the norms' 256 bytes too
    onnx.save(onnx.load(str(built)), str(src), save_as_external_data=True, location="src.data", size_threshold=0)
    for external in (True, False):
        ir = load_model(src)
        small = [t for t in ir.graph.tensors().values() if isinstance(t, gs.Constant)
                 and isinstance(t._values, ExternalValues) and t.name.endswith("norm.weight")]
        assert small and all(t.values.nbytes < 1024 for t in small)
        want = {t.name: np.asarray(t.values) * 2 for t in small}
        for t in small:
            t.values = derived_from(t.values, lambda v: v * 2)
            assert isinstance(t._values, DerivedValues)
        out = save_model(ir, tmp_path / str(external) / "model.onnx", external_data=external)
        saved = {t.name: t.values for t in load_model(out).graph.tensors().values() if t.name in want}
        assert all(np.array_equal(saved[k], want[k]) for k in want)


def test_constant_digests_compute_recipes_without_keeping_them(tmp_path):
    """The outlier check hashes every weight of both graphs; a rewritten weight is computed for its
    digest and let go (kept in the graph, the recipes of a 0.5 B model held 1.3 GiB more of
    the build's memory until the graph was saved)."""
    from qnnpasses.ir.model import derived_from
    from qnnpasses.llm.outliers import constant_digests

    src = build(LlamaShape(layers=1, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=50, seq=8),
                tmp_path / "src" / "model.onnx", dtype="float32", weights="random")
    lazy, eager = load_model(src), load_model(src)
    doubled = []
    for ir in (lazy, eager):
        for t in ir.graph.tensors().values():
            if isinstance(t, gs.Constant) and isinstance(t._values, ExternalValues):
                t.values = derived_from(t.values, lambda v: v * 2)
                if ir is lazy:
                    doubled.append(t)
    assert doubled and all(isinstance(t._values, DerivedValues) for t in doubled)
    for t in eager.graph.tensors().values():
        if isinstance(t, gs.Constant):
            assert t.values is not None  # computes and keeps every recipe
    assert constant_digests(lazy) == constant_digests(eager)
    assert all(isinstance(t._values, DerivedValues) for t in doubled)
