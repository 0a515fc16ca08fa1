"""Exporting the IR reuses the last export's protos: the result must stay graphsurgeon's own
export byte for byte, whatever a pass changed in place since."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from qnnpasses.ir import checks
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import export_with_stubs

MODEL = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 3] x) => (float[3, 2] y) {
  a = LeakyRelu<alpha = 0.5>(x)
  b = Transpose<perm = [1, 0]>(a)
  c = Relu(b)
  y = Identity(c)
}
"""


def _graphsurgeon_bytes(ir, value_infos: bool) -> bytes:
    graph = gs.export_onnx(ir.graph, do_type_check=False).graph
    if not value_infos:
        graph.ClearField("value_info")
    return graph.SerializeToString()


def _ours_bytes(ir, value_infos: bool) -> bytes:
    return export_with_stubs(ir, value_infos=value_infos)[0].graph.SerializeToString()


def _node(ir, op: str) -> gs.Node:
    return next(n for n in ir.graph.nodes if n.op == op)


def _set(ir, op: str, attr: str, value) -> None:
    _node(ir, op).attrs[attr] = value


def _append(ir, op: str, attr: str, value) -> None:
    _node(ir, op).attrs[attr].append(value)


def _rename(ir, old: str, new: str) -> None:
    next(t for t in ir.graph.tensors().values() if t.name == old).name = new


def _reshape(ir, name: str, shape) -> None:
    ir.graph.tensors()[name].shape = shape


def _retype(ir, name: str, dtype) -> None:
    ir.graph.tensors()[name].dtype = dtype


def _set_op(ir, old: str, new: str) -> None:
    _node(ir, old).op = new


# Each edit keeps everything else equal, so only a key that misses it would reuse a stale proto.
EDITS = [
    ("float value", lambda ir: _set(ir, "LeakyRelu", "alpha", 0.25)),
    ("-0.0 after 0.0", lambda ir: (_set(ir, "LeakyRelu", "alpha", 0.0), _ours_bytes(ir, True),
                                   _set(ir, "LeakyRelu", "alpha", -0.0))),
    ("int where a float was", lambda ir: (_set(ir, "Relu", "k", 1.0), _ours_bytes(ir, True), _set(ir, "Relu", "k", 1))),
    ("bool where an int was", lambda ir: (_set(ir, "Relu", "k", 1), _ours_bytes(ir, True), _set(ir, "Relu", "k", True))),
    ("list edited in place", lambda ir: _append(ir, "Transpose", "perm", 2)),
    ("list item type", lambda ir: (_set(ir, "Relu", "k", [1, 2]), _ours_bytes(ir, True), _set(ir, "Relu", "k", [1, 2.0]))),
    ("input renamed", lambda ir: _rename(ir, "a", "a2")),
    ("op changed", lambda ir: _set_op(ir, "Relu", "Sigmoid")),
    ("node renamed", lambda ir: setattr(_node(ir, "Relu"), "name", "other")),
    ("domain set", lambda ir: setattr(_node(ir, "Relu"), "domain", "")),
    ("value info shape", lambda ir: _reshape(ir, "b", [3, "n"])),
    ("value info dim type", lambda ir: _reshape(ir, "b", [3, None])),
    ("value info dtype", lambda ir: _retype(ir, "b", np.float16)),
    ("tensor attribute", lambda ir: _set(ir, "Relu", "t", gs.Constant("t", np.ones(2, np.float32)))),
]


@pytest.mark.parametrize("value_infos", [True, False])
@pytest.mark.parametrize("edit", [e[1] for e in EDITS], ids=[e[0] for e in EDITS])
def test_export_after_an_in_place_edit_is_graphsurgeons(value_infos, edit):
    ir = load_model(onnx.parser.parse_model(MODEL))
    assert _ours_bytes(ir, value_infos) == _graphsurgeon_bytes(ir, value_infos)  # the cache is warm now
    edit(ir)
    before = _graphsurgeon_bytes(ir, value_infos)
    assert _ours_bytes(ir, value_infos) == before
    assert _ours_bytes(ir, value_infos) == before  # and again, from the cache


def test_stubs_follow_their_tensor_across_exports():
    ir = load_model(onnx.parser.parse_model(MODEL))
    weight = gs.Constant("w", np.arange(512, dtype=np.float32))  # 2 KB: a stub
    _node(ir, "Relu").inputs.append(weight)
    _, sources = export_with_stubs(ir)
    assert sources[0] is weight.values
    weight.values = np.zeros((2, 256), np.float32)
    proto, sources = export_with_stubs(ir)
    stub = next(t for t in proto.graph.initializer if t.name == "w")
    assert list(stub.dims) == [2, 256] and sources[0] is weight.values


# ---------------------------------------------------------------- what a graph check serializes


def _check_route_model(ir) -> onnx.ModelProto | str:
    """What ``check_proto`` checks for ``export_with_stubs(ir)``: stubs as inputs, onnxruntime's
    own ops moved to their domain (or the unknown operator's description)."""
    proto = checks.stubs_as_inputs(export_with_stubs(ir, value_infos=False)[0], copy=False)
    unknown, runtime = checks._unknown_operator_or_move_runtime_ops(
        proto.graph.node, {(f.domain, f.name) for f in proto.functions})
    if runtime:
        proto.opset_import.append(onnx.helper.make_opsetid(checks._RUNTIME_DOMAIN, 1))
    return unknown or proto


def _serialized_check_model(ir) -> onnx.ModelProto | str:
    data = checks._serialized_for_check(ir)
    return data if isinstance(data, str) else onnx.load_from_string(data)


@pytest.mark.parametrize("edit", [e[1] for e in EDITS], ids=[e[0] for e in EDITS])
def test_the_check_serializes_the_model_the_proto_route_checks(edit):
    ir = load_model(onnx.parser.parse_model(MODEL))
    assert _serialized_check_model(ir) == _check_route_model(ir)  # the cache is warm now
    edit(ir)
    assert _serialized_check_model(ir) == _check_route_model(ir)


SPECIAL = """
<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
g (float[2, 256] x, bool c) => (float[2, 256] y, float[2, 256] z) {
  w = Constant<value = float[256] {%s}>()
  s = SimplifiedLayerNormalization<epsilon = 0.00001>(x, w)
  z = com.microsoft.Gelu(s)
  y = If(c) <then_branch = t () => (float[2, 256] a) { a = SimplifiedLayerNormalization<epsilon = 0.00001>(x, w) },
             else_branch = e () => (float[2, 256] b) { b = Identity(s) }>
}
""" % ",".join(["1.0"] * 256)


def test_the_check_serializes_stubbed_constants_subgraphs_and_onnxruntime_ops_alike():
    # a 1 KB Constant node is stubbed (an input instead), SimplifiedLayerNormalization is onnxruntime's
    # own (moved to its domain, in the If's branch too), Gelu is a contrib op of a known domain
    proto = onnx.parser.parse_model(SPECIAL)
    ir = load_model(proto)
    expected = _check_route_model(ir)
    assert isinstance(expected, onnx.ModelProto) and "w" in [i.name for i in expected.graph.input]
    assert _serialized_check_model(ir) == expected
    assert checks.check_model(ir) is None
    _node(ir, "Gelu").domain = "some.vendor"
    assert _serialized_check_model(ir) == _check_route_model(ir) == (
        "node 'Gelu_2' uses operator 'Gelu' of unknown domain 'some.vendor'")


OUTER_WEIGHT = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[4, 512] x, bool c) => (float[4, 512] y) {
  a = Add(x, w)
  y = If(c) <then_branch = t () => (float[4, 512] u) { u = Mul(a, w) }, else_branch = e () => (float[4, 512] v) { v = Sub(a, w) }>
}
"""


def test_a_branch_reading_a_main_graph_weight_loads_and_checks_by_either_route(tmp_path):
    # graphsurgeon exports the 8 KB weight as an initializer of each branch too: stubbed there, it
    # failed the checker, and the model could not be loaded
    proto = onnx.parser.parse_model(OUTER_WEIGHT)
    proto.graph.initializer.append(onnx.numpy_helper.from_array(np.full((4, 512), 0.5, np.float32), "w"))
    ir = load_model(proto)
    assert checks.check_model(ir) is None
    assert _serialized_check_model(ir) == _check_route_model(ir)
