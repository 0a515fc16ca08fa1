"""Exporting the IR reuses the last export's protos: the result must stay graphsurgeon's own
export byte for byte, whatever a pass changed in place since."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

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
