"""gathernd: constant-index GatherND becomes Reshape/Slice/Gather; the dynamo fixtures then run fully on HTP."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from conftest import FIXTURE_NAMES, requires_htp
from onnx import TensorProto, helper
from test_pass_layout import (
    assert_same_outputs,
    max_abs_vs_reference,
    op_counts,
    run_passes,
    simplified_fixture,
    tiny_model,
)

from qnnpasses.ir.model import save_model

DYNAMO = [n for n in FIXTURE_NAMES if n.endswith("_dynamo")]


def _gathernd(shape, indices, batch_dims=0, out_shape=None):
    node = helper.make_node("GatherND", ["x", "i"], ["g"], batch_dims=batch_dims)
    relu = helper.make_node("Relu", ["g"], ["y"])
    return tiny_model([node, relu], [("x", list(shape))], [("y", out_shape)], {"i": np.asarray(indices, dtype=np.int64)})


def test_padding_mask_gathernd_becomes_a_reshape():
    """dynamo: Cast(attention_mask) -> GatherND(indices[1,1,1,S,2] = (0, j))."""
    indices = np.stack([np.zeros(16, np.int64), np.arange(16)], -1).reshape(1, 1, 1, 16, 2)
    model = _gathernd((1, 16), indices, out_shape=[1, 1, 1, 16])
    ir, records = run_passes(model, "gathernd")
    assert records["gathernd"].stats == {"rewritten": 1, "to_reshape": 1}
    assert op_counts(ir) == Counter({"Reshape": 1, "Relu": 1})
    assert_same_outputs(model, ir)


def test_strided_pick_becomes_a_slice():
    indices = np.arange(0, 8, 2).reshape(4, 1)
    ir, records = run_passes(model := _gathernd((8, 3), indices, out_shape=[4, 3]), "gathernd")
    assert records["gathernd"].stats["to_slice"] == 1 and op_counts(ir) == Counter({"Slice": 1, "Relu": 1})
    assert_same_outputs(model, ir)


@pytest.mark.parametrize("batch_dims", [0, 1])
@pytest.mark.parametrize("seed", range(4))
def test_arbitrary_constant_indices_are_exact(batch_dims, seed):
    rng = np.random.default_rng(seed)
    shape = (2, 3, 4, 5)
    k = 2
    lead = (2,) if batch_dims else ()
    points = lead + (3, 2)
    indices = np.stack([rng.integers(-shape[batch_dims + a], shape[batch_dims + a], points) for a in range(k)], -1)
    model = _gathernd(shape, indices, batch_dims, out_shape=list(points + shape[batch_dims + k:]))
    ir, records = run_passes(model, "gathernd")
    assert records["gathernd"].stats["rewritten"] == 1 and "GatherND" not in op_counts(ir)
    assert set(op_counts(ir)) <= {"Reshape", "Gather", "Slice", "Relu"}
    assert_same_outputs(model, ir)


def test_variable_indices_are_kept_with_a_reason():
    node = helper.make_node("GatherND", ["x", "i"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4]),
                                            helper.make_tensor_value_info("i", TensorProto.INT64, [2, 1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    ir, records = run_passes(model, "gathernd")
    assert records["gathernd"].stats == {"rewritten": 0} and "GatherND" in op_counts(ir)
    assert any("not a constant" in n for n in records["gathernd"].notes)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_gathernd_on_fixture(name):
    ir, records = run_passes(simplified_fixture(name), "gathernd")
    if name in DYNAMO:
        assert records["gathernd"].stats == {"rewritten": 1, "to_reshape": 1}
    else:  # only dynamo writes a GatherND: the pass has nothing to match and is not run
        assert (records["gathernd"].status, records["gathernd"].reason) == ("unchanged", "no GatherND in the graph")
    assert "GatherND" not in op_counts(ir)
    if name in DYNAMO:
        assert max_abs_vs_reference(ir, name) <= 1e-4


@requires_htp
@pytest.mark.parametrize("name", DYNAMO)
def test_dynamo_fixture_runs_without_cpu_fallback(name, tmp_path):
    from qnnpasses.backends.htp import probe_placement

    ir, _ = run_passes(simplified_fixture(name), "gathernd")
    placement = probe_placement(save_model(ir, tmp_path / "model.onnx"))
    assert placement.ok, placement.error
    assert placement.cpu_nodes == [] and placement.qnn_partitions == 1
