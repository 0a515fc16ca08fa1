"""Recognize decomposed RMSNorm and LayerNorm as exporters write them.

Both end in the same tail: ``ReduceMean(v*v) -> Add(eps) -> Sqrt -> (Div(1,.)|Reciprocal ->
Mul(v,.)) | Div(v,.)``, then an optional per-channel affine ``Mul(weight)`` / ``Add(bias)``,
possibly with Casts around the weight multiply (HF ``LlamaRMSNorm`` computes in float32 and
casts back).  RMSNorm squares the input itself; LayerNorm squares ``Sub(x, ReduceMean(x))``.

Matchers return a match object, or a string that says why the candidate is not one (the
passes collect these as notes in verbose mode).  Nothing here edits the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs
from qnnpasses.passes.norm._graph import (
    cast_target,
    follow_noop_casts,
    is_noop_cast,
    reduce_axes,
    reduces_last_axis,
    static_dim,
)

from qnnpasses.passmanager.rewrite import (
    constant_value,
    other_input,
    producer,
    producer_op,
    scalar,
    single_consumer,
)


@dataclass(eq=False)  # identity: matches hold tensors and arrays
class NormMatch:
    """``out = affine(normalized)``, ``normalized = v / sqrt(mean(v^2, axes) + eps)``."""

    kind: str  # "rms" | "layernorm"
    x: gs.Tensor  # the normalization's input (after an up-Cast, if any)
    v: gs.Tensor  # what is squared: x (rms) or x - mean(x) (layernorm)
    eps: float
    axes: list[int]
    normalized: gs.Tensor
    out: gs.Tensor  # the last tensor of the pattern (after weight/bias)
    weight: np.ndarray | None = None  # per-channel, shape [N]
    bias: np.ndarray | None = None
    x_source: gs.Tensor | None = None  # input of an up-Cast feeding x, when the output is cast back
    nodes: list[gs.Node] = field(default_factory=list)


def squared_operand(node: gs.Node | None) -> gs.Tensor | None:
    """``v`` for ``Pow(v, 2)`` or ``Mul(v, v)``."""
    if node is None:
        return None
    if node.op == "Pow" and scalar(node.inputs[1], through_identity=True) == 2.0:
        return node.inputs[0]
    if node.op == "Mul" and node.inputs[0] is node.inputs[1]:
        return node.inputs[0]
    return None


def _match_tail(reduce: gs.Node, v: gs.Tensor, graph: gs.Graph) -> tuple[float, gs.Tensor, list[gs.Node]] | str:
    """From the mean of squares to ``v / sqrt(. + eps)``: (eps, normalized, nodes)."""
    add = single_consumer(reduce.outputs[0], graph)
    eps = scalar(other_input(add, reduce.outputs[0]), through_identity=True) if add is not None and add.op == "Add" else None
    if eps is None or eps < 0:
        return "mean of squares is not followed by Add(constant eps)"
    sqrt = single_consumer(add.outputs[0], graph)
    if sqrt is None or sqrt.op != "Sqrt":
        return "eps Add is not followed by Sqrt"
    nodes = [reduce, add, sqrt]
    inv = single_consumer(sqrt.outputs[0], graph)
    if inv is not None and inv.op == "Div" and inv.inputs[0] is v and inv.inputs[1] is sqrt.outputs[0]:
        return eps, inv.outputs[0], nodes + [inv]
    is_recip = inv is not None and (inv.op == "Reciprocal" or (
        inv.op == "Div" and inv.inputs[1] is sqrt.outputs[0] and scalar(inv.inputs[0], through_identity=True) == 1.0))
    if not is_recip:
        return "Sqrt is not followed by Div(v, .), Div(1, .) or Reciprocal"
    mul = single_consumer(inv.outputs[0], graph)
    if mul is None or mul.op != "Mul" or other_input(mul, inv.outputs[0]) is not v:
        return "1/sqrt(...) does not multiply the squared tensor"
    return eps, mul.outputs[0], nodes + [inv, mul]


def _per_channel(node: gs.Node, tensor: gs.Tensor, n: int | None, rank: int | None) -> np.ndarray | None:
    """The constant other operand of ``node`` as a [N] vector, if it only varies along the last axis."""
    value = constant_value(other_input(node, tensor), through_identity=True)
    if value is None or value.dtype.kind != "f":
        return None
    if rank is not None and value.ndim > rank:
        return None
    if value.size == 1 and n is not None:
        return np.full(n, value.ravel()[0], dtype=value.dtype)
    if value.ndim >= 1 and value.shape[-1] == value.size and (n is None or value.size == n):
        return value.reshape(-1)
    return None


def _match_affine(m: NormMatch, graph: gs.Graph, with_bias: bool) -> None:
    """Extend ``m`` over optional Casts, ``Mul(weight)`` and (layernorm) ``Add(bias)``."""
    n, r = static_dim(m.x, -1), None if m.x.shape is None else len(m.x.shape)
    tail, casts = follow_noop_casts(m.normalized, graph)
    consumer = single_consumer(tail, graph)
    if consumer is not None and consumer.op == "Cast" and m.x_source is not None \
            and cast_target(consumer) == np.dtype(m.x_source.dtype):
        casts.append(consumer)  # the cast back after an fp32 compute of an fp16 input
        tail = consumer.outputs[0]
        consumer = single_consumer(tail, graph)
    elif m.x_source is not None:
        m.x_source = None  # the up-cast is not undone: keep computing on x
    m.out, m.nodes = tail, m.nodes + casts
    if consumer is not None and consumer.op == "Mul":
        weight = _per_channel(consumer, tail, n, r)
        if weight is not None:
            m.weight, m.out, m.nodes = weight, consumer.outputs[0], m.nodes + [consumer]
            consumer = single_consumer(m.out, graph)
    if with_bias and consumer is not None and consumer.op == "Add":
        bias = _per_channel(consumer, m.out, n, r)
        if bias is not None:
            m.bias, m.out, m.nodes = bias, consumer.outputs[0], m.nodes + [consumer]


def _up_cast_source(x: gs.Tensor) -> gs.Tensor | None:
    """The input of a real up-Cast (fp16/bf16 -> fp32) that produces ``x``."""
    cast = producer_op(x, "Cast")
    if cast is None or is_noop_cast(cast) or cast.inputs[0].dtype is None:
        return None
    src = np.dtype(cast.inputs[0].dtype)
    return cast.inputs[0] if src.kind == "f" and src.itemsize < np.dtype(x.dtype or np.float32).itemsize else None


def _not_last_axis_mean(reduce: gs.Node) -> str:
    """Why ``reduce`` is not a keepdims ReduceMean over the single last axis ("" when it is)."""
    if reduce.op != "ReduceMean":
        return "not a ReduceMean"
    if not reduces_last_axis(reduce):
        return f"ReduceMean axes {reduce_axes(reduce)} are not the single last axis with keepdims"
    return ""


def match_rms(reduce: gs.Node, graph: gs.Graph) -> NormMatch | str:
    """``x * 1/sqrt(mean(x^2) + eps) [* weight]`` rooted at the ReduceMean ``reduce``."""
    problem = _not_last_axis_mean(reduce)
    if problem:
        return problem
    x = squared_operand(producer(reduce.inputs[0]))
    if x is None:
        return "ReduceMean input is not Pow(x, 2) or Mul(x, x)"
    if _centered_source(x) is not None:
        return "squares x - mean(x): a LayerNorm variance"
    tail = _match_tail(reduce, x, graph)
    if isinstance(tail, str):
        return tail
    eps, normalized, nodes = tail
    m = NormMatch("rms", x, x, eps, reduce_axes(reduce), normalized, normalized,
                  x_source=_up_cast_source(x), nodes=[producer(reduce.inputs[0])] + nodes)
    _match_affine(m, graph, with_bias=False)
    return m


def _centered_source(v: gs.Tensor) -> gs.Tensor | None:
    """``x`` when ``v = Sub(x, ReduceMean(x))`` over the last axis."""
    sub = producer_op(v, "Sub")
    if sub is None:
        return None
    mean = producer_op(sub.inputs[1], "ReduceMean")
    if mean is None or mean.inputs[0] is not sub.inputs[0] or not reduces_last_axis(mean):
        return None
    return sub.inputs[0]


def match_layernorm(reduce: gs.Node, graph: gs.Graph) -> NormMatch | str:
    """``(x - mean(x)) / sqrt(var(x) + eps) [* gamma] [+ beta]`` rooted at the variance ReduceMean."""
    problem = _not_last_axis_mean(reduce)
    if problem:
        return problem
    v = squared_operand(producer(reduce.inputs[0]))
    x = None if v is None else _centered_source(v)
    if x is None:
        return "ReduceMean input is not the square of x - ReduceMean(x)"
    tail = _match_tail(reduce, v, graph)
    if isinstance(tail, str):
        return tail
    eps, normalized, nodes = tail
    m = NormMatch("layernorm", x, v, eps, reduce_axes(reduce), normalized, normalized,
                  x_source=_up_cast_source(x), nodes=[producer(v), producer(reduce.inputs[0])] + nodes)
    _match_affine(m, graph, with_bias=True)
    return m


def find_norms(graph: gs.Graph, kinds: tuple[str, ...] = ("rms", "layernorm")) -> tuple[list[NormMatch], list[str]]:
    """Every RMSNorm/LayerNorm pattern in ``graph``, and why other ReduceMeans are not one."""
    matches, reasons = [], []
    for node in list(graph.nodes):
        source = producer(node.inputs[0]) if node.op == "ReduceMean" else None
        if source is None or source.op not in ("Pow", "Mul"):
            continue
        v = squared_operand(source)
        if v is None:
            reasons.append(f"{node.name}: ReduceMean input is not Pow(x, 2) or Mul(x, x)")
            continue
        kind = "layernorm" if _centered_source(v) is not None else "rms"
        if kind not in kinds:
            continue
        result = (match_layernorm if kind == "layernorm" else match_rms)(node, graph)
        if isinstance(result, str):
            reasons.append(f"{node.name}: {result}")
        else:
            matches.append(result)
    return matches, reasons
