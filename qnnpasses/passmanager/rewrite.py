"""Small helpers that rewrite passes share: finding producers and constant values,
rewiring consumers, and making constants and nodes with fresh names.

They work on onnx-graphsurgeon objects.  Nothing here mutates constant arrays.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.graph_ops import finish_graph
from qnnpasses.ir.model import IRModel, derived_from, stacked_from
from qnnpasses.ir.read import (  # noqa: F401 - the read helpers, re-exported for passes
    is_graph_input,
    is_graph_output,
    producer,
    producer_op,
    single_consumer,
    constant_value,
    constant_rows,
    constant_shape,
    is_constant,
    is_scalar_constant,
    scalar,
    last_axis,
    static_shape,
    stored_values,
    input_value,
    normalize_axis,
)
from qnnpasses.passmanager.api import PassContext


def node_key(node: gs.Node) -> tuple | None:
    """A hashable description of what ``node`` computes from its variable inputs: op, domain,
    attributes and constant input values (None when an attribute has no such description).

    Nodes with equal keys give equal outputs for equal variable inputs, so a rewrite that
    meets the same sub-graph once per layer can decide once per key.  It reads every
    constant input: meant for data-movement and sign ops, whose constants are small.
    """
    try:
        attrs = tuple(sorted((name, _attr_key(value)) for name, value in node.attrs.items()))
    except TypeError:
        return None
    inputs = tuple(None if not t.name else _value_key(constant_value(t)) if is_constant(t) else "variable"
                   for t in node.inputs)
    return node.op, node.domain or "", attrs, inputs


def _attr_key(value):
    if isinstance(value, (list, tuple)):
        return tuple(_attr_key(v) for v in value)
    if isinstance(value, float):
        return value.hex()  # tells -0.0 from 0.0
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return type(value).__name__, value
    raise TypeError(f"no key for an attribute of type {type(value).__name__}")


def _value_key(value: np.ndarray) -> tuple:
    return value.dtype.str, value.shape, value.tobytes()


def other_input(node: gs.Node, tensor: gs.Tensor) -> gs.Tensor | None:
    """For a binary node, the input that is not ``tensor``."""
    if len(node.inputs) != 2:
        return None
    if node.inputs[0] is tensor:
        return node.inputs[1]
    if node.inputs[1] is tensor:
        return node.inputs[0]
    return None


def can_replace(graph: gs.Graph, old: gs.Tensor, new: gs.Tensor) -> bool:
    """Whether :func:`replace_all_uses` may substitute ``new`` for ``old``.

    A graph output can be replaced only by a computed tensor that is not itself part
    of the interface: renaming a graph input, a constant or another output would
    change what the model exposes.
    """
    if not is_graph_output(graph, old):
        return True
    return not (isinstance(new, gs.Constant) or is_graph_input(graph, new) or is_graph_output(graph, new))


def replace_all_uses(graph: gs.Graph, old: gs.Tensor, new: gs.Tensor, *, via_identity: bool = False) -> None:
    """Make every consumer of ``old`` (and the graph outputs) read ``new`` instead.

    When ``old`` is a graph output, the output keeps its name: ``new`` takes the name
    (and ``old`` gets a fresh one) so that the model's interface does not change.
    That is impossible when ``new`` is a graph input, a constant or another output
    (see :func:`can_replace`): then, with ``via_identity``, ``old`` stays the output,
    computed by an Identity of ``new``; without it, a ValueError.
    """
    if not can_replace(graph, old, new):
        if via_identity:
            _replace_by_identity(graph, old, new)
            return
        raise ValueError(f"cannot replace graph output '{old.name}' by interface tensor '{new.name}'")
    # Subgraphs capture outer tensors by object, so rewiring consumers covers them too.
    for consumer in list(old.outputs):
        for index, tensor in enumerate(consumer.inputs):
            if tensor is old:
                consumer.inputs[index] = new  # element-wise: graphsurgeon's lists reject slice assignment
    if is_graph_output(graph, old):
        name, dtype, shape = old.name, old.dtype, old.shape
        old.name = f"{name}__replaced"
        new.name = name
        if new.dtype is None:
            new.dtype = dtype
        if new.shape is None:
            new.shape = shape
        graph.outputs = [new if t is old else t for t in graph.outputs]


def _replace_by_identity(graph: gs.Graph, old: gs.Tensor, new: gs.Tensor) -> None:
    for consumer in list(old.outputs):
        swap(consumer.inputs, old, new)
    for node in list(old.inputs):  # the old producer keeps a dead output in its slot
        swap(node.outputs, old, gs.Variable(f"{old.name}__dead"))
    graph.nodes.append(gs.Node("Identity", name=f"{old.name}_identity", inputs=[new], outputs=[old]))


def swap(tensors, old: gs.Tensor, new: gs.Tensor) -> None:
    """Replace ``old`` by ``new`` in a node's inputs or outputs (graphsurgeon rejects slice assignment)."""
    for index, tensor in enumerate(tensors):
        if tensor is old:
            tensors[index] = new


def make_constant(ir: IRModel, ctx: PassContext, prefix: str, value) -> gs.Constant:
    """A new initializer with a fresh name (0-d values stay 0-d, unlike ``np.ascontiguousarray``).

    The array is used as it is when C-contiguous (constant arrays are never mutated in place).
    """
    array = np.asarray(value)
    if not array.flags.c_contiguous:
        array = array.copy(order="C")
    return gs.Constant(ctx.unique_name(ir, prefix), array)


def derived_constant(ir: IRModel, ctx: PassContext, prefix: str, tensor: gs.Tensor, transform, *,
                     same_shape: bool = False, shape: tuple[int, ...] | None = None) -> gs.Constant:
    """A new constant ``transform(value of tensor)`` with a fresh name, computed when it is read
    (a recipe) where ``tensor`` is a mapped weight or a recipe itself, else now.

    A pass that rewrites every weight of a large model (folding, rotating, scaling) would
    otherwise hold all of them in memory until the model is written; a recipe is computed
    one tensor at a time as it is saved or run.  ``transform`` as in
    :func:`~qnnpasses.ir.model.derived_from`; ``same_shape``: it keeps the value's shape and
    dtype, so it need not run to learn them; ``shape``: the output's, for a ``transform`` that keeps
    the dtype but would allocate its output to tell its shape (a concatenation)."""
    values = stored_values(tensor)
    dtype = np.dtype(values.dtype) if same_shape else None  # a recipe knows its dtype as an array does
    return gs.Constant(ctx.unique_name(ir, prefix), derived_from(values, transform, dtype=dtype, shape=shape))


def stacked_constant(ir: IRModel, ctx: PassContext, prefix: str, tensor: gs.Tensor, *below: np.ndarray) -> gs.Constant:
    """A new constant with a fresh name: ``tensor``'s value with the arrays ``below`` stacked under
    it (first axis; ``[W; 1]``).  Kept as those parts where ``tensor`` is a mapped weight or a recipe
    (:class:`~qnnpasses.ir.model.StackedValues`: saved part by part, its first rows read from
    ``tensor``'s), else computed now."""
    return gs.Constant(ctx.unique_name(ir, prefix), stacked_from([stored_values(tensor), *below]))


def make_node(ir: IRModel, ctx: PassContext, op: str, inputs: Iterable[gs.Tensor], *, name_hint: str,
              attrs: dict | None = None, num_outputs: int = 1, dtype=None, shape=None,
              domain: str | None = None) -> gs.Node:
    """Append a node with a fresh name and fresh output tensors to the main graph."""
    outputs = [gs.Variable(ctx.unique_name(ir, f"{name_hint}_out"), dtype=dtype, shape=shape) for _ in range(num_outputs)]
    node = gs.Node(op=op, name=ctx.unique_name(ir, name_hint), attrs=attrs or {}, inputs=list(inputs), outputs=outputs,
                   domain=domain)
    ir.graph.nodes.append(node)
    return node


#: Opset from which Reduce* take ``axes`` as an input (ReduceSum: 13).
REDUCE_AXES_INPUT_OPSET = 18


def make_reduce(ir: IRModel, ctx: PassContext, op: str, x: gs.Tensor, axes: Sequence[int], hint: str) -> gs.Tensor:
    """``op(x)`` over ``axes`` with keepdims, spelled for the model's opset."""
    if ir.opset >= (13 if op == "ReduceSum" else REDUCE_AXES_INPUT_OPSET):
        axes_t = make_constant(ir, ctx, f"{hint}_axes", np.asarray(list(axes), dtype=np.int64))
        node = make_node(ir, ctx, op, [x, axes_t], name_hint=hint, attrs={"keepdims": 1}, dtype=x.dtype)
    else:
        node = make_node(ir, ctx, op, [x], name_hint=hint, attrs={"axes": list(axes), "keepdims": 1}, dtype=x.dtype)
    return node.outputs[0]


def drop_nodes(graph: gs.Graph, nodes: Iterable[gs.Node]) -> None:
    """Disconnect nodes so that ``graph.cleanup()`` removes them (call it at the end of the pass)."""
    for node in nodes:
        node.outputs.clear()
        node.inputs.clear()


def finish(ir: IRModel) -> None:
    """Remove what rewrites left unreachable and restore a topological order."""
    finish_graph(ir.graph)


# --- data-movement emitters (formerly the layout family's helpers) ---------------------


def emit(ir: IRModel, ctx: PassContext, op: str, inputs: list[gs.Tensor], *, hint: str, dtype, shape,
         attrs: dict | None = None) -> gs.Tensor:
    """Append one node and return its output (with dtype and shape set)."""
    node = make_node(ir, ctx, op, inputs, name_hint=hint, attrs=attrs, dtype=dtype,
                     shape=list(shape) if shape is not None else None)
    return node.outputs[0]


def emit_reshape(ir: IRModel, ctx: PassContext, x: gs.Tensor, shape: Sequence[int], hint: str = "reshape") -> gs.Tensor:
    target = make_constant(ir, ctx, f"{hint}_shape", np.asarray(shape, dtype=np.int64))
    return emit(ir, ctx, "Reshape", [x, target], hint=hint, dtype=x.dtype, shape=shape)


def emit_transpose(ir: IRModel, ctx: PassContext, x: gs.Tensor, perm: Sequence[int], shape: Sequence[int],
                   hint: str = "transpose") -> gs.Tensor:
    return emit(ir, ctx, "Transpose", [x], hint=hint, dtype=x.dtype, shape=shape, attrs={"perm": [int(p) for p in perm]})


def emit_gather(ir: IRModel, ctx: PassContext, x: gs.Tensor, axis: int, indices: np.ndarray, shape: Sequence[int],
                hint: str = "gather") -> gs.Tensor:
    idx = make_constant(ir, ctx, f"{hint}_indices", np.asarray(indices, dtype=np.int64))
    return emit(ir, ctx, "Gather", [x, idx], hint=hint, dtype=x.dtype, shape=shape, attrs={"axis": int(axis)})


def emit_slice(ir: IRModel, ctx: PassContext, x: gs.Tensor, starts, ends, axes, steps, shape: Sequence[int],
               hint: str = "slice") -> gs.Tensor:
    consts = [make_constant(ir, ctx, f"{hint}_{k}", np.asarray(v, dtype=np.int64))
              for k, v in (("starts", starts), ("ends", ends), ("axes", axes), ("steps", steps))]
    return emit(ir, ctx, "Slice", [x, *consts], hint=hint, dtype=x.dtype, shape=shape)


