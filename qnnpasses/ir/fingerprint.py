"""A structural fingerprint of a graph: did a pass change it?  Decided by the graph, not the pass.

One walk over the nodes of the graph and its subgraphs, O(nodes + edges), no serialization:
each node's identity, op, domain, name, the identity and name of every input and output
tensor, its attributes (scalars by value, arrays/tensors/graphs by identity), each graph's
inputs (name, dtype, shape) and outputs (name), opset imports, and every constant's values
object.  Reading a lazily loaded constant replaces its values object (graphsurgeon loads
on first access); that alone is no change: the loaded array is compared with what the
lazy values load to (by shape and dtype only above :data:`COMPARE_LOADED_BYTES`).  A pass
may not mutate a constant's array in place (the rollback snapshot shares it): that is the one
change a fingerprint does not see.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

from qnnpasses.ir.model import IRModel

_SCALARS = (int, float, str, bool, bytes, type(None), np.generic)
# a constant first loaded during a pass is compared with its lazy source up to this size
COMPARE_LOADED_BYTES = 1 << 20


@dataclass(frozen=True)
class Fingerprint:
    """``structure`` ignores node order (a pure reorder changes no computation); ``order`` is it;
    ``values`` holds each constant's values object (id(constant) -> values)."""

    structure: tuple
    order: tuple
    values: dict[int, Any] = field(compare=False, hash=False, repr=False)
    #: the nodes, held so that no object the fingerprint names by identity is freed and its
    #: address reused by another while the fingerprint is kept (``IRModel.checked``)
    nodes: tuple = field(default=(), compare=False, hash=False, repr=False)

    def node_keys(self) -> list[tuple[str, str]]:
        """``(name, op)`` of every node, graph by graph, in node order."""
        keys = []
        for (_, _, _, _, nodes, _), order in zip(self.structure[0], self.order):
            keys += [(nodes[key][2], nodes[key][0]) for key in order]
        return keys

    def same_graph(self, after: Fingerprint) -> bool:
        """True when ``after`` (taken later) shows the same computation, node order aside."""
        if self.structure != after.structure:
            return False
        for key, now in after.values.items():
            then = self.values.get(key)
            if then is now:
                continue
            if not (isinstance(then, LazyValues) and isinstance(now, np.ndarray) and _loaded_equal(then, now)):
                return False
        return True


def fingerprint(ir: IRModel) -> Fingerprint:
    # the walk allocates one small tuple per node and tensor: a cyclic GC pass over the whole
    # graph in the middle of it would cost more than the walk itself
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _fingerprint(ir)
    finally:
        if enabled:
            gc.enable()


def _fingerprint(ir: IRModel) -> Fingerprint:
    graphs, order, values, held = [], [], {}, []

    def tensor_key(tensor: gs.Tensor) -> tuple:
        if isinstance(tensor, gs.Constant):
            values[id(tensor)] = tensor._values
        return id(tensor), tensor.name

    def attr_key(value: Any) -> Any:
        if isinstance(value, _SCALARS):
            return value
        if isinstance(value, (list, tuple)) and all(isinstance(v, _SCALARS) for v in value):
            return tuple(value)
        # arrays, tensors, graphs: by identity, the object held (a constant's by its values)
        values[id(value)] = value._values if isinstance(value, gs.Constant) else value
        return id(value)

    for graph in ir.graphs():
        # keyed by identity: equal when the same nodes hold the same fields, whatever their
        # order, without hashing every node's fields as a set of tuples would
        nodes = {
            id(n): (n.op, n.domain, n.name, tuple(map(tensor_key, n.inputs)), tuple(map(tensor_key, n.outputs)),
                    tuple((k, attr_key(v)) for k, v in n.attrs.items()) if n.attrs else ())
            for n in graph.nodes
        }
        # outputs by identity and name: their dtype/shape follow from the nodes (and the
        # manager's shape refresh rewrites them); inputs' dtype and shape are the interface
        io = (tuple((t.name, id(t), str(t.dtype), tuple(t.shape) if t.shape is not None else None)
                    for t in graph.inputs), tuple((t.name, id(t)) for t in graph.outputs))
        graphs.append((id(graph), graph.name, graph.opset, len(graph.nodes), nodes, io))
        order.append(tuple(map(id, graph.nodes)))
        held.append(tuple(graph.nodes))
    domains = tuple((d.domain, d.version) for d in getattr(ir.graph, "import_domains", None) or ())
    return Fingerprint((tuple(graphs), domains, tuple(sorted(ir.metadata_props.items()))), tuple(order), values,
                       tuple(held))


def _loaded_equal(lazy: LazyValues, array: np.ndarray) -> bool:
    if tuple(lazy.shape) != tuple(array.shape) or np.dtype(lazy.dtype) != array.dtype:
        return False
    if array.nbytes > COMPARE_LOADED_BYTES:
        return True
    return bool(np.array_equal(lazy.load(), array, equal_nan=array.dtype.kind in "fc"))


def out_of_order(graph: gs.Graph) -> str:
    """The first node reading a tensor no earlier node produces (``""`` when topologically sorted)."""
    ready = {id(t) for t in graph.inputs}
    for node in graph.nodes:
        for tensor in node.inputs:
            if isinstance(tensor, gs.Variable) and tensor.inputs and id(tensor) not in ready and tensor.name:
                return f"node '{node.name}' ({node.op}) reads '{tensor.name}' before it is produced"
        ready.update(id(t) for t in node.outputs)
    return ""
