"""softmax-exp: ``Softmax(x, axis)`` => ``e / ReduceSum(e)`` with ``e = Exp(Max(x - ReduceMax(x), -64))``.

Matches a float ``Softmax`` over one axis: any axis from opset 13 (where Softmax normalizes that
axis alone), the last axis before it (where Softmax flattens the axes from ``axis`` on, which
for the last axis is the same).  Produces the ONNX definition of Softmax spelled out, with the
Reduce* axes written for the model's opset.

Why it is safe: it is the function ONNX defines (``exp(x - max) / sum(exp(x - max))`` along the
axis), so only the rounding changes (fp32: a few ulps).  Subtracting the row's maximum keeps
every ``Exp`` argument <= 0, so nothing overflows in fp16 where the fused op did not.  The
argument is floored at ``EXP_FLOOR`` (:func:`floored_exp`) because the HTP's fp16 ``Exp`` is wrong
far below -17, where a finite attention mask puts every masked score.  That turns an entry of
``exp(-64)`` = 1.6e-28 or less relative to the row's largest (which is 1) into 1.6e-28: far below
fp32's rounding of any sum of them, so a masked entry's probability is 1.6e-28 instead of a
smaller number or 0.  A row of only ``-inf`` (NaN in Softmax) stays NaN only where ``Max``
propagates NaN; htp-llm's finite masks leave no such row.

Why: on the QNN HTP in fp16 mode (a trained model's own attention scores;
``tools/probe_fp16_ops.py``, ``docs/fp16_ops.md``) the native Softmax is further from fp32 than
an ideal fp16 op, the spelled-out form close to it.  It costs
five more ops per Softmax, so ``qnnpasses llm`` applies it to fp16 pairs only (an integer-mode
graph runs its Softmax on quantized inputs, where this does not apply).
"""

from __future__ import annotations

import numpy as np
from qnnpasses.passes.norm._graph import EXP_FLOOR, binary, floored_exp, rank

from qnnpasses.ir.model import IRModel
from qnnpasses.ir.read import numpy_dtype
from qnnpasses.passmanager.api import EXACT, Pass, PassContext, PassResult, register_pass
from qnnpasses.passmanager.rewrite import finish, make_reduce, replace_all_uses

FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64))

#: Opset from which Softmax normalizes its one axis (before: the flattened axes from ``axis`` on).
SINGLE_AXIS_OPSET = 13


def softmax_axis(node, opset: int) -> tuple[int | None, str]:
    """The non-negative axis ``node`` (a Softmax) normalizes, or None with the reason."""
    x = node.inputs[0]
    dtype = numpy_dtype(x)  # (None == np.dtype('float64') in numpy: test None first)
    if dtype is None or dtype not in FLOATS:
        return None, "not a float tensor"
    r = rank(x)
    if r is None or r == 0:
        return None, "input rank unknown"
    axis = int(node.attrs.get("axis", -1 if opset >= SINGLE_AXIS_OPSET else 1))
    axis = axis + r if axis < 0 else axis
    if not 0 <= axis < r:
        return None, "axis out of range"
    if opset < SINGLE_AXIS_OPSET and axis != r - 1:
        return None, f"opset {opset} Softmax over the flattened axes from {axis} on"
    return axis, ""


@register_pass
class SoftmaxExp(Pass):
    name = "softmax-exp"
    anchor_ops = frozenset({"Softmax"})
    summary = (f"Softmax(x) => Exp(Max(x - ReduceMax(x), {EXP_FLOOR:g})) / ReduceSum(...): "
               "the fp16-precise Softmax on the HTP")
    contract = EXACT
    requires = frozenset()
    ensures = frozenset()

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        stats = {"softmax": 0, "kept": 0}
        reasons: dict[str, int] = {}
        for node in [n for n in ir.graph.nodes if n.op == "Softmax" and n.domain in (None, "", "ai.onnx")]:
            axis, why = softmax_axis(node, ir.opset)
            if axis is None:
                stats["kept"] += 1
                reasons[why] = reasons.get(why, 0) + 1
                continue
            x, y = node.inputs[0], node.outputs[0]
            shifted = binary(ir, ctx, "Sub", x, make_reduce(ir, ctx, "ReduceMax", x, [axis], "softmax_max"),
                             "softmax_shifted")
            e = floored_exp(ir, ctx, shifted, "softmax_exp")
            out = binary(ir, ctx, "Div", e, make_reduce(ir, ctx, "ReduceSum", e, [axis], "softmax_sum"), "softmax")
            out.shape = y.shape
            replace_all_uses(ir.graph, y, out)  # the Softmax, now unread, goes with the cleanup
            stats["softmax"] += 1
        if stats["softmax"]:
            finish(ir)
        notes = [f"kept {n} Softmax(es): {why}" for why, n in reasons.items()]
        return PassResult(changed=bool(stats["softmax"]), stats=stats, notes=notes)
