"""Helpers shared by the layout families (and the rotary / gathernd passes).

Generic enough for ``qnnpasses.rewrite`` one day: static shapes, optional inputs, and
emitters for the few data-movement nodes the rewrites produce (fresh names, dtype and
shape set so that later families in the same run can reason about them before the
manager re-infers shapes).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir import IRModel
from qnnpasses.pass_api import PassContext
from qnnpasses.rewrite import can_replace, constant_value, is_constant, make_node, replace_all_uses  # noqa: F401 - is_constant re-exported for the layout modules


def static_shape(tensor: gs.Tensor | None) -> tuple[int, ...] | None:
    """The tensor's shape when every dimension is a known non-negative integer."""
    if tensor is None or tensor.shape is None:
        return None
    if not all(isinstance(d, (int, np.integer)) and d >= 0 for d in tensor.shape):
        return None
    return tuple(int(d) for d in tensor.shape)


def input_value(node: gs.Node, index: int) -> np.ndarray | None:
    """The constant value of an optional input; None when absent, empty-named or not constant."""
    if index >= len(node.inputs) or not node.inputs[index].name:
        return None
    return constant_value(node.inputs[index])


def only_consumer(graph: gs.Graph, tensor: gs.Tensor) -> gs.Node | None:
    """The single node reading ``tensor`` (which must not be a graph output)."""
    if len(tensor.outputs) != 1 or tensor in graph.outputs:
        return None
    return tensor.outputs[0]


def constant(ir: IRModel, ctx: PassContext, prefix: str, value) -> gs.Constant:
    """A new initializer; unlike ``rewrite.make_constant`` it keeps 0-d values 0-d."""
    return gs.Constant(ctx.unique_name(ir, prefix), np.array(value, copy=True, order="C"))


def emit(ir: IRModel, ctx: PassContext, op: str, inputs: list[gs.Tensor], *, hint: str, dtype, shape,
         attrs: dict | None = None) -> gs.Tensor:
    """Append one node and return its output (with dtype and shape set)."""
    node = make_node(ir, ctx, op, inputs, name_hint=hint, attrs=attrs, dtype=dtype,
                     shape=list(shape) if shape is not None else None)
    return node.outputs[0]


def emit_reshape(ir: IRModel, ctx: PassContext, x: gs.Tensor, shape: Sequence[int], hint: str = "reshape") -> gs.Tensor:
    target = constant(ir, ctx, f"{hint}_shape", np.asarray(shape, dtype=np.int64))
    return emit(ir, ctx, "Reshape", [x, target], hint=hint, dtype=x.dtype, shape=shape)


def emit_transpose(ir: IRModel, ctx: PassContext, x: gs.Tensor, perm: Sequence[int], shape: Sequence[int],
                   hint: str = "transpose") -> gs.Tensor:
    return emit(ir, ctx, "Transpose", [x], hint=hint, dtype=x.dtype, shape=shape, attrs={"perm": [int(p) for p in perm]})


def emit_gather(ir: IRModel, ctx: PassContext, x: gs.Tensor, axis: int, indices: np.ndarray, shape: Sequence[int],
                hint: str = "gather") -> gs.Tensor:
    idx = constant(ir, ctx, f"{hint}_indices", np.asarray(indices, dtype=np.int64))
    return emit(ir, ctx, "Gather", [x, idx], hint=hint, dtype=x.dtype, shape=shape, attrs={"axis": int(axis)})


def emit_slice(ir: IRModel, ctx: PassContext, x: gs.Tensor, starts, ends, axes, steps, shape: Sequence[int],
               hint: str = "slice") -> gs.Tensor:
    consts = [constant(ir, ctx, f"{hint}_{k}", np.asarray(v, dtype=np.int64))
              for k, v in (("starts", starts), ("ends", ends), ("axes", axes), ("steps", steps))]
    return emit(ir, ctx, "Slice", [x, *consts], hint=hint, dtype=x.dtype, shape=shape)


def swap(tensors, old: gs.Tensor, new: gs.Tensor) -> None:
    """Replace ``old`` by ``new`` in a node's inputs or outputs (graphsurgeon rejects slice assignment)."""
    for index, tensor in enumerate(tensors):
        if tensor is old:
            tensors[index] = new


def redirect(graph: gs.Graph, old: gs.Tensor, new: gs.Tensor) -> None:
    """Make every reader of ``old`` (and the graph outputs) read ``new``.

    Like ``rewrite.replace_all_uses``, but also when ``new`` cannot take the output's name
    (a graph input, a constant or another graph output): then an Identity keeps the interface.
    """
    if can_replace(graph, old, new):
        replace_all_uses(graph, old, new)
        return
    for consumer in list(old.outputs):
        swap(consumer.inputs, old, new)
    for node in list(old.inputs):  # the old producer keeps a dead output in its slot
        swap(node.outputs, old, gs.Variable(f"{old.name}__dead"))
    graph.nodes.append(gs.Node("Identity", name=f"{old.name}_identity", inputs=[new], outputs=[old]))


def normalize_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis
