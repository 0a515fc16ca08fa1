"""qnnpasses.passmanager.snapshot: whatever a pass did to the graph, a restore undoes it exactly."""

from __future__ import annotations

import numpy as np
import onnx.parser
import onnx_graphsurgeon as gs
import pytest
from conftest import FIXTURE_NAMES, fixture_path

from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import to_model_bytes
from qnnpasses.passmanager.snapshot import Snapshot

NAMES = [n for n in FIXTURE_NAMES if n.endswith("_ts")][:2] + [n for n in FIXTURE_NAMES if n.endswith("_dynamo")][:1]


def _edges(ir) -> list:
    """Every object's identity and its edge lists, in order: what a byte-identical export can miss."""
    out = []
    for graph in ir.graphs():
        for node in graph.nodes:
            out.append((id(node), [id(t) for t in node.inputs], [id(t) for t in node.outputs]))
            for tensor in list(node.inputs) + list(node.outputs):
                out.append((id(tensor), [id(n) for n in tensor.inputs], [id(n) for n in tensor.outputs]))
        out.append(([id(t) for t in graph.inputs], [id(t) for t in graph.outputs]))
    return out


def _vandalize(ir) -> None:
    """Everything a pass may do, at once: rewire, delete, insert, rename, retype, reshape,
    replace constant values and attributes, edit the interface, opset and metadata."""
    graph = ir.graph
    first, middle = graph.nodes[0], graph.nodes[len(graph.nodes) // 2]
    middle.inputs[0] = first.outputs[0]
    middle.attrs["vandal"] = 1
    middle.op, middle.name = "Identity", "renamed_node"
    graph.nodes.remove(graph.nodes[1])
    extra = gs.Variable("extra", np.float32, [1])
    graph.nodes.append(gs.Node("Relu", inputs=[first.outputs[0]], outputs=[extra]))
    graph.outputs.append(extra)
    graph.inputs[0].shape = [7, 7]
    graph.inputs[0].dtype = np.float16
    first.outputs[0].name = "renamed_tensor"
    constant = next(t for n in graph.nodes for t in n.inputs if isinstance(t, gs.Constant))
    constant.values = np.zeros((1,), np.float32)
    variable = next(t for n in graph.nodes[2:] for t in n.outputs if isinstance(t, gs.Variable))
    variable.to_constant(np.ones((2,), np.float32))  # graphsurgeon changes the class in place
    graph.import_domains[0].version += 1
    graph.opset += 1
    ir.metadata_props["vandal"] = "yes"
    graph.nodes.reverse()
    graph.cleanup()


@pytest.mark.parametrize("name", NAMES)
def test_restore_undoes_everything_in_place(name):
    ir = load_model(fixture_path(name))
    before, edges, graph = to_model_bytes(ir), _edges(ir), ir.graph
    snapshot = Snapshot.take(ir)
    _vandalize(ir)
    assert to_model_bytes(ir) != before
    snapshot.restore(ir)
    assert ir.graph is graph  # the same objects, not a copy
    assert to_model_bytes(ir) == before
    assert _edges(ir) == edges
    _vandalize(ir)  # a snapshot can be restored again
    snapshot.restore(ir)
    assert to_model_bytes(ir) == before and _edges(ir) == edges


def test_restore_covers_subgraphs_and_a_replaced_graph():
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 17]>
        g (bool c, float[2] x) => (float[2] y) {
            y = If (c) <then_branch = t () => (float[2] a) { a = Relu(x) },
                        else_branch = e () => (float[2] b) { b = Neg(x) }>
        }""")
    ir = load_model(model)
    before = to_model_bytes(ir)
    snapshot = Snapshot.take(ir)
    then_branch = ir.graph.nodes[0].attrs["then_branch"]
    then_branch.nodes[0].op = "Sigmoid"
    ir.graph.nodes[0].attrs["else_branch"] = then_branch
    ir.graph = gs.Graph(nodes=[], inputs=[], outputs=[], opset=17)
    snapshot.restore(ir)
    assert to_model_bytes(ir) == before
