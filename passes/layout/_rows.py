"""layout family ``rows2d``: compute row-wise regions on 2-D ``[S, H]`` instead of ``[1, S, H]``.

Why: the QNN EP maps ``MatMul(x, W)`` with a constant 2-D ``W`` to a FullyConnected,
which produces a 2-D result; for a rank-3 ``x`` it appends a Reshape back to rank 3.
In an LLM every projection reads the ``[1, S, H]`` residual stream, so each one costs
an extra HTP op.  Computing the whole stream in 2-D removes them all.

Matches: connected regions of tensors of shape ``[1, ..., 1, S, X]`` (static) linked by
row-wise nodes: elementwise ops (constants and rank<=2 operands broadcast the same
after dropping leading unit dims), last-axis reductions with keepdims, last-axis
Softmax/LayerNormalization/RMSNormalization, last-axis Slice/Split/Concat, and MatMul
with a constant weight.  Produces the same nodes on ``[S, X]`` tensors with Reshapes at
the region's entries and exits (a Reshape consumer or producer absorbs them: the
``chains`` family merges the pair), applied only when that saves more ops than it adds.
Safe because dropping leading unit dims neither reorders data nor changes broadcasting,
and every axis attribute of a region node is rewritten relative to the last axis.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.model import IRModel
from qnnpasses.ir.op_kinds import ELEMENTWISE, REDUCTIONS, RESHAPES
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.rewrite import (
    constant_shape,
    constant_value,
    emit_reshape,
    input_value,
    is_constant,
    is_graph_output,
    make_constant,
    static_shape,
    swap,
)

AXIS_ATTR = frozenset({"Softmax", "LogSoftmax", "LayerNormalization", "RMSNormalization", "Concat", "Split"})
ROW_OPS = ELEMENTWISE | AXIS_ATTR | REDUCTIONS | {"MatMul", "Slice"}


def _rowable(t: gs.Tensor) -> bool:
    """A computed ``[1, .., 1, S, X]`` tensor with static dims (the cheap rejections first)."""
    shape = t.shape
    return (shape is not None and len(shape) >= 3 and all(d == 1 for d in shape[:-2])
            and static_shape(t) is not None and not is_constant(t))


def _is_last(axis, rank: int) -> bool:
    return axis is not None and int(axis) in (-1, rank - 1)


def _default_axis(op: str, opset: int) -> int | None:
    if op in ("Softmax", "LogSoftmax"):
        return -1 if opset >= 13 else 1
    return {"Split": 0, "Concat": None}.get(op, -1)


def _row_axes_ok(node: gs.Node, rank: int, opset: int) -> bool:
    """The node's axis arguments all name the last axis (so they stay valid in 2-D)."""
    if node.op in AXIS_ATTR:
        return _is_last(node.attrs.get("axis", _default_axis(node.op, opset)), rank)
    if node.op in REDUCTIONS:
        axes = node.attrs.get("axes", input_value(node, 1))
        return node.attrs.get("keepdims", 1) == 1 and axes is not None and len(axes) == 1 and _is_last(axes[0], rank)
    if node.op == "Slice":
        axes = input_value(node, 3)
        return (all(is_constant(t) for t in node.inputs[1:] if t.name) and axes is not None
                and all(_is_last(a, rank) for a in axes))
    return True


def _side_ok(t: gs.Tensor) -> bool:
    """A non-region operand: fine when dropping leading unit dims keeps its broadcast."""
    shape = constant_shape(t) if is_constant(t) else static_shape(t)
    return shape is not None and (len(shape) <= 2 or all(d == 1 for d in shape[:-2]))


def _eligible(node: gs.Node, opset: int) -> bool:
    if node.op not in ROW_OPS or node.domain not in ("", "ai.onnx", None):
        return False
    outs = [t for t in node.outputs if t.name]
    if not outs or not all(_rowable(t) for t in outs):
        return False
    rank = len(outs[0].shape)
    data = [t for t in node.inputs if t.name and not is_constant(t)]
    if node.op == "MatMul":
        return _rowable(node.inputs[0]) and is_constant(node.inputs[1]) and _side_ok(node.inputs[1])
    if node.op == "Slice":
        return len(data) == 1 and _rowable(data[0]) and _row_axes_ok(node, rank, opset)
    if node.op in REDUCTIONS or node.op in AXIS_ATTR - {"Concat"}:
        data = data[:1]
    return _row_axes_ok(node, rank, opset) and all(_rowable(t) or _side_ok(t) for t in data) \
        and all(_side_ok(t) for t in node.inputs if t.name and is_constant(t))


def _flexible(node: gs.Node, t: gs.Tensor) -> bool:
    """A consumer outside the region that accepts the 2-D tensor with an unchanged result."""
    if node.op == "Reshape" and node.inputs[0] is t and input_value(node, 1) is not None:
        return True
    return (node.op == "MatMul" and node.inputs[0] is t and is_constant(node.inputs[1])
            and len(node.inputs[1].shape) >= max(3, len(t.shape)))  # B's batch dims alone set the result's


class _Region:
    def __init__(self, graph: gs.Graph, nodes: list[gs.Node]):
        self.graph, self.nodes = graph, nodes
        ids = {id(n) for n in nodes}
        self.inside = lambda n: id(n) in ids
        self.tensors = list({id(t): t for n in nodes for t in n.inputs + n.outputs if t.name and _rowable(t)}.values())

    def entry_cost(self, t: gs.Tensor) -> int:
        prod = t.inputs[0] if t.inputs else None
        if prod is not None and self.inside(prod):
            return 0
        return 0 if prod is not None and prod.op in RESHAPES and len(t.outputs) == 1 else 1

    def exit_cost(self, t: gs.Tensor) -> int:
        if not (t.inputs and self.inside(t.inputs[0])):
            return 0
        rigid = [c for c in t.outputs if not self.inside(c) and not _flexible(c, t)]
        return 1 if rigid or is_graph_output(self.graph, t) else 0

    def saving(self) -> int:
        """FC Reshapes saved plus boundary Reshapes that become identities, minus Reshapes added."""
        matmuls = sum(1 for n in self.nodes if n.op == "MatMul")
        identities = sum(1 for t in self.tensors for c in t.outputs
                         if c.op == "Reshape" and not self.inside(c) and _flexible(c, t)
                         and static_shape(c.outputs[0]) == tuple(t.shape[-2:]))
        identities += sum(1 for t in self.tensors if t.inputs and not self.inside(t.inputs[0])
                          and self.entry_cost(t) == 0 and static_shape(t.inputs[0].inputs[0]) == tuple(t.shape[-2:]))
        return matmuls + identities - sum(self.entry_cost(t) + self.exit_cost(t) for t in self.tensors)


def _regions(graph: gs.Graph, opset: int) -> list[list[gs.Node]]:
    parent: dict[int, int] = {}

    def find(i: int) -> int:
        while parent.setdefault(i, i) != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    nodes = [n for n in graph.nodes if _eligible(n, opset)]
    for n in nodes:
        ts = [t for t in n.inputs + n.outputs if t.name and _rowable(t)]
        for t in ts[1:]:
            parent[find(id(t))] = find(id(ts[0]))
    groups: dict[int, list[gs.Node]] = {}
    for n in nodes:
        groups.setdefault(find(id(n.outputs[0])), []).append(n)
    return list(groups.values())


def _flatten_region(ir: IRModel, ctx: PassContext, region: _Region) -> None:
    flat = {id(t): _flat_version(ir, ctx, region, t) for t in region.tensors}
    for node in region.nodes:
        for i, t in enumerate(node.inputs):
            node.inputs[i] = flat.get(id(t), t)
        _fix_node(ir, ctx, node)


def _flat_version(ir: IRModel, ctx: PassContext, region: _Region, t: gs.Tensor) -> gs.Tensor:
    """The 2-D stand-in of region tensor ``t``; ``t`` itself stays valid for readers outside."""
    shape2d = list(t.shape[-2:])
    producer = t.inputs[0] if t.inputs else None
    if producer is None or not region.inside(producer):  # an entry: reshape what comes in
        return emit_reshape(ir, ctx, t, shape2d, hint=f"{t.name}_2d")
    new = gs.Variable(ctx.unique_name(ir, f"{t.name}_2d"), dtype=t.dtype, shape=shape2d)
    swap(producer.outputs, t, new)
    outside = [c for c in list(t.outputs) if not region.inside(c)]
    for consumer in outside:
        if _flexible(consumer, t):
            _retarget(ir, ctx, consumer, t, new)
    if any(not _flexible(c, t) for c in outside) or t in ir.graph.outputs:  # an exit: ``t`` is rebuilt from 2-D
        shape = _int64(ir, ctx, f"{t.name}_shape", t.shape)
        ir.graph.nodes.append(gs.Node("Reshape", name=ctx.unique_name(ir, f"{t.name}_rows"), inputs=[new, shape],
                                      outputs=[t]))
    return new


def _int64(ir: IRModel, ctx: PassContext, prefix: str, values) -> gs.Constant:
    return make_constant(ir, ctx, prefix, np.asarray(values, dtype=np.int64))


def _retarget(ir: IRModel, ctx: PassContext, consumer: gs.Node, old: gs.Tensor, new: gs.Tensor) -> None:
    """Point a flexible consumer at the 2-D tensor; a Reshape's 0 (copy) dims are made explicit."""
    if consumer.op == "Reshape" and not consumer.attrs.get("allowzero", 0):
        target = input_value(consumer, 1)
        if np.any(target == 0):
            fixed = [old.shape[i] if d == 0 else int(d) for i, d in enumerate(target)]
            consumer.inputs[1] = _int64(ir, ctx, f"{consumer.name}_shape", fixed)
    swap(consumer.inputs, old, new)


def _fix_node(ir: IRModel, ctx: PassContext, node: gs.Node) -> None:
    """Axis arguments relative to the last axis; constants with extra leading unit dims squeezed."""
    if node.op in AXIS_ATTR:
        node.attrs["axis"] = -1
    if node.op in REDUCTIONS:
        if "axes" in node.attrs:
            node.attrs["axes"] = [-1]
        else:
            node.inputs[1] = _int64(ir, ctx, f"{node.name}_axes", [-1])
    if node.op == "Slice":
        node.inputs[3] = _int64(ir, ctx, f"{node.name}_axes", [-1] * len(input_value(node, 3)))
        return
    for i, t in enumerate(node.inputs):
        if t.name and is_constant(t) and len(constant_shape(t)) > 2:  # read only the values to squeeze
            value = constant_value(t)
            node.inputs[i] = make_constant(ir, ctx, f"{t.name}_2d", value.reshape(value.shape[-2:]))


def rewrite_rows(ir: IRModel, ctx: PassContext, stats: dict, notes: list) -> int:
    done = 0
    for nodes in _regions(ir.graph, ir.opset):
        region = _Region(ir.graph, nodes)
        saving = region.saving()
        if saving <= 0:
            if ctx.verbose and any(n.op == "MatMul" for n in nodes):
                notes.append(f"rows2d: region at {nodes[0].name} ({len(nodes)} nodes) kept: saves {saving} ops")
            continue
        _flatten_region(ir, ctx, region)
        stats["rows2d_regions"] = stats.get("rows2d_regions", 0) + 1
        stats["rows2d_nodes"] = stats.get("rows2d_nodes", 0) + len(nodes)
        stats["rows2d_ops_saved"] = stats.get("rows2d_ops_saved", 0) + saving
        done += 1
    return done
