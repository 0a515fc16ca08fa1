"""gathernd: GatherND with constant indices => Reshape / Slice / Gather, which the HTP runs.

Matches ``GatherND(data, indices)`` whose indices are a constant (any ``batch_dims``) and
whose data has a static shape.  The dynamo exporter emits one on the padding-mask path
(``Cast(attention_mask) -> GatherND(indices [1,1,1,S,2] = (0, j)) -> And -> Where``); the
QNN HTP rejects GatherND, so that node (and a partition boundary) goes to the CPU.

Produces the cheapest exact equivalent, found from the op's index map (see
``_layout_index``): a Reshape when the indices enumerate the data in order (the mask
case), a Slice for strided picks, a Gather along one axis; otherwise the general form
``Gather(Reshape(data, [prod(D[:b+k]), *D[b+k:]]), linear_indices, axis=0)``, where each
index tuple (with its batch offset) becomes one linear row number and the indices keep
their leading shape, so the Gather yields ``indices.shape[:-1] + D[b+k:]`` directly.

Safe because every form copies exactly the elements GatherND copies, in the same order:
the chosen form's index map is compared with GatherND's element by element.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs
from qnnpasses.passes.layout._chains import emit_form
from qnnpasses.passes.layout._forms import Form, cheapest_form

from qnnpasses.ir.checks import fill_unknown_shapes
from qnnpasses.ir.index_map import index_map
from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import EXACT, FOLDED, NO_GATHERND, Pass, PassContext, PassResult, register_pass
from qnnpasses.passmanager.rewrite import finish, input_value, replace_all_uses, static_shape

GENERAL_COST = 3  # forms costing fewer ops than Reshape + Gather (+ Reshape) are preferred


def linear_indices(indices: np.ndarray, data_shape: tuple[int, ...], batch_dims: int) -> np.ndarray:
    """Row numbers into ``data`` reshaped to ``[prod(D[:b+k]), *D[b+k:]]``, shaped ``indices.shape[:-1]``."""
    k = indices.shape[-1]
    dims = np.asarray(data_shape[batch_dims:batch_dims + k], dtype=np.int64)
    idx = np.where(indices < 0, indices + dims, indices).astype(np.int64)
    inner = np.zeros(indices.shape[:-1], dtype=np.int64)
    for axis in range(k):
        inner = inner * dims[axis] + idx[..., axis]
    batch = math.prod(data_shape[:batch_dims])
    per_batch = math.prod(data_shape[batch_dims:batch_dims + k])
    offsets = np.arange(batch, dtype=np.int64).reshape(data_shape[:batch_dims] + (1,) * (inner.ndim - batch_dims))
    return inner + offsets * per_batch


def general_form(indices: np.ndarray, data_shape: tuple[int, ...], batch_dims: int) -> Form:
    k = indices.shape[-1]
    rows = math.prod(data_shape[:batch_dims + k])
    rest = tuple(data_shape[batch_dims + k:])
    linear = linear_indices(indices, data_shape, batch_dims)
    out_shape = tuple(linear.shape) + rest
    steps = [("Reshape", {"shape": (rows,) + rest}), ("Gather", {"axis": 0, "indices": linear, "shape": out_shape})]
    return Form("reshape-gather", steps)


def plan(node: gs.Node, opset: int) -> tuple[Form, str] | tuple[None, str]:
    """The replacement form for one GatherND, or None and the reason."""
    indices = input_value(node, 1)
    data_shape = static_shape(node.inputs[0])
    if indices is None:
        return None, "indices are not a constant"
    if data_shape is None:
        return None, "data shape is not static"
    batch_dims = int(node.attrs.get("batch_dims", 0))
    index = index_map([node], data_shape, [[None, indices]], opset)
    if index is None:
        return None, "index map not computable (too large or invalid indices)"
    form = cheapest_form(index, data_shape, GENERAL_COST)
    return (form, "cheapest") if form is not None else (general_form(indices, data_shape, batch_dims), "general")


@register_pass
class GatherNDToGather(Pass):
    name = "gathernd"
    anchor_ops = frozenset({"GatherND"})
    summary = "GatherND(data, constant indices) => Reshape / Slice / Gather (HTP has no GatherND)"
    contract = EXACT
    requires = frozenset({FOLDED})
    ensures = frozenset({NO_GATHERND})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        stats: dict = {"rewritten": 0}
        notes: list[str] = []
        for node in [n for n in ir.graph.nodes if n.op == "GatherND"]:
            form, why = plan(node, ir.opset)
            if form is None:
                notes.append(f"{node.name}: kept, {why}")
                continue
            new = emit_form(ir, ctx, node.inputs[0], form, hint=node.name or "gathernd")
            replace_all_uses(ir.graph, node.outputs[0], new, via_identity=True)
            node.inputs.clear()
            node.outputs.clear()
            stats["rewritten"] += 1
            stats[f"to_{form.kind}"] = stats.get(f"to_{form.kind}", 0) + 1
            if ctx.verbose:
                notes.append(f"{node.name}: {why} form {'->'.join(op for op, _ in form.steps) or 'nothing'}")
        if stats["rewritten"]:
            finish(ir)
            fill_unknown_shapes(ir)
        return PassResult(changed=stats["rewritten"] > 0, stats=stats, notes=notes)
