"""rotary-table: rotary Cos/Sin from integer positions => rows of a table, exact on CPU, exact angles on the HTP.

On the static decode graph of the random-weight KV-cache fixture (context 256, 1 new token),
as ``qnnpasses llm`` makes it before ``htp-llm``.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import fixture_path, requires_htp

from qnnpasses.backends.cpu import run_cpu
from qnnpasses.ir.load import load_model
from qnnpasses.llm import convert
from qnnpasses.ir.evaluate import subgraph_model
from qnnpasses.passes.attention.rotary_table import find_cones
from qnnpasses.passmanager.manager import PassManager, RunConfig
from qnnpasses.passmanager.spec import parse_pipeline

CONTEXT = 256


def _decode_graph(name: str = "llama_gqa_kv_dyn_ts"):
    """The fixture's static decode graph (1 new token after CONTEXT - 1 slots) before rotary-table."""
    roles = convert.export_roles(load_model(fixture_path(name)))
    ir = load_model(fixture_path(name))
    convert.lower_contrib(ir)
    stage = PassManager(parse_pipeline(convert.STATIC_CACHE_PIPELINE), RunConfig(verify=False, strict=True))
    stage.context.shapes = convert._shapes(roles, 1, CONTEXT - 1)
    stage.run(ir)
    return ir


def _feeds(ir, position: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(position)
    feeds = {}
    for t in ir.graph.inputs:
        shape, dtype = [int(d) for d in t.shape], np.dtype(t.dtype)
        if t.name == "position_ids":
            feeds[t.name] = np.full(shape, position, dtype)
        elif t.name == "input_ids":
            feeds[t.name] = rng.integers(0, 64, shape).astype(dtype)
        elif "mask" in t.name:
            feeds[t.name] = np.ones(shape, dtype)
        else:
            feeds[t.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def _rotary_table(ir, positions: int):
    return PassManager(parse_pipeline(f"rotary-table{{positions={positions}}}"),
                       RunConfig(verify=True, strict=True)).run(ir).records[0]


@pytest.mark.parametrize("name", ["llama_gqa_kv_dyn_ts", "llama_gqa_kv_dyn_dynamo"])
def test_tables_replace_the_angle_arithmetic_bit_for_bit(name):
    ir = _decode_graph(name)
    before = ir.copy()
    assert {n.op for n in ir.graph.nodes} >= {"Cos", "Sin"}
    record = _rotary_table(ir, CONTEXT)
    assert record.changed and record.stats["tables"] == 2
    assert not {n.op for n in ir.graph.nodes} & {"Cos", "Sin"}
    tables = [n.inputs[0] for n in ir.graph.nodes if n.op == "Gather" and n.inputs[1].name == "position_ids"]
    assert [t.shape[0] for t in tables] == [CONTEXT, CONTEXT]
    for position in (0, 1, 100, CONTEXT - 1):  # every output, exactly: same ops, same float type, same runtime
        feeds = _feeds(before, position)
        want, got = run_cpu(before, feeds), run_cpu(ir, feeds)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def test_without_positions_nothing_changes():
    ir = _decode_graph()
    record = PassManager(parse_pipeline("rotary-table"), RunConfig()).run(ir).records[0]
    assert not record.changed and "positions" in record.notes[0]


def test_rows_that_mix_positions_are_refused():
    """cos(cumsum(p)): row i depends on every position before it, so no table of single positions exists."""
    h = onnx.helper
    graph = h.make_graph(
        [h.make_node("Cast", ["p"], ["pf"], to=onnx.TensorProto.FLOAT),
         h.make_node("CumSum", ["pf", "axis"], ["c"]),
         h.make_node("Unsqueeze", ["c", "last"], ["u"]),
         h.make_node("Mul", ["u", "freq"], ["angle"]),
         h.make_node("Cos", ["angle"], ["cos"])],
        "g", [h.make_tensor_value_info("p", onnx.TensorProto.INT64, [1, 4])],
        [h.make_tensor_value_info("cos", onnx.TensorProto.FLOAT, [1, 4, 2])],
        [h.make_tensor("axis", onnx.TensorProto.INT64, [], [1]), h.make_tensor("last", onnx.TensorProto.INT64, [1], [2]),
         h.make_tensor("freq", onnx.TensorProto.FLOAT, [2], [1.0, 0.5])])
    ir = load_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]))
    record = _rotary_table(ir, 16)
    assert not record.changed
    assert any("more than its own position" in note for note in record.notes), record.notes


@requires_htp
def test_on_the_htp_in_fp16_table_rows_keep_the_angles_that_computed_ones_lose():
    """The rotary subgraph on the HTP in fp16 against fp32 on CPU, at late positions: computed, the
    rounded angle drifts with the position; gathered, only cos/sin themselves are rounded."""
    from qnnpasses.backends.htp import htp_session

    ir = _decode_graph()
    cone = find_cones(ir.graph)[0]
    computed = subgraph_model(ir.graph, cone.nodes, [cone.positions], [n.outputs[0] for n in cone.trig]).SerializeToString()
    _rotary_table(ir, CONTEXT)
    gathers = [n for n in ir.graph.nodes if n.op == "Gather" and n.inputs[1].name == "position_ids"]
    h = onnx.helper
    table = h.make_model(h.make_graph(
        [h.make_node("Gather", ["table", "p"], ["row"], axis=0)], "t",
        [h.make_tensor_value_info("p", onnx.TensorProto.INT32, [1, 1])],
        [h.make_tensor_value_info("row", onnx.TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(np.asarray(gathers[0].inputs[0].values), "table")]),
        opset_imports=[h.make_opsetid("", 17)]).SerializeToString()
    cpu = ort.InferenceSession(computed, providers=["CPUExecutionProvider"])
    on_htp = htp_session(computed, fp16=True, disable_cpu_fallback=True)
    table_htp = htp_session(table, fp16=True, disable_cpu_fallback=True)
    name = cone.positions.name
    for position in (127, CONTEXT - 1):
        want = cpu.run(None, {name: np.full((1, 1), position, np.int64)})[0].reshape(-1)
        drift = float(np.abs(on_htp.run(None, {name: np.full((1, 1), position, np.int64)})[0].reshape(-1) - want).max())
        rounded = float(np.abs(table_htp.run(None, {"p": np.full((1, 1), position, np.int32)})[0].reshape(-1)
                               - want).max())
        assert rounded <= 5e-4, rounded  # half an fp16 step of a value in [-1, 1] (2.4e-4), with margin
        assert rounded < drift / 4, (position, rounded, drift)
