"""Reading a graphsurgeon graph: producers, walks, constant values, static shapes, axes.

One set of read-only helpers for everything that looks at a graph (role finding, the
attention recognizer, passes, lint).  Nothing here mutates a graph or a constant array.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable, Container, Iterable, Iterator, Sequence

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.model import DerivedValues, leading_rows

#: Ops whose inputs after the first are shapes, indices, axes or sizes: only input 0 carries data
#: (a walk along a tensor's values follows input 0 of these and every input of other ops).
DATA_FIRST_OPS = frozenset({"Reshape", "Expand", "Unsqueeze", "Squeeze", "Slice", "Transpose", "Tile", "Gather",
                            "Cast", "Flatten", "Pad", "Identity", "Split", "GatherElements", "GatherND"})


def producer(tensor: gs.Tensor) -> gs.Node | None:
    """The node that computes ``tensor`` (None for graph inputs and constants)."""
    return tensor.inputs[0] if tensor.inputs else None


def producer_op(tensor: gs.Tensor, op: str | Sequence[str]) -> gs.Node | None:
    """The producer of ``tensor`` if its op type is ``op`` (or one of them)."""
    node = producer(tensor)
    ops = (op,) if isinstance(op, str) else tuple(op)
    return node if node is not None and node.op in ops else None


def is_graph_output(graph: gs.Graph, tensor: gs.Tensor) -> bool:
    """``tensor in graph.outputs``, told as graphsurgeon tells it (tensors are equal by name), by
    comparing names in C rather than calling a Python ``__eq__`` per output: a KV-cache decoder
    has two outputs per layer and passes ask this of most tensors, which made the question grow
    with the square of the layers."""
    return tensor.name in map(_NAME, graph.outputs)


def is_graph_input(graph: gs.Graph, tensor: gs.Tensor) -> bool:
    """``tensor in graph.inputs``, as :func:`is_graph_output` tells it (two past inputs per layer)."""
    return tensor.name in map(_NAME, graph.inputs)


_NAME = operator.attrgetter("name")


def single_consumer(tensor: gs.Tensor, graph: gs.Graph | None = None) -> gs.Node | None:
    """The only node reading ``tensor``, if exactly one does and it is not a graph output."""
    if len(tensor.outputs) != 1:
        return None
    if graph is not None and is_graph_output(graph, tensor):
        return None
    return tensor.outputs[0]


def walk(start: Iterable[gs.Tensor], step: Callable[[gs.Tensor], Iterable[gs.Tensor]],
         limit: int | None = None) -> Iterator[tuple[gs.Tensor, int]]:
    """Breadth-first from ``start``: every tensor once, with its depth, at most ``limit`` steps out;
    ``step`` gives the tensors one step on (forward: the outputs of a tensor's readers; backward:
    its producer's inputs).  The caller stops where it has found what it looks for."""
    seen, queue = set(), deque((t, 0) for t in start)
    while queue:
        tensor, depth = queue.popleft()
        if id(tensor) in seen or (limit is not None and depth > limit):
            continue
        seen.add(id(tensor))
        yield tensor, depth
        queue.extend((t, depth + 1) for t in step(tensor) if t is not None)


def readers_outputs(tensor: gs.Tensor, skip: Container[str] = ()) -> list[gs.Tensor]:
    """A forward :func:`walk` step: the outputs of the nodes reading ``tensor`` (ops in ``skip`` not followed)."""
    return [out for node in tensor.outputs if node.op not in skip for out in node.outputs]


def producer_inputs(tensor: gs.Tensor, skip: Container[str] = ()) -> list[gs.Tensor]:
    """A backward :func:`walk` step: the computed (non-constant) inputs of ``tensor``'s producer
    (none when its op is in ``skip``)."""
    node = producer(tensor)
    if node is None or node.op in skip:
        return []
    return [t for t in node.inputs if t.name and not isinstance(t, gs.Constant)]


def constant_value(tensor: gs.Tensor | None, *, through_identity: bool = False) -> np.ndarray | None:
    """The value of a tensor known at rewrite time: an initializer or a Constant node's output.

    With ``through_identity`` it also looks through chains of Identity nodes (the TorchScript
    exporter shares equal initializers, e.g. every freshly initialized norm weight, via Identity).
    """
    if through_identity:
        for _ in range(8):
            node = producer(tensor) if tensor is not None else None
            if node is None or node.op != "Identity":
                break
            tensor = node.inputs[0]
    if tensor is None:
        return None
    if isinstance(tensor, gs.Constant):
        if isinstance(tensor._values, DerivedValues):
            return tensor._values.load()  # a recipe: computed on demand, never cached in the graph
        return np.asarray(tensor.values)
    node = producer(tensor)
    if node is not None and node.op == "Constant" and not node.inputs:
        value = node.attrs.get("value")
        if isinstance(value, gs.Constant):
            return np.asarray(value.values)
        for key, dtype in (("value_float", np.float32), ("value_int", np.int64)):
            if key in node.attrs:
                return np.asarray(node.attrs[key], dtype=dtype)
        for key, dtype in (("value_floats", np.float32), ("value_ints", np.int64)):
            if key in node.attrs:
                return np.asarray(node.attrs[key], dtype=dtype)
    return None


def stored_values(tensor: gs.Tensor) -> np.ndarray | DerivedValues | None:
    """A constant's recipe as it is (not computed), else its value (:func:`constant_value`)."""
    if isinstance(tensor, gs.Constant) and isinstance(tensor._values, DerivedValues):
        return tensor._values
    return constant_value(tensor)


def constant_rows(tensor: gs.Constant, rows: int) -> np.ndarray:
    """The first ``rows`` rows (first axis) of a constant's value; of a stacked recipe
    (``[W; 1]`` over a mapped ``W``) taken from its first part, without computing the rest."""
    return leading_rows(stored_values(tensor), rows)


def constant_shape(tensor: gs.Tensor | None) -> tuple[int, ...] | None:
    """The shape of a constant's value without reading it (a mapped or derived weight stays unread)."""
    if isinstance(tensor, gs.Constant):
        return tuple(tensor.shape)
    value = constant_value(tensor)
    return None if value is None else value.shape


def is_constant(tensor: gs.Tensor | None, *, through_identity: bool = False) -> bool:
    """Whether ``tensor``'s value is known at rewrite time, without reading that value (with
    ``through_identity`` also an Identity chain of one: TorchScript shares equal weights so)."""
    for _ in range(8 if through_identity else 1):
        if isinstance(tensor, gs.Constant):
            return True
        node = producer(tensor) if tensor is not None else None
        if node is not None and node.op == "Identity" and through_identity:
            tensor = node.inputs[0]
            continue
        return node is not None and node.op == "Constant" and not node.inputs and constant_value(tensor) is not None
    return False


def is_one_element(tensor: gs.Tensor | None) -> bool:
    """A constant of exactly one element (a scalar or ``[1]``, ``[1, 1]``...; its value is not read)."""
    shape = constant_shape(tensor)
    return shape is not None and int(np.prod(shape, dtype=np.int64)) == 1


def is_scalar_constant(tensor: gs.Tensor | None, expected: float | None = None, rtol: float = 1e-6) -> bool:
    """True when ``tensor`` is a constant with a single distinct value (equal to ``expected`` if given)."""
    value = constant_value(tensor)
    if value is None or value.size == 0:
        return False
    flat = value.ravel()
    if not np.all(flat == flat[0]):
        return False
    return expected is None or bool(np.isclose(float(flat[0]), expected, rtol=rtol, atol=0.0))


def scalar(tensor: gs.Tensor | None, *, through_identity: bool = False) -> float | None:
    """The single value of a constant (all its elements equal), else None."""
    value = constant_value(tensor, through_identity=through_identity)
    if value is None or value.size == 0 or not np.all(value.ravel() == value.ravel()[0]):
        return None
    return float(value.ravel()[0])


def last_axis(axis: int, rank: int | None) -> bool:
    """True when ``axis`` names the last dimension of a tensor of ``rank``."""
    if rank is None:
        return axis == -1
    return axis in (-1, rank - 1)


def numpy_dtype(tensor: gs.Tensor | None) -> np.dtype | None:
    """The tensor's element type as numpy's, or None: unknown, or an ONNX type numpy lacks
    (bfloat16, float8 stay ONNX enum values in the graph)."""
    dtype = getattr(tensor, "dtype", None)
    if dtype is None or isinstance(dtype, int):
        return None
    try:
        return np.dtype(dtype)
    except TypeError:
        return None


def static_shape(tensor: gs.Tensor | None) -> tuple[int, ...] | None:
    """The tensor's shape when every dimension is a known non-negative integer."""
    shape = None if tensor is None else tensor.shape
    if shape is None:
        return None
    dims = []
    for d in shape:
        if not isinstance(d, (int, np.integer)) or d < 0:
            return None
        dims.append(int(d))
    return tuple(dims)


def input_value(node: gs.Node, index: int) -> np.ndarray | None:
    """The constant value of an optional input; None when absent, empty-named or not constant."""
    if index >= len(node.inputs) or not node.inputs[index].name:
        return None
    return constant_value(node.inputs[index])


def normalize_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis
