"""Cut one partition out of the model as a stand-alone ONNX model.

The sub-model holds the partition's nodes plus its own copies of the constant nodes they
read; tensors it reads from other partitions (or the model's inputs) become its graph
inputs and tensors other partitions (or the model's outputs) need become its outputs,
under their original names, so running the sub-models in plan order and passing tensors
by name reproduces the model.  Weights are not copied: the copy shares the constants'
lazily loaded values and :func:`qnnpasses.ir.model.save_model` streams them into each file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx_graphsurgeon as gs

from qnnpasses.errors import BadInputError
from qnnpasses.ir.model import IRModel, save_model
from qnnpasses.partition.graph import NodeGraph


def extract(ng: NodeGraph, node_indices: list[int], inputs: list[str], outputs: list[str]) -> IRModel:
    """An IR of the nodes ``node_indices`` (constant nodes included) with the given boundary."""
    ir = ng.ir
    graph = ir.graph.copy()
    keep = {ng.nodes[i].name for i in node_indices}
    graph.nodes = [n for n in graph.nodes if n.name in keep]
    tensors = graph.tensors()
    graph.inputs = [_boundary_tensor(ng, tensors, name) for name in inputs]
    for tensor in graph.inputs:
        tensor.inputs.clear()  # its producer lives in another partition
    graph.outputs = [_boundary_tensor(ng, tensors, name) for name in outputs]
    return dataclasses.replace(ir, graph=graph, metadata_props=dict(ir.metadata_props),
                               doc_string=f"partition of {ir.path.name if ir.path else 'a model'}")


def _boundary_tensor(ng: NodeGraph, tensors: dict[str, gs.Tensor], name: str) -> gs.Variable:
    tensor = tensors.get(name)
    if not isinstance(tensor, gs.Variable):
        raise BadInputError(f"boundary tensor '{name}' is not an activation of the model")
    known = ng.view.tensors.get(name)
    if tensor.dtype is None and known is not None:
        tensor.dtype = known.dtype
    if tensor.shape is None and known is not None and known.known:
        tensor.shape = list(known.shape)
    if tensor.dtype is None:
        raise BadInputError(f"cannot extract a partition: the dtype of boundary tensor '{name}' is unknown")
    return tensor


def save_partition(part_ir: IRModel, path: Path, *, external_data: bool | None = None) -> Path:
    return save_model(part_ir, path, external_data=external_data)
