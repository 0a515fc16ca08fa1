"""Evaluate a piece of a graph on onnxruntime's CPU: the nodes between some tensors and others.

Rewrites that replace a computed value by a table or an input (``rotary-table``, the Genie
inputs of :mod:`qnnpasses.llm.genie_io`) first compute what the original nodes give, with the
original ops in the original float type, and build their replacement from that.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

from qnnpasses.ir.graph_ops import graph_opsets

#: what onnxruntime reads for every opset an export uses (up to 22)
IR_VERSION = 10


def subgraph_model(graph: gs.Graph, nodes: Sequence[gs.Node], inputs: Sequence[gs.Variable],
                   outputs: Sequence[gs.Tensor], name: str = "subgraph") -> onnx.ModelProto:
    """A model of ``nodes`` (in the graph's topological order) from ``inputs`` to ``outputs``;
    the constants they read become its initializers."""
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    ordered = sorted(nodes, key=lambda n: order[id(n)])
    constants: dict[str, gs.Constant] = {}
    for node in ordered:
        for tensor in node.inputs:
            if isinstance(tensor, gs.Constant) and tensor.name:
                constants[tensor.name] = tensor
    model = onnx.helper.make_model(
        onnx.helper.make_graph(
            [OnnxExporter.export_node(n) for n in ordered], name,
            [onnx.helper.make_tensor_value_info(t.name, onnx.helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype)),
                                                list(t.shape)) for t in inputs],
            [onnx.ValueInfoProto(name=t.name) for t in outputs],
            # the values themselves: a lazily loaded weight would point at a file the bytes cannot name
            initializer=[onnx.numpy_helper.from_array(np.asarray(c.values), c.name) for c in constants.values()]),
        opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in graph_opsets(graph).items()])
    model.ir_version = IR_VERSION
    return model


def subgraph_session(graph: gs.Graph, nodes: Sequence[gs.Node], inputs: Sequence[gs.Variable],
                     outputs: Sequence[gs.Tensor], name: str = "subgraph"):
    """An onnxruntime CPU session of :func:`subgraph_model`."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(subgraph_model(graph, nodes, inputs, outputs, name).SerializeToString(), options,
                                providers=["CPUExecutionProvider"])
