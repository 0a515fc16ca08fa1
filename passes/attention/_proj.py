"""Key/value projections behind an attention block, and mean-pooling them per head group.

From the head tensor the matcher found (``KVSide.start``, heads on ``head_axis``) the trace
goes back through the per-head region — rotary embedding (Mul/Add/Sub/Neg with operands that
broadcast over heads, Slice/Split/Concat off the head axis), casts, the ``[B, S, H, D] ->
[B, H, S, D]`` Transpose — to the *head split*: the Reshape ``[B, S, H*D] -> [B, S, H, D]``.
Before it sits the projection: ``MatMul(x, W)`` or ``Gemm`` (``transB`` too), an optional
bias ``Add``, optionally a fused QKV projection cut by ``Split``/``Slice`` on the last axis
(phi3; onnxsim also fuses separate q/k/v MatMuls into one MatMul + Split), and reshapes that
keep the last axis (GPT-2's ``[B*S, 3E] -> [B, S, 3E]``).

A trace that reaches a graph input or output (a KV cache) stops: pooling heads would change
the model's interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs
from qnnpasses.ir.attention import shape_of

from qnnpasses.passmanager.rewrite import constant_value, producer, static_shape

_PER_HEAD = frozenset({"Mul", "Add", "Sub", "Div", "Neg", "Cast", "Identity"})
_CUT = frozenset({"Slice", "Split", "Concat"})


@dataclass
class Projection:
    """Output columns ``[begin, end)`` of ``weight`` (and ``bias``) produce the heads."""

    head_split: gs.Node
    weight_node: gs.Node
    weight_index: int
    weight_rows: bool  # Gemm transB: output columns are the weight's rows
    begin: int
    end: int
    bias_node: gs.Node | None = None
    bias_index: int = 0
    bias_begin: int = 0
    bias_end: int = 0
    cutters: list[gs.Node] = field(default_factory=list)  # Split/Slice nodes on the fused output
    reshapes: list[gs.Node] = field(default_factory=list)  # reshapes on the way that keep the last axis


def find_head_split(start: gs.Tensor, head_axis: int, heads: int, graph: gs.Graph) -> gs.Node | str:
    """The unique Reshape that splits ``H*D`` into ``H`` heads, behind ``start``."""
    outputs = {id(t) for t in graph.outputs}
    found, stack, seen = {}, [(start, head_axis)], set()
    while stack:
        tensor, axis = stack.pop()
        if id(tensor) in outputs:
            return f"head tensor '{tensor.name}' is a graph output (KV cache)"
        node = producer(tensor)
        if node is None:
            return f"head tensor '{tensor.name}' is a graph input (KV cache)"
        if (id(node), axis) in seen:
            continue
        seen.add((id(node), axis))
        step = _step_back(node, axis, heads)
        if isinstance(step, str):
            return step
        if step is None:
            found[id(node)] = node
        else:
            stack.extend(step)
    if len(found) != 1:
        return f"{len(found)} head-split reshapes behind the heads (need 1)"
    return next(iter(found.values()))


def _step_back(node: gs.Node, axis: int, heads: int) -> list[tuple[gs.Tensor, int]] | None | str:
    """Where the head axis comes from before ``node``; None when ``node`` is the head split."""
    if node.op == "Reshape":
        before, after = static_shape(node.inputs[0]), static_shape(node.outputs[0])
        if (before and after and len(before) == 3 and len(after) == 4 and axis == 2 and after[:2] == before[:2]
                and after[2] == heads and after[2] * after[3] == before[2]):
            return None
        return f"Reshape '{node.name}' in the per-head path is not the [B,S,H*D] -> [B,S,H,D] head split"
    if node.op == "Transpose":
        perm = node.attrs.get("perm")
        return [(node.inputs[0], perm[axis])] if perm is not None else f"Transpose '{node.name}' without perm"
    if node.op in _PER_HEAD:
        return _per_head_inputs(node, axis, heads)
    if node.op in _CUT:
        return _cut_inputs(node, axis)
    if node.op == "MatMul" and _acts_on_last_axis(node, axis):  # rotary as MatMul(x, R) (the rotary pass)
        return [(node.inputs[0], axis)]
    return f"{node.op} '{node.name}' in the per-head path"


def _acts_on_last_axis(node: gs.Node, axis: int) -> bool:
    weight = constant_value(node.inputs[1])
    rank = len(shape_of(node.inputs[0]) or ())
    return (weight is not None and weight.ndim >= 2 and all(d == 1 for d in weight.shape[:-2])
            and axis < rank - 1)


def _per_head_inputs(node: gs.Node, axis: int, heads: int):
    """Inputs that carry the heads (others broadcast over them, like rotary cos/sin)."""
    out_rank = len(shape_of(node.outputs[0]) or ())
    carried = []
    for tensor in node.inputs:
        shape = shape_of(tensor)
        position = axis - (out_rank - len(shape)) if shape is not None else -1
        if position < 0 or shape[position] != heads:
            continue
        if constant_value(tensor) is not None:
            return f"per-head constant '{tensor.name}' of {node.op} '{node.name}'"
        carried.append((tensor, position))
    return carried


def _cut_inputs(node: gs.Node, axis: int):
    rank = len(shape_of(node.outputs[0]) or ())
    cut_axis = node.attrs.get("axis", 0)
    if not rank:
        return f"{node.op} '{node.name}' of unknown rank"
    if node.op == "Slice":
        axes = constant_value(node.inputs[3]) if len(node.inputs) > 3 else None
        if axes is None:
            return f"Slice '{node.name}' without constant axes"
        if any(int(a) % rank == axis for a in np.ravel(axes)):
            return f"Slice '{node.name}' cuts the head axis"
        return [(node.inputs[0], axis)]
    if int(cut_axis) % rank == axis:
        return f"{node.op} '{node.name}' works on the head axis"
    data = node.inputs if node.op == "Concat" else node.inputs[:1]
    return [(t, axis) for t in data if constant_value(t) is None]


def find_projection(head_split: gs.Node) -> Projection | str:
    """The weight (and bias, and fused-output cutters) behind a head-split Reshape."""
    tensor, cutters, reshapes, bias = head_split.inputs[0], [], [], None
    width = static_shape(tensor)[-1]
    begin, end = 0, width
    for _ in range(8):
        node = producer(tensor)
        if node is None:
            return "projection input is a graph input"
        if node.op in ("MatMul", "Gemm"):
            proj = _weight(node, head_split, begin, end, bias, cutters)
            if not isinstance(proj, str):
                proj.reshapes = reshapes
            return proj
        if node.op == "Add" and bias is None and _bias_index(node, static_shape(tensor)[-1]) is not None:
            bias = (node, _bias_index(node, static_shape(tensor)[-1]), begin, end)
            tensor = node.inputs[1 - bias[1]]
        elif node.op in ("Split", "Slice"):
            offset = _cut_offset(node, tensor)
            if offset is None:
                return f"{node.op} '{node.name}' on the projection output is not a constant cut of the last axis"
            if cutters:
                return "nested cuts of a fused projection"
            begin, end = begin + offset, end + offset
            cutters.append(node)
            tensor = node.inputs[0]
        elif node.op == "Reshape" and (static_shape(node.inputs[0]) or [None])[-1] == static_shape(tensor)[-1]:
            reshapes.append(node)
            tensor = node.inputs[0]
        else:
            return f"{node.op} '{node.name}' between the projection and the head split"
    return "projection not found"


def _bias_index(node: gs.Node, width: int) -> int | None:
    for index, tensor in enumerate(node.inputs):
        value = constant_value(tensor)
        if value is not None and value.shape == (width,):
            return index
    return None


def _cut_offset(node: gs.Node, output: gs.Tensor) -> int | None:
    """First column of ``output`` in ``node``'s input, when it is a constant last-axis cut."""
    rank = len(static_shape(node.inputs[0]) or ())
    if not rank:
        return None
    if node.op == "Split":
        sizes = split_sizes(node)
        if sizes is None or int(node.attrs.get("axis", 0)) % rank != rank - 1:
            return None
        index = list(node.outputs).index(output)
        return int(np.sum(np.ravel(sizes)[:index]))
    starts, axes = constant_value(node.inputs[1]), constant_value(node.inputs[3]) if len(node.inputs) > 3 else None
    steps = constant_value(node.inputs[4]) if len(node.inputs) > 4 else None
    if starts is None or axes is None or np.ravel(axes).size != 1 or int(np.ravel(axes)[0]) % rank != rank - 1:
        return None
    if steps is not None and int(np.ravel(steps)[0]) != 1:
        return None
    return int(np.ravel(starts)[0])


def split_sizes(node: gs.Node) -> np.ndarray | None:
    """A Split's output sizes: its ``split`` input or attribute, or equal chunks (``num_outputs``)."""
    if len(node.inputs) > 1 and node.inputs[1].name:
        value = constant_value(node.inputs[1])
        return None if value is None else np.ravel(value).astype(np.int64)
    if "split" in node.attrs:
        return np.asarray(node.attrs["split"], dtype=np.int64)
    width = (static_shape(node.inputs[0]) or [None])[int(node.attrs.get("axis", 0))]
    count = int(node.attrs.get("num_outputs", len(node.outputs)))
    if width is None:
        return None
    chunk = -(-width // count)
    return np.asarray([min(chunk, width - i * chunk) for i in range(count)], dtype=np.int64)


def _weight(node: gs.Node, head_split: gs.Node, begin: int, end: int, bias, cutters) -> Projection | str:
    weight = constant_value(node.inputs[1])
    if weight is None or weight.ndim != 2:
        return f"{node.op} '{node.name}' has no constant 2-D weight"
    rows = node.op == "Gemm" and bool(node.attrs.get("transB", 0))
    if node.op == "Gemm" and (node.attrs.get("transA", 0) or float(node.attrs.get("alpha", 1.0)) != 1.0):
        return f"Gemm '{node.name}' with transA or alpha"
    proj = Projection(head_split=head_split, weight_node=node, weight_index=1, weight_rows=rows, begin=begin,
                      end=end, cutters=cutters)
    if bias is not None:
        proj.bias_node, proj.bias_index, proj.bias_begin, proj.bias_end = bias
    elif node.op == "Gemm" and len(node.inputs) > 2 and constant_value(node.inputs[2]) is not None:
        if np.ravel(constant_value(node.inputs[2])).size != (weight.shape[0] if rows else weight.shape[1]):
            return f"Gemm '{node.name}' bias is not one value per output column"
        proj.bias_node, proj.bias_index, proj.bias_begin, proj.bias_end = node, 2, begin, end
    return proj
