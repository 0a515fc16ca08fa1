"""Which tensors may leave fp16's range: measured on calibration data, or guessed statically.

fp16 holds magnitudes in [6.1e-5, 65504] at full precision (the HTP flushes subnormals).
A square overflows as soon as |v| > 255.9 and underflows below 2^-7.  With calibration
samples, each candidate's max |v| is measured on onnxruntime CPU (the candidates are added
as extra outputs of a copy of the graph).  Without, a normalization input is presumed at
risk when it is the residual stream (a residual Add, an embedding Gather, a graph input):
that is where trained LLMs carry their "massive activations" (|h| ~ 25,000).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.model import IRModel
from qnnpasses.ir.op_kinds import LAYOUT
from qnnpasses.passmanager.probe import intermediate_values
from qnnpasses.passmanager.rewrite import constant_value, producer

#: Ops that move values around without changing them.
_TRANSPARENT = LAYOUT | {"Cast"}


def max_abs_values(ir: IRModel, names: Iterable[str], samples: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Max |value| of each named tensor over ``samples``, running a copy of the graph on CPU."""
    result: dict[str, float] = {}
    for values in intermediate_values(ir, names, samples):
        for name, value in values.items():
            value = np.abs(np.asarray(value, dtype=np.float64))
            finite = value[np.isfinite(value)]
            result[name] = max(result.get(name, 0.0), float(finite.max()) if finite.size else float("inf"))
    return result


def in_residual_stream(tensor: gs.Tensor) -> bool:
    """True when ``tensor`` is (a reshaped/cast/biased view of) a residual sum, an embedding or an input."""
    for _ in range(16):
        node = producer(tensor)
        if node is None:
            return not isinstance(tensor, gs.Constant)
        if node.op in _TRANSPARENT:
            tensor = node.inputs[0]
            continue
        variable = [t for t in node.inputs if constant_value(t, through_identity=True) is None]
        if node.op in ("Add", "Sub", "Sum") and len(variable) == 1:
            tensor = variable[0]  # a bias (or position table) added to one stream: look through it
            continue
        if node.op in ("Add", "Sum"):
            return len(variable) >= 2
        return node.op in ("Gather", "GatherND", "GatherElements") and constant_value(node.inputs[0], through_identity=True) is not None
    return False


def out_of_fp16_square_range(max_abs: float, threshold: float, underflow: float) -> bool:
    """A square of values up to ``max_abs`` overflows (with headroom) or underflows in fp16."""
    return max_abs > threshold or max_abs < underflow
