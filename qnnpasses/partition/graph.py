"""The node DAG the partitioner works on, with the sizes and costs it needs.

Nodes are the main graph's nodes in stored (topological) order; an edge ``u -> v`` means
``v`` reads an activation ``u`` writes (subgraph captures included).  Nodes that read
only constants, directly or through other such nodes (``Constant``, shape arithmetic on
initializers, an ``Identity`` of a weight), are *constant nodes*: onnxruntime folds them
into initializers, so they take no part in placement; every partition that needs one of
their values carries its own copy of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import onnx_graphsurgeon as gs

from qnnpasses.analysis.cost import node_flops
from qnnpasses.analysis.graph import GraphView, build_view
from qnnpasses.ir.model import IRModel, const_nbytes, iter_graphs

#: Ops onnxruntime never folds even when their inputs are constant.
_NOT_FOLDED = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial"})


@dataclass
class NodeGraph:
    """The DAG over node indices plus per-node facts (bytes, FLOPs, weights, layer)."""

    ir: IRModel
    view: GraphView
    dag: nx.DiGraph                                   # over indices of non-constant nodes
    constant: set[int] = field(default_factory=set)   # indices of constant nodes
    flops: list[int] = field(default_factory=list)
    weights: list[dict[int, int]] = field(default_factory=list)  # per node: id(const) -> bytes

    @property
    def nodes(self) -> list[gs.Node]:
        return self.view.nodes

    def index_of(self) -> dict[str, int]:
        return {n.name: i for i, n in enumerate(self.nodes)}

    def tensor_bytes(self, name: str) -> int:
        tensor = self.view.tensors.get(name)
        return tensor.nbytes if tensor is not None else 0

    def producer(self, name: str) -> int | None:
        tensor = self.view.tensors.get(name)
        return tensor.producer if tensor is not None else None

    def constant_closure(self, members: set[int]) -> set[int]:
        """The constant nodes whose values ``members`` read, transitively.

        Follows node inputs, not only activations: a ``Constant`` node's output is a weight
        to the analysis view, but its node must still travel with its readers.
        """
        position = {id(node): i for i, node in enumerate(self.nodes)}
        needed: set[int] = set()
        stack = list(members)
        while stack:
            node = self.nodes[stack.pop()]
            for tensor in node.inputs:
                producer = position.get(id(tensor.inputs[0])) if isinstance(tensor, gs.Variable) and tensor.inputs else None
                if producer is not None and producer in self.constant and producer not in needed:
                    needed.add(producer)
                    stack.append(producer)
        return needed

    def weight_bytes(self, members: set[int]) -> int:
        """Bytes of the distinct stored tensors ``members`` read (shared ones counted once)."""
        seen: dict[int, int] = {}
        for index in members:
            seen.update(self.weights[index])
        return sum(seen.values())


def build_node_graph(ir: IRModel, shapes: dict[str, list[int]] | None = None) -> NodeGraph:
    view = build_view(ir, shapes)
    constant = _constant_nodes(view)
    dag = nx.DiGraph()
    dag.add_nodes_from(i for i in range(len(view.nodes)) if i not in constant)
    for consumer, names in enumerate(view.reads):
        if consumer in constant:
            continue
        for name in names:
            producer = view.tensors[name].producer
            if producer is not None and producer not in constant:
                bytes_ = view.tensors[name].nbytes
                if dag.has_edge(producer, consumer):
                    dag[producer][consumer]["bytes"] += bytes_
                else:
                    dag.add_edge(producer, consumer, bytes=bytes_)
    flops = [node_flops(node, view)[0] for node in view.nodes]
    return NodeGraph(ir, view, dag, constant, flops, [_node_weights(node) for node in view.nodes])


def _constant_nodes(view: GraphView) -> set[int]:
    """Nodes computable from constants alone, whose outputs are not graph outputs."""
    constant: set[int] = set()
    for index, node in enumerate(view.nodes):  # stored order is topological
        if _has_subgraph(node) or node.op in _NOT_FOLDED:
            continue
        producers = [view.tensors[name].producer for name in view.reads[index]]
        reads_inputs = any(view.tensors[name].graph_input for name in view.reads[index])
        if reads_inputs or any(p is None or p not in constant for p in producers):
            continue
        if any(view.tensors[name].graph_output for name in view.writes[index]):
            continue
        constant.add(index)
    return constant


def _has_subgraph(node: gs.Node) -> bool:
    return any(isinstance(v, gs.Graph) or (isinstance(v, list) and any(isinstance(x, gs.Graph) for x in v))
               for v in node.attrs.values())


def _node_weights(node: gs.Node) -> dict[int, int]:
    """Stored tensors a node reads (inputs, Constant values, subgraph initializers)."""
    found: dict[int, int] = {}
    for tensor in node.inputs:
        if isinstance(tensor, gs.Constant):
            found[id(tensor)] = const_nbytes(tensor)
    for value in node.attrs.values():
        if isinstance(value, gs.Constant):
            found[id(value)] = const_nbytes(value)
        for sub in value if isinstance(value, list) else [value]:
            if isinstance(sub, gs.Graph):
                for g in iter_graphs(sub):
                    for t in g.tensors().values():
                        if isinstance(t, gs.Constant):
                            found[id(t)] = const_nbytes(t)
    return found
