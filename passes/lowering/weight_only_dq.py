"""weight-only-dq: a weight-only quantized constant spelled ``Cast(q) [-> Sub(zp)] -> Mul(scale)`` => ``DequantizeLinear``.

Matches, on the weight input of ``MatMul``/``Gemm``, ``Mul(Cast(q, to=float), scale)`` (either
operand order) with an optional ``Sub(Cast(q), zero_point)`` in between, where ``q`` is a constant
of int8/uint8 (or 4-bit) values, ``scale`` a float constant that is a scalar or varies along
one axis of the weight (per-channel), and the zero point (if any) constant with the scale's
shape and integral values in ``q``'s range -- how dynamo/torchao export int8 weight-only
layers, and how hand-written "weight-only int8" graphs look.

Produces ``DequantizeLinear(q, scale[, zero_point], axis)`` (scale and zero point reshaped to
1-D), which quantization tools and the QNN EP read as a quantized weight: ``qnnpasses
quantize`` (onnxruntime's QNN recipe) keeps such a weight as it is instead of treating the
``Mul`` output as an activation and re-quantizing the product (measured in docs/genai.md).

Why safe: ``DequantizeLinear`` computes ``(q - zp) * scale`` in float, exactly what the Cast,
Sub and Mul compute.  Not part of ``htp-llm``: in fp16 mode the QNN EP runs a weight's
``DequantizeLinear`` on the CPU, while onnxruntime folds the constant ``Cast -> Mul`` into a
float weight that the HTP runs (measured, docs/genai.md); use it before integer quantization.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import EXACT, Pass, PassContext, PassResult, register_pass
from qnnpasses.passmanager.rewrite import constant_value, finish, make_constant, make_node, producer

_QUANT_TYPES = (np.int8, np.uint8)


@register_pass
class WeightOnlyDQ(Pass):
    name = "weight-only-dq"
    summary = "MatMul weight Cast(q int8)[->Sub(zp)]->Mul(scale) => DequantizeLinear(q, scale[, zp], axis)"
    contract = EXACT

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        rewritten, notes = 0, []
        for node in list(ir.graph.nodes):
            if node.op not in ("MatMul", "Gemm") or len(node.inputs) < 2:
                continue
            weight = node.inputs[1]
            found = _match(weight)
            if isinstance(found, str):
                if ctx.verbose and found:
                    notes.append(f"{node.name}: {found}")
                continue
            q, scale, zero_point, axis = found
            inputs = [q, make_constant(ir, ctx, "wdq_scale", scale)]
            if zero_point is not None:
                inputs.append(make_constant(ir, ctx, "wdq_zero_point", zero_point))
            attrs = {"axis": axis} if scale.ndim == 1 else {}
            dq = make_node(ir, ctx, "DequantizeLinear", inputs, name_hint="weight_dq", attrs=attrs,
                           dtype=weight.dtype, shape=weight.shape)
            node.inputs[1] = dq.outputs[0]
            rewritten += 1
        if rewritten:
            finish(ir)
        return PassResult(changed=rewritten > 0, stats={"rewritten": rewritten}, notes=notes)


def _match(weight: gs.Tensor):
    """(q constant, scale [N] or scalar, zero point or None, axis) or a reason ('' = not this pattern)."""
    mul = producer(weight)
    if mul is None or mul.op != "Mul":
        return ""
    for first, second in ((0, 1), (1, 0)):
        scale = constant_value(mul.inputs[second])
        inner = producer(mul.inputs[first])
        if scale is not None and inner is not None and inner.op in ("Cast", "Sub"):
            break
    else:
        return ""
    zero_point = None
    if inner.op == "Sub":
        zero_point = constant_value(inner.inputs[1])
        inner = producer(inner.inputs[0])
        if zero_point is None or inner is None or inner.op != "Cast":
            return "Sub without a constant zero point after the Cast"
    q = inner.inputs[0]
    values = constant_value(q) if isinstance(q, gs.Constant) else None
    if values is None or values.dtype not in [np.dtype(t) for t in _QUANT_TYPES]:
        return ""
    if len(weight.outputs) > 1 or len(mul.outputs[0].outputs) > 1:
        return "the dequantized weight has other readers"
    if scale.dtype not in (np.float32, np.float16) or (weight.dtype is not None and np.dtype(weight.dtype) != scale.dtype):
        return "scale dtype differs from the weight's"
    axis = _axis(scale, values.shape)
    if axis is None:
        return f"scale shape {list(scale.shape)} is neither per-tensor nor per-axis of {list(values.shape)}"
    if zero_point is not None:
        if zero_point.shape != scale.shape and zero_point.size != 1:
            return "zero point shape differs from the scale's"
        info = np.iinfo(values.dtype)
        if np.any(zero_point != np.round(zero_point)) or zero_point.min() < info.min or zero_point.max() > info.max:
            return "zero point is not an integer in the weight's range"
        zero_point = np.broadcast_to(zero_point, scale.shape).astype(values.dtype)
    if axis == -1:
        return q, scale.reshape(()).copy(), None if zero_point is None else zero_point.reshape(()).copy(), 0
    flat = scale.reshape(-1).copy()
    return q, flat, None if zero_point is None else zero_point.reshape(-1).copy(), axis


def _axis(scale: np.ndarray, shape: tuple[int, ...]) -> int | None:
    """-1 for a per-tensor scale, the axis a per-channel scale varies along, else None."""
    if scale.size == 1:
        return -1
    if scale.ndim > len(shape):
        return None
    padded = (1,) * (len(shape) - scale.ndim) + tuple(scale.shape)
    varying = [i for i, d in enumerate(padded) if d != 1]
    if len(varying) == 1 and padded[varying[0]] == shape[varying[0]]:
        return varying[0]
    return None
