"""Graph helpers shared by the normalization / GeLU / fp16-safety passes.

Generic enough for ``qnnpasses.passmanager.rewrite`` (candidates to move there): reading Reduce*
axes whichever way the opset spells them, walking through no-op Casts, and the fp16-safe
normalization builder that both ``fp16-safety`` and ``decompose-layernorm`` emit.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.rewrite import (
    constant_value,
    make_constant,
    make_node,
    make_reduce,
    replace_all_uses,
    single_consumer,
)

#: Lower clamp of the per-row scale in :func:`safe_normalize`.  Keeps ``1/sqrt(m)`` <= 32
#: and ``eps/m`` <= 1024*eps, both comfortably inside fp16.
SAFE_SCALE_FLOOR = 2.0**-10


def rank(tensor: gs.Tensor) -> int | None:
    return None if tensor.shape is None else len(tensor.shape)


def static_dim(tensor: gs.Tensor, axis: int) -> int | None:
    """``tensor.shape[axis]`` when it is a known integer."""
    if tensor.shape is None or not tensor.shape:
        return None
    dim = tensor.shape[axis]
    return dim if isinstance(dim, int) and dim >= 0 else None


def reduce_axes(node: gs.Node) -> list[int] | None:
    """The axes of a Reduce* node (attribute before opset 18, constant input after); None if unknown."""
    if len(node.inputs) > 1 and node.inputs[1].name:
        value = constant_value(node.inputs[1], through_identity=True)
        return None if value is None else [int(a) for a in value.ravel()]
    axes = node.attrs.get("axes")
    return None if axes is None else [int(a) for a in axes]


def reduces_last_axis(node: gs.Node) -> bool:
    """A keepdims Reduce* over exactly the last axis of its input."""
    axes = reduce_axes(node)
    if axes is None or len(axes) != 1 or int(node.attrs.get("keepdims", 1)) != 1:
        return False
    r = rank(node.inputs[0])
    return axes[0] == -1 or (r is not None and axes[0] == r - 1)


def cast_target(node: gs.Node) -> np.dtype | None:
    to = node.attrs.get("to")
    return None if to is None else np.dtype(onnx.helper.tensor_dtype_to_np_dtype(int(to)))


def is_noop_cast(node: gs.Node) -> bool:
    """A Cast to the dtype its input already has."""
    src = node.inputs[0].dtype
    return node.op == "Cast" and src is not None and cast_target(node) == np.dtype(src)


def follow_noop_casts(tensor: gs.Tensor, graph: gs.Graph) -> tuple[gs.Tensor, list[gs.Node]]:
    """Walk forward through single-consumer no-op Casts; the last tensor and the Casts passed."""
    casts = []
    while True:
        consumer = single_consumer(tensor, graph)
        if consumer is None or not is_noop_cast(consumer):
            return tensor, casts
        casts.append(consumer)
        tensor = consumer.outputs[0]


def scalar_like(dtype, value: float) -> np.ndarray:
    return np.asarray(value, dtype=np.dtype(dtype) if dtype is not None else np.float32)


def binary(ir: IRModel, ctx: PassContext, op: str, a: gs.Tensor, b: gs.Tensor, hint: str, dtype=None) -> gs.Tensor:
    return make_node(ir, ctx, op, [a, b], name_hint=hint, dtype=dtype or a.dtype).outputs[0]


def unary(ir: IRModel, ctx: PassContext, op: str, a: gs.Tensor, hint: str) -> gs.Tensor:
    return make_node(ir, ctx, op, [a], name_hint=hint, dtype=a.dtype).outputs[0]


def const(ir: IRModel, ctx: PassContext, like: gs.Tensor, value: float, hint: str) -> gs.Constant:
    return make_constant(ir, ctx, hint, scalar_like(like.dtype, value))


#: Least argument :func:`floored_exp` lets reach ``Exp``.  The HTP's fp16 ``Exp`` (the simulator
#: here) has returned garbage of fp16 magnitude for large negative arguments, where it should
#: give 0 (fp16 underflows near -17).
#: ``exp(-64)`` = 1.6e-28 is below fp32's rounding of anything it is added to or scales next
#: to a term of order 1, so flooring there changes no fp32 result beyond rounding.
EXP_FLOOR = -64.0


def floored_exp(ir: IRModel, ctx: PassContext, z: gs.Tensor, hint: str) -> gs.Tensor:
    """``Exp(Max(z, EXP_FLOOR))``: for an ``Exp`` whose result only ever counts next to terms of
    order 1 (a Softmax's row sum, erfc's tail), where a very negative ``z`` must give ~0."""
    return unary(ir, ctx, "Exp", binary(ir, ctx, "Max", z, const(ir, ctx, z, EXP_FLOOR, f"{hint}_floor"),
                                         f"{hint}_floored"), hint)


def safe_normalize(ir: IRModel, ctx: PassContext, v: gs.Tensor, eps: float, axes: Sequence[int], hint: str) -> gs.Tensor:
    """``v / sqrt(mean(v^2) + eps)`` over ``axes``, with no intermediate outside fp16's range.

    With ``m = max(max|v|, 2^-10)`` per row and ``t = v / sqrt(m)``:
    ``v / sqrt(mean(v^2)+eps) = t / sqrt(mean(t^2) + eps/m)`` exactly, for any ``m > 0``.
    Now ``t^2 <= m`` (no overflow for any finite fp16 ``v``), ``mean(t^2) >= m/N`` or
    ``eps/m`` is large (no underflow of the denominator), and ``1/sqrt(m)`` never becomes a
    subnormal (the HTP flushes those to zero, which is why ``v/max|v|`` does NOT work).
    Measured on the HTP in fp16: rows with |v| ~ 30,000, ~1, ~0.01 and all-zero rows all
    stay within fp16 rounding (1e-3 relative) of fp32; ``Pow(v,2)`` gives garbage for the first.
    """
    h = hint
    m = binary(ir, ctx, "Max", make_reduce(ir, ctx, "ReduceMax", unary(ir, ctx, "Abs", v, f"{h}_abs"), axes, f"{h}_absmax"),
               const(ir, ctx, v, SAFE_SCALE_FLOOR, f"{h}_floor"), f"{h}_scale")
    t = binary(ir, ctx, "Div", v, unary(ir, ctx, "Sqrt", m, f"{h}_sqrt_scale"), f"{h}_scaled")
    mean_sq = make_reduce(ir, ctx, "ReduceMean", binary(ir, ctx, "Mul", t, t, f"{h}_square"), axes, f"{h}_mean_square")
    eps_over_m = binary(ir, ctx, "Div", const(ir, ctx, v, eps, f"{h}_eps"), m, f"{h}_eps_scaled")
    denom = unary(ir, ctx, "Sqrt", binary(ir, ctx, "Add", mean_sq, eps_over_m, f"{h}_var"), f"{h}_rms")
    return binary(ir, ctx, "Div", t, denom, f"{h}_normalized")


def plain_normalize(ir: IRModel, ctx: PassContext, v: gs.Tensor, eps: float, axes: Sequence[int], hint: str) -> gs.Tensor:
    """``v / sqrt(mean(v*v) + eps)`` as exporters spell it (fp32-only; overflows in fp16)."""
    mean_sq = make_reduce(ir, ctx, "ReduceMean", binary(ir, ctx, "Mul", v, v, f"{hint}_square"), axes, f"{hint}_mean_square")
    denom = unary(ir, ctx, "Sqrt", binary(ir, ctx, "Add", mean_sq, const(ir, ctx, v, eps, f"{hint}_eps"), f"{hint}_var"), f"{hint}_rms")
    return binary(ir, ctx, "Div", v, denom, f"{hint}_normalized")


def set_like(tensor: gs.Tensor, like: gs.Tensor) -> gs.Tensor:
    """Give a new tensor the dtype and shape of the one it replaces."""
    tensor.dtype, tensor.shape = like.dtype, like.shape
    return tensor


class Replacements:
    """``replace_all_uses`` that remembers: matches found before a rewrite may name a tensor
    the rewrite replaced (a GeLU feeding a GeLU); :meth:`resolve` gives its replacement."""

    def __init__(self, graph: gs.Graph):
        self.graph = graph
        self._map: dict[int, gs.Tensor] = {}

    def resolve(self, tensor: gs.Tensor) -> gs.Tensor:
        while id(tensor) in self._map:
            tensor = self._map[id(tensor)]
        return tensor

    def replace(self, old: gs.Tensor, new: gs.Tensor) -> None:
        replace_all_uses(self.graph, old, set_like(new, old))
        self._map[id(old)] = new
