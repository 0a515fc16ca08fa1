"""Derived value ranges: an upper bound on max |value| of a tensor, from the graph alone.

Interval arithmetic on magnitudes, walked backwards from the tensor through its producers
(memoized, iterative).  Sources of bounds: constants (max |c|), embedding tables (a
``Gather`` of a constant: max |row|), and ops whose output is bounded whatever their input
(Sigmoid, Tanh, Softmax, Erf, Clip with constant limits, native normalizations, and the
decomposed ones the caller matched and passes to :meth:`RangeAnalysis.assume`:
``|v| / sqrt(mean(v^2)) <= sqrt(N)``).  Linear ops propagate bounds
(``MatMul`` with a constant weight: ``b * max_j sum_i |W_ij|``; ``Conv`` likewise per
output channel); ops that only move data keep them.  A graph input carries no bound (its
range is the caller's), so anything computed from one is *unknown* -- except a KV-cache
input concatenated with the new keys/values, which holds earlier values of the same
projection and is bounded like them.  Unknown ops give unknown.

Every rule is a true upper bound, so "bound <= limit" proves a tensor cannot exceed the
limit; a bound above it only says that it *can*.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.passmanager.rewrite import constant_value, producer, static_shape

#: Output magnitude whatever the input.
_BOUNDED = {"Sigmoid": 1.0, "Tanh": 1.0, "Softmax": 1.0, "Erf": 1.0, "Sin": 1.0, "Cos": 1.0, "HardSigmoid": 1.0,
            "Sign": 1.0}
#: max |out| <= max |input 0|.
_KEEPS_FIRST = {"Relu", "Abs", "Neg", "Identity", "Cast", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Transpose",
                "Slice", "Split", "Expand", "Tile", "Gather", "GatherElements", "GatherND", "MaxPool", "AveragePool",
                "GlobalAveragePool", "GlobalMaxPool", "ReduceMean", "ReduceMax", "ReduceMin", "DepthToSpace",
                "SpaceToDepth", "Dropout", "Gelu", "LeakyRelu", "Floor", "Ceil", "Round", "Trilu", "CumMax"}
#: max |out| <= the largest bound of all inputs.
_KEEPS_MAX = {"Max", "Min", "Concat", "Mean"}
#: Inputs whose values (not just shapes or indices) reach the output, where not all of them do.
_DATA_INPUTS = {"Where": (1, 2), "Pad": (0, 2), "Resize": (0,), "Clip": (0,), "Gather": (0,), "GatherElements": (0,),
                "GatherND": (0,), "LayerNormalization": (0, 1, 2), "RMSNormalization": (0, 1)}
#: Ops with a propagation rule over all their inputs.
_ALL_INPUTS = _KEEPS_MAX | {"Add", "Sub", "Sum", "Mul", "Div", "Pow", "MatMul", "Gemm", "Conv", "ConvTranspose",
                            "BatchNormalization", "HardSwish", "Sqrt", "Exp", "SimplifiedLayerNormalization"}
_CACHE_INPUT = re.compile(r"past|cache", re.IGNORECASE)
_FP16_SQRT_MAX = math.sqrt(65504.0)


@dataclass
class Bound:
    """``value``: upper bound on max |x|, or None when unknown; ``why``: its source."""

    value: float | None
    why: str

    @property
    def known(self) -> bool:
        return self.value is not None


def _const_abs_max(value: np.ndarray) -> float:
    if value.size == 0 or not np.issubdtype(value.dtype, np.number):
        return 0.0
    return float(np.max(np.abs(value.astype(np.float64))))


class RangeAnalysis:
    """Upper bounds on max |x| per tensor of one graph (memoized; build one per pass run)."""

    def __init__(self, graph: gs.Graph):
        self.graph = graph
        self._memo: dict[int, Bound] = {}
        self._inputs = {id(t) for t in graph.inputs}

    def assume(self, tensor: gs.Tensor, bound: Bound) -> None:
        """Record a bound found by other means (e.g. a matched decomposed normalization's output)."""
        self._memo[id(tensor)] = bound

    def bound(self, tensor: gs.Tensor) -> Bound:
        """The bound of ``tensor`` (evaluating the producers it needs first, without recursion)."""
        stack = [tensor]
        while stack:
            t = stack[-1]
            if id(t) in self._memo:
                stack.pop()
                continue
            node = producer(t)
            pending = [node.inputs[i] for i in _data_inputs(node) if node.inputs[i].name
                       and id(node.inputs[i]) not in self._memo and constant_value(node.inputs[i]) is None]
            if pending:
                stack.extend(pending)
                continue
            self._memo[id(t)] = self._evaluate(t, node)
            stack.pop()
        return self._memo[id(tensor)]

    # ------------------------------------------------------------------ rules

    def _in(self, node: gs.Node, index: int) -> Bound:
        if index >= len(node.inputs) or not node.inputs[index].name:
            return Bound(0.0, "absent")
        t = node.inputs[index]
        value = constant_value(t)
        if value is not None:
            return Bound(_const_abs_max(value), "constant")
        return self._memo.get(id(t)) or self.bound(t)

    def _evaluate(self, t: gs.Tensor, node: gs.Node | None) -> Bound:
        value = constant_value(t)
        if value is not None:
            return Bound(_const_abs_max(value), f"constant {t.name}")
        if node is None:
            return Bound(None, f"graph input '{t.name}' (range not known statically)")
        op = node.op
        if op in _BOUNDED:
            return Bound(_BOUNDED[op], op)
        used = _data_inputs(node)
        ins = [self._in(node, i) if i in used else Bound(0.0, "not data") for i in range(len(node.inputs))]
        unknown = next((b for b in ins if not b.known), None)
        if op == "Gather" and ins[0].known:
            return Bound(ins[0].value, ins[0].why if ins[0].why != "constant" else f"table {node.inputs[0].name}")
        if op == "Concat":
            return self._concat(node, ins)
        if op == "Clip":
            return self._clip(node, ins)
        if op in ("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization"):
            return self._native_norm(node, ins)
        if unknown is not None:
            return unknown
        b = [x.value for x in ins]
        why = ins[0].why if ins else op
        if op in _KEEPS_FIRST:
            return Bound(b[0], why)
        if op in _KEEPS_MAX:
            return Bound(max(b), why)
        if op in ("Add", "Sub", "Sum"):
            return Bound(sum(b), why)
        if op == "Mul":
            return Bound(math.prod(b), why)
        if op == "Where":
            return Bound(max(b[1:]), why)
        if op == "HardSwish":
            return Bound(max(b[0], 0.375), why)
        if op == "Sqrt":
            return Bound(math.sqrt(b[0]), why)
        if op == "Exp":
            return Bound(math.exp(min(b[0], 700.0)), why)
        if op == "Div":
            divisor = constant_value(node.inputs[1])
            if divisor is not None and divisor.size and np.all(divisor != 0):
                return Bound(b[0] / float(np.min(np.abs(divisor.astype(np.float64)))), why)
            return Bound(None, f"{op} {node.name} by a computed value")
        if op == "Pow":
            exponent = constant_value(node.inputs[1])
            if exponent is not None and exponent.size == 1 and float(exponent.ravel()[0]) > 0:
                return Bound(b[0] ** float(exponent.ravel()[0]), why)
        if op in ("MatMul", "Gemm"):
            return self._matmul(node, ins)
        if op in ("Conv", "ConvTranspose"):
            return self._conv(node, ins)
        if op == "BatchNormalization":
            return self._batchnorm(node, ins)
        if op == "Resize":
            mode = node.attrs.get("mode", "nearest")
            mode = mode.decode() if isinstance(mode, bytes) else mode
            return Bound(b[0] * (1.0 if mode in ("nearest", "linear") else 1.5), why)
        if op == "Pad":
            return Bound(max(b[0], b[2] if len(b) > 2 else 0.0), why)
        return Bound(None, f"{op} {node.name} (no range rule)")

    def _concat(self, node: gs.Node, ins: list[Bound]) -> Bound:
        known = [b for b in ins if b.known]
        cache = [t for t, b in zip(node.inputs, ins) if not b.known and id(t) in self._inputs and _CACHE_INPUT.search(t.name)]
        if known and len(known) + len(cache) == len(ins):  # the cache holds earlier values of the same tensor
            return Bound(max(b.value for b in known), known[0].why)
        return next((b for b in ins if not b.known), Bound(max((b.value for b in known), default=0.0), "Concat"))

    def _clip(self, node: gs.Node, ins: list[Bound]) -> Bound:
        lo = constant_value(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1].name else node.attrs.get("min")
        hi = constant_value(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2].name else node.attrs.get("max")
        if lo is not None and hi is not None:
            return Bound(max(abs(float(np.asarray(lo).ravel()[0])), abs(float(np.asarray(hi).ravel()[0]))), "Clip")
        return ins[0]

    def _native_norm(self, node: gs.Node, ins: list[Bound]) -> Bound:
        axis = int(node.attrs.get("axis", -1))
        shape = static_shape(node.inputs[0])
        if shape is None or not ins[1].known or (len(ins) > 2 and not ins[2].known):
            return Bound(None, f"{node.op} {node.name} of unknown size or scale")
        n = math.prod(shape[axis:]) if axis < 0 else math.prod(shape[axis:])
        bias = ins[2].value if len(ins) > 2 else 0.0
        return Bound(math.sqrt(n) * ins[1].value + bias, f"{node.op} over {n} values")

    def _matmul(self, node: gs.Node, ins: list[Bound]) -> Bound:
        a, b = ins[0].value, ins[1].value
        weight = constant_value(node.inputs[1])
        if node.op == "Gemm":
            alpha, beta = float(node.attrs.get("alpha", 1.0)), float(node.attrs.get("beta", 1.0))
            c = ins[2].value if len(ins) > 2 else 0.0
            if weight is not None and weight.ndim == 2:
                w = weight.T if int(node.attrs.get("transB", 0)) else weight
                if not int(node.attrs.get("transA", 0)):
                    return Bound(abs(alpha) * a * _max_column_l1(w) + abs(beta) * c, ins[0].why)
            k = _contraction(node.inputs[1], int(node.attrs.get("transB", 0)) == 0)
            return Bound(abs(alpha) * a * b * k + abs(beta) * c, ins[0].why) if k else Bound(None, f"Gemm {node.name}")
        if weight is not None and weight.ndim >= 2:
            return Bound(a * _max_column_l1(weight), ins[0].why)
        first = producer(node.inputs[0])
        if first is not None and first.op == "Softmax" and int(first.attrs.get("axis", -1)) in (-1, len(first.inputs[0].shape or [0]) - 1):
            return Bound(b, ins[1].why)  # rows of convex weights: a convex combination of the rows of b
        k = _contraction(node.inputs[1], True)
        return Bound(a * b * k, ins[0].why) if k else Bound(None, f"MatMul {node.name} of unknown size")

    def _conv(self, node: gs.Node, ins: list[Bound]) -> Bound:
        weight = constant_value(node.inputs[1])
        if weight is None:
            return Bound(None, f"{node.op} {node.name} with a computed weight")
        w = np.abs(weight.astype(np.float64))
        per_out = w.sum(axis=tuple(i for i in range(w.ndim) if i != (0 if node.op == "Conv" else 1)))
        bias = ins[2].value if len(ins) > 2 else 0.0
        return Bound(ins[0].value * float(per_out.max(initial=0.0)) + bias, ins[0].why)

    def _batchnorm(self, node: gs.Node, ins: list[Bound]) -> Bound:
        values = [constant_value(t) for t in node.inputs[1:5]]
        if any(v is None for v in values):
            return Bound(None, f"BatchNormalization {node.name} with computed statistics")
        scale, bias, mean, var = (v.astype(np.float64) for v in values)
        eps = float(node.attrs.get("epsilon", 1e-5))
        per = np.abs(scale) / np.sqrt(var + eps) * (ins[0].value + np.abs(mean)) + np.abs(bias)
        return Bound(float(per.max(initial=0.0)), ins[0].why)


def _data_inputs(node: gs.Node | None) -> tuple[int, ...]:
    """Indices of the inputs whose bounds the rule for ``node`` reads."""
    if node is None or node.op == "Constant" or node.op in _BOUNDED:
        return ()
    if node.op in _DATA_INPUTS:
        return tuple(i for i in _DATA_INPUTS[node.op] if i < len(node.inputs))
    if node.op in _KEEPS_FIRST:
        return (0,) if node.inputs else ()
    if node.op in _ALL_INPUTS:
        return tuple(range(len(node.inputs)))
    return ()


def _max_column_l1(weight: np.ndarray) -> float:
    """max over output columns j of sum_i |W[..., i, j]|: the gain of ``x @ W`` in max-norm."""
    return float(np.abs(weight.astype(np.float64)).sum(axis=-2).max(initial=0.0))


def _contraction(b: gs.Tensor, rows: bool) -> int | None:
    shape = static_shape(b)
    if shape is None or len(shape) < 2:
        return None
    return shape[-2] if rows else shape[-1]


def square_can_overflow(bound: float) -> bool:
    """Whether values up to ``bound`` can square past fp16's largest finite value (65504)."""
    return bound > _FP16_SQRT_MAX
