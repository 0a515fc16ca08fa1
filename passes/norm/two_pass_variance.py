"""two-pass-variance: ``E[x^2] - E[x]^2`` => ``E[(x - E[x])^2]``, the variance fp16 can hold.

Matches the one-pass ("fast") variance that JAX/Flax, Keras and TF LayerNorms compute:
``Sub(M(x*x), M(x)*M(x))`` -- squares as ``Mul(v, v)`` or ``Pow(v, 2)`` -- optionally
clamped by ``Max(., 0)`` or ``Relu``, where ``M`` is a mean over the same constant axes
and keepdims: ``ReduceMean``, or ``ReduceSum`` followed by ``Mul(1/N)`` / ``Div(N)`` with
N the (static) number of reduced elements.

Produces ``ReduceMean(d * d)`` with ``d = x - ReduceMean(x)`` (keepdims, then a Reshape
when the original dropped the reduced dims); when the variance only feeds ``[Reshape ->]
Add(eps) -> Sqrt -> Reciprocal`` (the usual ``rsqrt``), that whole chain becomes one
row-scaled ``1/sqrt(mean(d^2) + eps)`` (see :func:`_scaled_rstd`) whose intermediates are
normal fp16 numbers even for a variance or an eps below 6.1e-5, which the HTP flushes.
The same function; the clamp is moot (a mean of squares is never negative).  Contract:
approximate, because the *original* loses digits to fp32 cancellation (on magika up to 5%
of a small variance against float64, outputs 2.5e-3 apart) where the two-pass form is
accurate to ~1e-6: the rewrite moves the outputs by the original's own error.

Why: in fp16 (the HTP) the one-pass form fails twice.  ``sum(x^2)`` overflows 65504 as
soon as the row's energy does (magika: 512 values of |x| ~ 15), and where it does not, the
difference of two nearly equal numbers keeps ~3 significant digits of a variance that
may be 1e-3 of either: ``1/sqrt(var + eps)`` then is off by up to 100x (measured: cosine
~0 of the softmax at the end of magika).  The centred form squares the deviations, which
are small where the variance is, and its sum only overflows when the variance itself
leaves fp16 (then ``fp16-safety`` sees a plain decomposed norm).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs
from qnnpasses.passes.norm._graph import reduce_axes
from qnnpasses.passes.norm._match import squared_operand

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import (
    FOLDED,
    Pass,
    PassContext,
    PassResult,
    approximate,
    register_pass,
)
from qnnpasses.passmanager.rewrite import (
    emit_reshape,
    finish,
    make_constant,
    make_node,
    make_reduce,
    other_input,
    producer,
    replace_all_uses,
    scalar,
    single_consumer,
    static_shape,
)

#: Lower clamp of the per-row scale s: keeps 1/s <= 1024 and (sqrt(eps)/s)^2 <= 2^20 * eps.
SCALE_FLOOR = 2.0**-10

_REDUCE_KEY = tuple[tuple[int, ...], int]  # (axes normalized to >= 0, keepdims)


def _reduced_count(x: gs.Tensor, axes: tuple[int, ...]) -> int | None:
    shape = static_shape(x)
    return None if shape is None else math.prod(shape[a] for a in axes)


def _mean_of(t: gs.Tensor) -> tuple[gs.Tensor, _REDUCE_KEY] | None:
    """(x, (axes, keepdims)) when ``t`` is the mean of x over constant axes."""
    node = producer(t)
    if node is None:
        return None
    if node.op in ("Mul", "Div"):
        sums = [i for i in node.inputs if producer(i) is not None and producer(i).op == "ReduceSum"]
        if len(sums) != 1 or (node.op == "Div" and node.inputs[0] is not sums[0]):
            return None
        factor = scalar(other_input(node, sums[0]), through_identity=True)
        reduce = producer(sums[0])
    elif node.op == "ReduceMean":
        factor, reduce = None, node
    else:
        return None
    x = reduce.inputs[0]
    axes, shape = reduce_axes(reduce), static_shape(x)
    if not axes or shape is None:
        return None
    key = (tuple(sorted(a % len(shape) for a in axes)), int(reduce.attrs.get("keepdims", 1)))
    if reduce.op == "ReduceSum":
        n = _reduced_count(x, key[0])
        expected = 1.0 / n if node.op == "Mul" else float(n)
        if factor is None or n is None or not math.isclose(factor, expected, rel_tol=1e-6):
            return None
    return x, key


def _square_of(t: gs.Tensor) -> gs.Tensor | None:
    return squared_operand(producer(t))


def match_fast_variance(sub: gs.Node) -> tuple[gs.Tensor, _REDUCE_KEY] | None:
    """(x, reduction) when ``sub`` is ``M(x^2) - M(x)^2``."""
    if sub.op != "Sub":
        return None
    second, squared_mean = _mean_of(sub.inputs[0]), _square_of(sub.inputs[1])
    if second is None or squared_mean is None:
        return None
    first = _mean_of(squared_mean)
    x = _square_of(second[0])
    if first is None or x is None or first[0] is not x or first[1] != second[1]:
        return None
    dtype = x.dtype
    if dtype is None or np.dtype(dtype).kind != "f":
        return None
    return x, first[1]


def _clamp_consumer(sub: gs.Node, graph: gs.Graph) -> gs.Node | None:
    """A ``Max(var, 0)`` / ``Relu(var)`` right after the variance."""
    node = single_consumer(sub.outputs[0], graph)
    if node is None:
        return None
    if node.op == "Relu" or (node.op == "Max" and len(node.inputs) == 2
                             and scalar(other_input(node, sub.outputs[0]), through_identity=True) == 0.0):
        return node
    return None


@register_pass
class TwoPassVariance(Pass):
    name = "two-pass-variance"
    anchor_ops = frozenset({"Sub"})
    summary = "E[x^2]-E[x]^2 (Flax/Keras LayerNorm variance) => E[(x-E[x])^2], which fp16 holds"
    contract = approximate(
        why="the same function, but the original's one-pass variance loses digits to fp32 cancellation (magika: up to 5% "
            "of a small variance, outputs move by 2.5e-3); the two-pass form is the accurate one (6e-6 vs float64)",
        atol=1e-2, rtol=1e-2, min_cosine=0.9999)
    requires = frozenset({FOLDED})
    ensures = frozenset()

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        graph, stats, notes = ir.graph, {"rewritten": 0, "rstd_scaled": 0}, []
        for sub in [n for n in graph.nodes if n.op == "Sub"]:
            match = match_fast_variance(sub)
            if match is None:
                continue
            x, (axes, keepdims) = match
            clamp = _clamp_consumer(sub, graph)
            old = (clamp or sub).outputs[0]
            rstd = _rstd_chain(old, graph)
            target = rstd[0] if rstd else old
            out_shape = static_shape(target)
            if (not keepdims or rstd) and out_shape is None:
                notes.append(f"{sub.name}: variance of unknown shape (kept)")
                continue
            mean = make_reduce(ir, ctx, "ReduceMean", x, axes, "two_pass_mean")
            d = _emit(ir, ctx, "Sub", [x, mean], "two_pass_centred", x)
            if rstd:
                new = _scaled_rstd(ir, ctx, d, axes, rstd[1])
                stats["rstd_scaled"] += 1
            else:
                new = make_reduce(ir, ctx, "ReduceMean", _emit(ir, ctx, "Mul", [d, d], "two_pass_square", x), axes,
                                  "two_pass_variance")
            if static_shape(new) != out_shape and out_shape is not None:
                new = emit_reshape(ir, ctx, new, out_shape, "two_pass_dims")
            new.dtype, new.shape = target.dtype, target.shape
            replace_all_uses(graph, target, new)
            stats["rewritten"] += 1
            what = "1/sqrt(var + eps), row-scaled" if rstd else "variance"
            notes.append(f"{sub.name}: one-pass variance over axes {list(axes)} of {x.name} -> two-pass {what}")
        if stats["rewritten"]:
            finish(ir)
        return PassResult(changed=bool(stats["rewritten"]), stats=stats, notes=notes)


def _emit(ir: IRModel, ctx: PassContext, op: str, inputs: list[gs.Tensor], hint: str, like: gs.Tensor) -> gs.Tensor:
    return make_node(ir, ctx, op, inputs, name_hint=hint, dtype=like.dtype).outputs[0]


def _rstd_chain(var: gs.Tensor, graph: gs.Graph) -> tuple[gs.Tensor, float] | None:
    """(1/sqrt(var + eps), eps) when ``var`` feeds only ``[Reshape ->] Add(eps) -> Sqrt -> Reciprocal|Div(1, .)``."""
    node = single_consumer(var, graph)
    if node is not None and node.op == "Reshape":
        node = single_consumer(node.outputs[0], graph)
    if node is None or node.op != "Add":
        return None
    eps = next((v for v in (scalar(i, through_identity=True) for i in node.inputs) if v is not None), None)
    if eps is None or eps < 0:
        return None
    sqrt = single_consumer(node.outputs[0], graph)
    inv = None if sqrt is None or sqrt.op != "Sqrt" else single_consumer(sqrt.outputs[0], graph)
    if inv is None or not (inv.op == "Reciprocal" or (inv.op == "Div" and inv.inputs[1] is sqrt.outputs[0]
                                                      and scalar(inv.inputs[0], through_identity=True) == 1.0)):
        return None
    return inv.outputs[0], float(eps)


def _scaled_rstd(ir: IRModel, ctx: PassContext, d: gs.Tensor, axes: tuple[int, ...], eps: float) -> gs.Tensor:
    """``1/sqrt(mean(d^2) + eps)`` with every intermediate a normal fp16 number.

    With ``s = max(max|d|, 2^-10)`` per row and ``t = d / s``:
    ``1/sqrt(mean(d^2) + eps) = (1/sqrt(mean(t^2) + (sqrt(eps)/s)^2)) / s``.  ``t^2 <= 1``
    cannot overflow; ``mean(t^2) >= 1/N`` unless the row is (nearly) constant, where
    ``(sqrt(eps)/s)^2`` is the larger term; so neither a tiny variance nor an eps below
    fp16's smallest normal (6.1e-5, which the HTP flushes to zero) becomes 0 under the Sqrt.
    """
    dtype = np.dtype(d.dtype or np.float32)
    s = make_reduce(ir, ctx, "ReduceMax", _emit(ir, ctx, "Abs", [d], "two_pass_abs", d), axes, "two_pass_scale")
    s = _emit(ir, ctx, "Max", [s, make_constant(ir, ctx, "two_pass_floor", np.asarray(SCALE_FLOOR, dtype))],
              "two_pass_scale_floor", d)
    t = _emit(ir, ctx, "Div", [d, s], "two_pass_scaled", d)
    mean_t2 = make_reduce(ir, ctx, "ReduceMean", _emit(ir, ctx, "Mul", [t, t], "two_pass_square", d), axes,
                          "two_pass_variance")
    e = _emit(ir, ctx, "Div", [make_constant(ir, ctx, "two_pass_sqrt_eps", np.asarray(math.sqrt(eps), dtype)), s],
              "two_pass_eps_scaled", d)
    denom = _emit(ir, ctx, "Add", [mean_t2, _emit(ir, ctx, "Mul", [e, e], "two_pass_eps_sq", d)], "two_pass_add", d)
    r = _emit(ir, ctx, "Reciprocal", [_emit(ir, ctx, "Sqrt", [denom], "two_pass_sqrt", d)], "two_pass_rsqrt", d)
    return _emit(ir, ctx, "Div", [r, s], "two_pass_rstd", d)
