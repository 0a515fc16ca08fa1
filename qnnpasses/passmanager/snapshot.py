"""The state of a model before a pass, restorable in place: the manager's rollback.

A :class:`Snapshot` records everything a pass can change without copying a single node or
tensor object: each graph's fields (node order, inputs, outputs, opset, ...), each node's
fields, attributes and input/output lists, each tensor's class (Variable or Constant) and
fields (name, dtype, shape, values) with its producer and consumer lists in their order,
and the model's fields.
:meth:`Snapshot.restore` writes them back into the same objects.

Why not a copy of the graph: a copy builds a new object for every node and tensor, and the
manager takes one before every pass after a change, though it is needed only when a pass
fails, which is rare.  Recording the objects' state costs a few shallow dict and list copies
per node and tensor (about a third of a copy), and a restore leaves every object where it
was, so references held outside the graph stay valid.

Shared, not copied (as a copy shares them): constant arrays and attribute values.  A pass
may not mutate them in place; it replaces them (the fingerprint's rule too).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import onnx_graphsurgeon as gs

from qnnpasses.ir.model import IRModel


@dataclass
class Snapshot:
    model: dict
    graphs: list[tuple[gs.Graph, dict]]
    nodes: list[tuple[gs.Node, dict, list, list]]
    tensors: list[tuple[gs.Tensor, type, dict, list, list]]

    @classmethod
    def take(cls, ir: IRModel) -> Snapshot:
        model = {name: getattr(ir, name) for name in ir.__dataclass_fields__}
        model["metadata_props"] = dict(ir.metadata_props)
        graphs, nodes, tensors = [], [], []
        seen: set[int] = set()

        def keep(tensor: gs.Tensor) -> None:
            if id(tensor) in seen:
                return
            seen.add(id(tensor))
            state = dict(tensor.__dict__)
            if type(state.get("shape")) is list:
                state["shape"] = list(state["shape"])
            # the class too: graphsurgeon's to_constant()/to_variable() change it in place
            tensors.append((tensor, type(tensor), state, list(tensor.inputs), list(tensor.outputs)))

        for graph in ir.graphs():
            state = dict(graph.__dict__)
            state["nodes"], state["inputs"], state["outputs"] = list(graph.nodes), list(graph.inputs), list(graph.outputs)
            # opset imports are small objects a pass may edit in place (raising a version)
            state["import_domains"] = copy.deepcopy(graph.import_domains)
            state["_functions"] = list(state.get("_functions") or [])
            graphs.append((graph, state))
            for tensor in graph.inputs:
                keep(tensor)
            for tensor in graph.outputs:
                keep(tensor)
            for node in graph.nodes:
                state = dict(node.__dict__)
                state["attrs"] = type(node.attrs)(node.attrs)
                nodes.append((node, state, list(node.inputs), list(node.outputs)))
                for tensor in node.inputs:
                    keep(tensor)
                for tensor in node.outputs:
                    keep(tensor)
        return cls(model, graphs, nodes, tensors)

    def restore(self, ir: IRModel) -> None:
        """Put ``ir`` and every object the snapshot saw back into the recorded state.

        The lists are filled with ``list`` methods: graphsurgeon's synchronized lists would
        otherwise edit the other side of each edge again.  A snapshot can be restored more
        than once (its own lists are copied, never handed to the graph)."""
        for tensor, cls, state, producers, consumers in self.tensors:
            tensor.__class__ = cls
            _set_state(tensor, state, {"inputs": producers, "outputs": consumers})
        for node, state, inputs, outputs in self.nodes:
            _set_state(node, state, {"inputs": inputs, "outputs": outputs})
            node.attrs = type(state["attrs"])(state["attrs"])
        for graph, state in self.graphs:
            graph.__dict__.clear()
            graph.__dict__.update(state)
            for name in ("nodes", "inputs", "outputs", "_functions"):
                graph.__dict__[name] = list(state[name])
            graph.import_domains = copy.deepcopy(state["import_domains"])
        for name, value in self.model.items():
            setattr(ir, name, dict(value) if name == "metadata_props" else value)


def _set_state(obj, state: dict, edges: dict[str, list]) -> None:
    """``obj``'s fields as recorded, its synchronized edge lists holding ``edges`` again."""
    obj.__dict__.clear()
    obj.__dict__.update(state)
    if "shape" in state and type(state["shape"]) is list:
        obj.__dict__["shape"] = list(state["shape"])
    for name, members in edges.items():
        synced = state[name]  # the object's own synchronized list, whatever the pass did to it
        list.clear(synced)
        list.extend(synced, members)
