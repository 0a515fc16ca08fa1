"""qnnpasses.ir.graph_ops: the linear copy / toposort / cleanup give graphsurgeon's results."""

from __future__ import annotations

import random

import onnx.parser
import onnx_graphsurgeon as gs
import pytest
from conftest import FIXTURE_NAMES, fixture_path

from qnnpasses.ir import graph_ops
from qnnpasses.ir.load import load_model
from qnnpasses.ir.read import is_graph_input, is_graph_output

NAMES = [n for n in FIXTURE_NAMES if n.endswith("_ts")][:4] + [n for n in FIXTURE_NAMES if n.endswith("_dynamo")][:2]


def _structure(graph) -> list:
    return [(n.name, n.op, [t.name for t in n.inputs], [t.name for t in n.outputs],
             [[c.name for c in t.outputs] for t in n.inputs]) for n in graph.nodes]


@pytest.mark.parametrize("name", NAMES)
def test_same_results_as_graphsurgeon(name):
    graph = load_model(fixture_path(name)).graph
    nodes = list(graph.nodes)
    random.Random(0).shuffle(nodes)
    graph.nodes = nodes
    ours, theirs = graph_ops.copy_graph(graph), graph.copy()
    assert _structure(ours) == _structure(theirs)
    assert not {id(t) for n in ours.nodes for t in n.inputs} & {id(t) for n in graph.nodes for t in n.inputs}
    graph_ops.toposort(ours), theirs.toposort()  # shuffled: the depth-first path
    assert _structure(ours) == _structure(theirs)
    graph_ops.toposort(ours), theirs.toposort()  # sorted: the one-sweep path
    assert _structure(ours) == _structure(theirs)
    for g in (ours, theirs):  # cut the graph in the middle: the first half becomes dead code
        for node in g.nodes[len(g.nodes) // 2: len(g.nodes) // 2 + 3]:
            node.outputs.clear()
    graph_ops.cleanup(ours), theirs.cleanup(remove_unused_graph_inputs=False)
    assert _structure(ours) == _structure(theirs)
    assert [t.name for t in ours.inputs] == [t.name for t in theirs.inputs]


def test_copy_is_independent_and_shares_constant_values():
    graph = load_model(fixture_path(NAMES[0])).graph
    copy = graph_ops.copy_graph(graph)
    copy.nodes[0].outputs[0].name = "renamed"
    copy.nodes[0].attrs["extra"] = 1
    assert graph.nodes[0].outputs[0].name != "renamed" and "extra" not in graph.nodes[0].attrs
    originals = {t.name: t for n in graph.nodes for t in n.inputs if hasattr(t, "_values")}
    copies = {t.name: t for n in copy.nodes for t in n.inputs if hasattr(t, "_values")}
    assert originals and all(copies[k] is not v and copies[k]._values is v._values for k, v in originals.items())


def test_cycles_and_subgraphs_go_to_graphsurgeon():
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 17]>
        g (bool c, float[2] x) => (float[2] y) {
            y = If (c) <then_branch = t () => (float[2] a) { a = Relu(x) },
                        else_branch = e () => (float[2] b) { b = Neg(x) }>
        }""")
    graph = load_model(model).graph
    assert not graph_ops._simple(graph)
    copy = graph_ops.copy_graph(graph)
    assert [n.op for n in graph_ops.finish_graph(copy).nodes] == ["If"]


def test_graph_output_and_input_membership_is_graphsurgeons():
    # is_graph_output / is_graph_input answer `tensor in graph.outputs` / `.inputs` (tensors equal
    # by name) for every tensor of a KV-cache export, a renamed stand-in included
    ir = load_model(fixture_path("llama_gqa_kv_ts"))
    graph = ir.graph
    tensors = list(graph.tensors().values()) + [gs.Variable(graph.outputs[0].name), gs.Variable("nobody")]
    assert [is_graph_output(graph, t) for t in tensors] == [t in graph.outputs for t in tensors]
    assert [is_graph_input(graph, t) for t in tensors] == [t in graph.inputs for t in tensors]
    assert sum(is_graph_output(graph, t) for t in tensors) == len(graph.outputs) + 1
