"""Who makes and who reads each tensor of a QDQ ``ModelProto``, for the rewrites that work on the
quantizer's output itself (:mod:`qnnpasses.quant.split_operand`, :mod:`qnnpasses.quant.norm_rounding`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import onnx


@dataclass
class ProtoIndex:
    """``inits`` by name, the ``producer`` and the ``readers`` of each tensor, the graph's ``outputs``."""

    inits: dict[str, onnx.TensorProto]
    producer: dict[str, onnx.NodeProto]
    readers: dict[str, list[onnx.NodeProto]]
    outputs: set[str]

    def only(self, tensor: str, op_type: str) -> onnx.NodeProto | None:
        """The one node reading ``tensor``, when there is exactly one and it is an ``op_type``."""
        nodes = self.readers.get(tensor, [])
        return nodes[0] if len(nodes) == 1 and nodes[0].op_type == op_type else None


def index_graph(graph: onnx.GraphProto) -> ProtoIndex:
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            readers[name].append(node)
    return ProtoIndex({i.name: i for i in graph.initializer}, {o: n for n in graph.node for o in n.output},
                      readers, {o.name for o in graph.output})
