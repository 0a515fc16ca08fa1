"""fix-shapes: symbolic dims -> static, on tiny graphs and on the dynamic-axes fixtures."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx.parser
import pytest
from conftest import FIXTURES, fixture_inputs, fixture_outputs, requires_htp
from qnnpasses.passes.shapes.fix_shapes import FixShapes

from qnnpasses.backends.cpu import run_cpu
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import save_model
from qnnpasses.ir.shapes import (
    DEFAULT_BATCH,
    DEFAULT_PAST,
    has_static_shapes,
    is_static,
)
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.manager import PassManager, RunConfig
from qnnpasses.passmanager.spec import parse_pipeline

# the dynamic fixtures that have a static twin with the same weights (their reference data)
DYNAMIC = {name: spec for name, spec in json.loads((FIXTURES / "manifest.json").read_text())["dynamic_fixtures"].items()
           if (FIXTURES / f"{name.replace('_dyn', '')}.onnx").is_file()}
# fix-shapes options that reproduce the shapes of each dynamic fixture's reference data
REFERENCE_OPTIONS = {name: "{seq=1,past=8}" if "_kv_" in name else "" for name in DYNAMIC}

# "past_sequence_length + 1" is not a valid dim in ONNX text: written as TOTAL, renamed after parsing
KV_TEXT = """
<ir_version: 8, opset_import: ["" : 17]>
kv (int64[batch_size, sequence_length] ids, float[batch_size, TOTAL] mask,
    float[batch_size, 2, past_sequence_length, 4] past) => (float[batch_size, 2, TOTAL, 4] present,
    float[batch_size, TOTAL] mask_out)
{
    one = Constant <value = float[1] {1.0}> ()
    start = Constant <value = int64[1] {-1}> ()
    end = Constant <value = int64[1] {2147483647}> ()
    axes = Constant <value = int64[1] {2}> ()
    last = Slice (past, start, end, axes)
    present = Concat <axis = 2> (past, last)
    mask_out = Mul (mask, one)
}
"""


def _model(text: str):
    return load_model(onnx.parser.parse_model(text))


def _shape(ir, name):
    return next(t.shape for t in list(ir.graph.inputs) + list(ir.graph.outputs) if t.name == name)


def _run(ir, shapes=None, **options):
    return FixShapes(**options).run(ir, PassContext(shapes=shapes or {}))


def test_explicit_seq_wins_over_the_decode_step():
    ir = _kv()
    _run(ir, seq=4)
    assert _shape(ir, "ids") == [DEFAULT_BATCH, 4]


def _kv():
    proto = onnx.parser.parse_model(KV_TEXT)
    for vi in list(proto.graph.input) + list(proto.graph.output):
        for dim in vi.type.tensor_type.shape.dim:
            if dim.dim_param == "TOTAL":
                dim.dim_param = "past_sequence_length + 1"
    return load_model(proto)


def test_defaults_follow_resolve_dim_and_evaluate_past_plus_one():
    ir = _kv()
    result = _run(ir)
    assert result.changed
    # the mask is 'past_sequence_length + 1': the export is a one-token decode step
    assert _shape(ir, "ids") == [DEFAULT_BATCH, 1]
    assert _shape(ir, "past") == [DEFAULT_BATCH, 2, DEFAULT_PAST, 4]
    assert _shape(ir, "mask") == [DEFAULT_BATCH, DEFAULT_PAST + 1]
    assert _shape(ir, "present") == [DEFAULT_BATCH, 2, DEFAULT_PAST + 1, 4]
    assert _shape(ir, "mask_out") == [DEFAULT_BATCH, DEFAULT_PAST + 1]
    assert result.stats["dims_fixed"] == 6 and result.stats["output_dims_fixed"] == 4
    assert has_static_shapes(ir.graph)


def test_options_set_batch_seq_past():
    ir = _kv()
    _run(ir, batch=2, seq=1, past=8)
    assert _shape(ir, "ids") == [2, 1]
    assert _shape(ir, "mask") == [2, 9]
    assert _shape(ir, "present") == [2, 2, 9, 4]


def test_requested_shape_binds_symbols_on_every_input_and_output():
    ir = _kv()
    result = _run(ir, shapes={"past": [3, 2, 5, 4]})
    assert _shape(ir, "ids") == [3, 1]  # batch_size bound by 'past'; one decode step
    assert _shape(ir, "mask") == [3, 6]  # past_sequence_length + 1 with past_sequence_length = 5
    assert _shape(ir, "present") == [3, 2, 6, 4]
    assert "past_sequence_length=5" in result.stats["symbols"]


@pytest.mark.parametrize("shapes, message", [
    ({"nope": [1, 2]}, "unknown inputs"),
    ({"past": [1, 2, 5]}, "rank"),
    ({"past": [1, 3, 5, 4]}, "dim 1 is 2"),
    ({"ids": [2, 4], "mask": [3, 5]}, "batch_size"),
])
def test_contradicting_requests_are_errors(shapes, message):
    with pytest.raises(ValueError, match=message):
        _run(_kv(), shapes=shapes)


def test_static_model_is_unchanged():
    ir = _model("""<ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 4] x) => (float[1, 4] y) { y = Relu(x) }""")
    assert not _run(ir).changed


def test_unnamed_dims_use_position():
    ir = _model("""<ir_version: 8, opset_import: ["" : 17]>
        g (float[?, ?, 4] x) => (float[?, ?, 4] y) { y = Relu(x) }""")
    _run(ir, batch=3, seq=7)
    assert _shape(ir, "x") == [3, 7, 4] and _shape(ir, "y") == [3, 7, 4]


# --------------------------------------------------------------------------- dynamic fixtures


def _fix_and_simplify(name: str, fix: str = "", shapes=None):
    ir = load_model(FIXTURES / f"{name}.onnx")
    spec = f"fix-shapes{fix or REFERENCE_OPTIONS[name]},simplify"
    result = PassManager(parse_pipeline(spec), RunConfig(strict=True), context=PassContext(shapes=shapes or {})).run(ir)
    return ir, result


@pytest.mark.parametrize("name", sorted(DYNAMIC))
def test_dynamic_fixture_becomes_static_and_matches_reference(name):
    ir, result = _fix_and_simplify(name)
    assert all(r.status == "changed" for r in result.records)
    assert has_static_shapes(ir.graph)
    tensors = [t for t in ir.graph.tensors().values() if not hasattr(t, "values")]
    assert all(t.shape is not None and all(is_static(d) for d in t.shape) for t in tensors)
    ops = {n.op for n in ir.graph.nodes}
    assert not ops & {"Shape", "ConstantOfShape", "Range", "Size", "Constant", "Identity"}
    # the static twin exported at these shapes has exactly as many nodes after simplify
    static_twin = name.replace("_dyn_", "_")
    twin = load_model(FIXTURES / f"{static_twin}.onnx")
    PassManager(parse_pipeline("simplify")).run(twin)
    assert len(ir.graph.nodes) == len(twin.graph.nodes)
    outputs = run_cpu(ir, fixture_inputs(name))
    for key, ref in fixture_outputs(name).items():
        assert np.max(np.abs(outputs[key] - ref)) <= 1e-4


def test_other_shapes_match_the_dynamic_model():
    """fix-shapes at batch 2 / sequence 8 computes what the dynamic model computes there."""
    name = "llama_gqa_dyn_ts"
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 256, (2, 8)).astype(np.int64), "attention_mask": np.ones((2, 8), np.int64)}
    feeds["attention_mask"][1, :3] = 0  # left padding
    expected = run_cpu(FIXTURES / f"{name}.onnx", feeds)
    ir, _ = _fix_and_simplify(name, shapes={"input_ids": [2, 8]})
    assert _shape(ir, "attention_mask") == [2, 8] and _shape(ir, "logits") == [2, 8, 256]
    got = run_cpu(ir, feeds)
    assert np.max(np.abs(got["logits"] - expected["logits"])) <= 1e-4


@requires_htp
def test_fixed_dynamic_export_runs_in_one_htp_partition(tmp_path):
    """Before: 8 QNN partitions and ~200 CPU nodes (dynamic shapes); after: all on HTP."""
    from qnnpasses.backends.htp import probe_placement

    name = "llama_gqa_dyn_ts"
    before = probe_placement(FIXTURES / f"{name}.onnx", fixture_inputs(name), optimize=False)
    ir, _ = _fix_and_simplify(name)
    path = save_model(ir, tmp_path / "fixed.onnx")
    after = probe_placement(path, fixture_inputs(name), optimize=False)
    assert len(before.cpu_nodes) > 100 and before.qnn_partitions > 1
    assert after.ok and after.qnn_partitions == 1 and after.cpu_nodes == []
