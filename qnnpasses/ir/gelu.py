"""The GeLU recognizer: ``fuse-gelu``, ``check``'s model of the EP's Erf-GeLU fusion and ``lint``
all read it, so they cannot disagree on a node.

A GeLU is found from its ``Erf`` or ``Tanh`` by what the subgraph around it computes
(:mod:`qnnpasses.ir.signature`: any association / commutation, ``Div(x, 1.4142)`` or
``Mul(x, 0.7071)``, ``Pow(x, 3)`` or ``x*x*x``, Casts), checked at sample points:

* ``0.5 * x * (1 + Erf(x / sqrt(2)))``                          (exact GeLU)
* ``0.5 * x * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))``   (its tanh approximation)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.read import single_consumer
from qnnpasses.ir.signature import SAMPLES_T, SAMPLES_X, computes, elementwise_function, find_variable

_OUTER_OPS = ("Add", "Sub", "Mul", "Div", "Cast", "Identity")  # what 0.5*x*(1+t) is written with


def _erf_arg(x):
    return x / math.sqrt(2.0)


def _tanh_arg(x):
    return math.sqrt(2.0 / math.pi) * (x + 0.044715 * np.power(x, 3))


def _outer(x, t):
    return 0.5 * x * (1.0 + t)


FORMS = {"Erf": ("none", _erf_arg), "Tanh": ("tanh", _tanh_arg)}


@dataclass
class GeluMatch:
    x: gs.Tensor  # the GeLU's input
    out: gs.Tensor  # the tensor the pattern computes: 0.5*x*(1+t)
    approximate: str  # "none" (Erf) | "tanh"


def match_gelu(node, graph) -> GeluMatch | str:
    """The GeLU around an ``Erf``/``Tanh`` node, or why there is none."""
    approximate, inner = FORMS[node.op]
    x = find_variable(node.inputs[0], inner)
    if x is None:
        return f"{node.op} argument is not {'x/sqrt(2)' if node.op == 'Erf' else 'sqrt(2/pi)(x+0.044715x^3)'}"
    t, tensor = node.outputs[0], node.outputs[0]
    for _ in range(4):
        consumer = single_consumer(tensor, graph)
        if consumer is None or consumer.op not in _OUTER_OPS:
            break
        tensor = consumer.outputs[0]
        if computes(elementwise_function(tensor, [x, t]), _outer, [SAMPLES_X, SAMPLES_T]):
            return GeluMatch(x, tensor, approximate)
    return f"{node.op} output does not become 0.5*x*(1+{node.op.lower()}(...))"
