"""kv-split-concat: no Concat of a graph input (the KV cache) inside the graph.

Matches: ``Y = Concat(A, B, ..., axis=a)`` where one operand is a graph input (the past
K/V of a static-cache decoder), with static shapes.

Produces: the Concat distributed over what reads ``Y``, by algebra rather than names:

* a per-position op ``U`` (Transpose, Unsqueeze, Squeeze, Reshape, Expand, Cast, Identity) that
  keeps axis ``a`` whole (same size, same elements before and after it) becomes
  ``Concat(U(A), U(B), axis=a')``, where ``a'`` is where ``a`` went, and distribution continues;
* a MatMul that concatenates along the kept axis of an operand (``X·[A B]`` along N, or
  ``[A;B]·X`` along M) becomes ``Concat(X·A, X·B)`` of the (small, score-sized) products;
* a MatMul that concatenates along the reduction axis K becomes the sum of the partial products:
  ``X·[A;B] = X[..., :|A|]·A + X[..., |A|:]·B`` (Slice of the other operand);
* anything else keeps reading the Concat (and the pass says so in its notes).

Why it is safe: every step is an identity of linear algebra or of data movement; the results
differ from the original at rounding level only (a sum split in two is added in another
order).  The HTP then never copies the whole cache into a new buffer each step.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import (
    EXACT,
    STATIC_SHAPES,
    Pass,
    PassContext,
    PassResult,
    register_pass,
)
from qnnpasses.passmanager.rewrite import (
    constant_value,
    emit,
    emit_slice,
    finish,
    is_graph_output,
    make_constant,
    normalize_axis,
    static_shape,
)

_MOVE_OPS = ("Transpose", "Unsqueeze", "Squeeze", "Reshape", "Expand", "Cast", "Identity")


def _axes_of(node: gs.Node, rank: int) -> list[int] | None:
    values = node.attrs.get("axes")
    if values is None and len(node.inputs) > 1:
        values = constant_value(node.inputs[1])
        if values is None:
            return None
    if values is None:
        return []
    return sorted(normalize_axis(int(v), rank) for v in np.asarray(values).ravel())


def _reshape_axis(src: tuple[int, ...], dst: tuple[int, ...], axis: int) -> int | None:
    """Where ``src``'s ``axis`` is in ``dst``, if a reshape keeps it whole (None otherwise)."""
    before = int(np.prod(src[:axis], dtype=np.int64))
    after = int(np.prod(src[axis + 1:], dtype=np.int64))
    for index, dim in enumerate(dst):
        if dim == src[axis] and int(np.prod(dst[:index], dtype=np.int64)) == before \
                and int(np.prod(dst[index + 1:], dtype=np.int64)) == after:
            return index
    return None


def _out_axis(node: gs.Node, src: tuple[int, ...], dst: tuple[int, ...], axis: int) -> int | None:
    """Where the concatenation axis goes through the per-position op ``node`` (None: it does not stay whole)."""
    op = node.op
    if op in ("Cast", "Identity"):
        return axis
    if op == "Transpose":
        perm = node.attrs.get("perm") or list(reversed(range(len(src))))
        return list(perm).index(axis)
    if op == "Unsqueeze":
        axes = _axes_of(node, len(dst))
        if axes is None:
            return None
        kept = [i for i in range(len(dst)) if i not in axes]
        return kept[axis]
    if op == "Squeeze":
        axes = _axes_of(node, len(src))
        if axes is None or axis in axes or (not axes and src[axis] == 1):
            return None
        axes = axes or [i for i, d in enumerate(src) if d == 1]
        return axis - sum(1 for a in axes if a < axis)
    if op == "Reshape":
        return _reshape_axis(src, dst, axis)
    if op == "Expand":
        moved = axis + len(dst) - len(src)
        return moved if dst[moved] == src[axis] else None
    return None


class _Distributor:
    def __init__(self, ir: IRModel, ctx: PassContext):
        self.ir, self.ctx, self.graph = ir, ctx, ir.graph
        self.stats = {"concats": 0, "moved": 0, "matmul_concat": 0, "matmul_split_sum": 0, "kept": 0}
        self.notes: list[str] = []

    def run(self, seeds: list[gs.Node]) -> None:
        queue = deque(seeds)
        while queue:
            concat = queue.popleft()
            if not concat.outputs:
                continue
            out = concat.outputs[0]
            axis = normalize_axis(int(concat.attrs.get("axis", 0)), len(out.shape))
            for consumer in list(out.outputs):
                made = self._distribute(concat, axis, consumer)
                if made is None:
                    self.stats["kept"] += 1
                    self.notes.append(f"{consumer.op} '{consumer.name}' still reads Concat '{concat.name}'")
                elif made is not False:
                    queue.append(made)
            if not out.outputs and not is_graph_output(self.graph, out):
                concat.inputs.clear()
                concat.outputs.clear()

    # A handler returns the new Concat to keep distributing, False when done, None when it cannot.
    def _distribute(self, concat: gs.Node, axis: int, node: gs.Node):
        parts = list(concat.inputs)
        shapes = [static_shape(p) for p in parts]
        out = node.outputs[0] if node.outputs else None
        if out is None or any(s is None for s in shapes) or static_shape(out) is None:
            return None
        if node.op in _MOVE_OPS and node.inputs[0] is concat.outputs[0]:
            return self._move(concat, axis, node, parts, shapes)
        if node.op == "MatMul":
            return self._matmul(concat, axis, node, parts, shapes)
        return None

    def _move(self, concat, axis, node, parts, shapes):
        src, dst = static_shape(concat.outputs[0]), static_shape(node.outputs[0])
        new_axis = _out_axis(node, src, dst, axis)
        if new_axis is None:
            return None
        pieces = []
        for part, shape in zip(parts, shapes):
            part_dst = list(dst)
            part_dst[new_axis] = shape[axis]
            inputs = [part] + list(node.inputs[1:])
            if node.op in ("Reshape", "Expand"):
                inputs = [part, make_constant(self.ir, self.ctx, f"{node.name}_shape", np.asarray(part_dst, np.int64))]
            pieces.append(emit(self.ir, self.ctx, node.op, inputs, hint=node.name or node.op, dtype=node.outputs[0].dtype,
                               shape=part_dst, attrs=dict(node.attrs)))
        self.stats["moved"] += 1
        return self._replace_with_concat(node, pieces, new_axis)

    def _matmul(self, concat, axis, node, parts, shapes):
        y = concat.outputs[0]
        if len(node.inputs) != 2 or (node.inputs[0] is y) == (node.inputs[1] is y):
            return None
        side = 0 if node.inputs[0] is y else 1
        other = node.inputs[1 - side]
        rank, other_shape = len(shapes[0]), static_shape(other)
        out_shape = static_shape(node.outputs[0])
        if rank < 2 or other_shape is None or len(other_shape) < 2:
            return None
        kept_axis = rank - 2 if side == 0 else rank - 1  # M of the left operand, N of the right one
        reduce_axis = rank - 1 if side == 0 else rank - 2
        dtype = node.outputs[0].dtype
        if axis == kept_axis:
            out_axis = len(out_shape) - (2 if side == 0 else 1)
            pieces = []
            for part, shape in zip(parts, shapes):
                part_out = list(out_shape)
                part_out[out_axis] = shape[axis]
                inputs = [part, other] if side == 0 else [other, part]
                pieces.append(emit(self.ir, self.ctx, "MatMul", inputs, hint=node.name or "matmul", dtype=dtype, shape=part_out))
            self.stats["matmul_concat"] += 1
            return self._replace_with_concat(node, pieces, out_axis)
        if axis == reduce_axis:
            slice_axis = len(other_shape) - (2 if side == 0 else 1)
            total, start = None, 0
            for part, shape in zip(parts, shapes):
                size = shape[axis]
                sliced_shape = list(other_shape)
                sliced_shape[slice_axis] = size
                sliced = emit_slice(self.ir, self.ctx, other, [start], [start + size], [slice_axis], [1], sliced_shape,
                                    hint=f"{node.name}_split")
                start += size
                inputs = [part, sliced] if side == 0 else [sliced, part]
                product = emit(self.ir, self.ctx, "MatMul", inputs, hint=node.name or "matmul", dtype=dtype, shape=out_shape)
                total = product if total is None else emit(self.ir, self.ctx, "Add", [total, product], hint=f"{node.name}_sum",
                                                           dtype=dtype, shape=out_shape)
            self._take_output(node, total)
            self.stats["matmul_split_sum"] += 1
            return False
        return None

    def _replace_with_concat(self, node: gs.Node, pieces: list[gs.Tensor], axis: int) -> gs.Node:
        out = node.outputs[0]
        node.inputs.clear()
        node.outputs.clear()
        concat = gs.Node("Concat", name=self.ctx.unique_name(self.ir, "kv_concat"), attrs={"axis": int(axis)},
                         inputs=pieces, outputs=[out])
        self.graph.nodes.append(concat)
        self.stats["concats"] += 1
        return concat

    def _take_output(self, node: gs.Node, value: gs.Tensor) -> None:
        """Make ``node``'s output computed by ``value``'s producer instead (keeps the tensor's name)."""
        out = node.outputs[0]
        node.inputs.clear()
        node.outputs.clear()
        maker = value.inputs[0]
        maker.outputs[0] = out
        out.shape = value.shape if out.shape is None else out.shape


@register_pass
class KvSplitConcat(Pass):
    name = "kv-split-concat"
    summary = "Concat(past input, new) read by attention -> distributed: per-part moves, score Concat, split P·V sums"
    lossless = True
    contract = EXACT
    requires = frozenset({STATIC_SHAPES})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        graph = ir.graph
        inputs = {id(t) for t in graph.inputs}
        seeds = [n for n in graph.nodes if n.op == "Concat" and len(n.inputs) >= 2 and n.outputs
                 and any(id(t) in inputs for t in n.inputs) and static_shape(n.outputs[0]) is not None]
        if not seeds:
            return PassResult(changed=False)
        distributor = _Distributor(ir, ctx)
        distributor.run(seeds)
        finish(ir)
        stats = {k: v for k, v in distributor.stats.items() if v}
        return PassResult(changed=bool(distributor.stats["concats"] or distributor.stats["matmul_split_sum"]),
                          stats=stats, notes=distributor.notes[:20])
