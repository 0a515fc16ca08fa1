"""Match small elementwise subgraphs by what they compute, not by how they are spelled.

GeLU is written in many equivalent ways: ``x/sqrt2`` or ``x*0.7071``, ``x*x*x`` or
``Pow(x,3)``, ``0.5*x*(1+t)`` associated and commuted in any order.  Instead of one
structural pattern per spelling, :func:`elementwise_function` turns the subgraph between
some variables and a tensor into a numpy function -- refusing anything that is not a
scalar-constant elementwise computation of exactly those variables -- and
:func:`computes` checks it against the reference formula at sample points.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.read import constant_value, producer

_BINARY: dict[str, Callable] = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Pow": np.power}
_UNARY: dict[str, Callable] = {"Neg": np.negative, "Identity": lambda a: a, "Sqrt": np.sqrt}

#: Sample points: spread over GeLU's interesting range, away from 0 (where everything is 0).
SAMPLES_X = np.array([-3.3, -1.7, -0.6, 0.35, 0.9, 2.4, 4.1])
SAMPLES_T = np.array([-0.8, 0.35, -0.1, 0.6, 0.95, 0.2, -0.45])


def _is_float_cast(node: gs.Node) -> bool:
    to = node.attrs.get("to")
    return node.op == "Cast" and to in (1, 10, 11, 16)  # float, float16, double, bfloat16


def elementwise_function(root: gs.Tensor, variables: Sequence[gs.Tensor], max_nodes: int = 12) -> Callable | None:
    """``root`` as a function of ``variables``, if only scalar constants and elementwise ops lie between."""
    index = {id(v): i for i, v in enumerate(variables)}
    budget = [max_nodes]

    def build(tensor: gs.Tensor) -> Callable | None:
        if id(tensor) in index:
            i = index[id(tensor)]
            return lambda args: args[i]
        value = constant_value(tensor, through_identity=True)
        if value is not None:
            if value.size != 1 or value.dtype.kind not in "fi":
                return None
            c = float(value.ravel()[0])
            return lambda args: c
        node = producer(tensor)
        budget[0] -= 1
        if node is None or budget[0] < 0:
            return None
        if node.op in _BINARY and len(node.inputs) == 2:
            a, b = build(node.inputs[0]), build(node.inputs[1])
            op = _BINARY[node.op]
            return None if a is None or b is None else (lambda args: op(a(args), b(args)))
        if node.op in _UNARY or _is_float_cast(node):
            a = build(node.inputs[0])
            op = _UNARY.get(node.op, lambda v: v)
            return None if a is None else (lambda args: op(a(args)))
        return None

    return build(root)


def computes(fn: Callable | None, reference: Callable, samples: Sequence[np.ndarray], rtol: float = 1e-4) -> bool:
    """``fn`` equals ``reference`` at the sample points within ``rtol * (1 + |reference|)``."""
    if fn is None:
        return False
    with np.errstate(all="ignore"):
        got = np.asarray(fn(list(samples)), dtype=np.float64)
        want = np.asarray(reference(*samples), dtype=np.float64)
    return got.shape == want.shape and bool(np.all(np.abs(got - want) <= rtol * (1.0 + np.abs(want))))


def find_variable(root: gs.Tensor, reference: Callable, max_candidates: int = 12) -> gs.Tensor | None:
    """The tensor ``x`` nearest to ``root`` such that ``root == reference(x)`` (breadth-first).

    Nearest matters: in ``Erf(Div(Add(MatMul, bias), sqrt2))`` the variable is the Add's
    output, although the subgraph is also an elementwise function of the MatMul's.
    """
    queue, seen = [root], set()
    while queue and len(seen) < max_candidates:
        tensor = queue.pop(0)
        if id(tensor) in seen or constant_value(tensor, through_identity=True) is not None:
            continue
        seen.add(id(tensor))
        if tensor is not root and computes(elementwise_function(root, [tensor]), reference, [SAMPLES_X]):
            return tensor
        node = producer(tensor)
        if node is not None and (node.op in _BINARY or node.op in _UNARY or _is_float_cast(node)):
            queue.extend(node.inputs)
    return None
