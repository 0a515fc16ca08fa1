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
from qnnpasses.passes.norm._graph import const_value

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.rewrite import producer

#: Ops that move values around without changing them.
_TRANSPARENT = ("Cast", "Identity", "Reshape", "Squeeze", "Unsqueeze", "Transpose", "Flatten")


def calibration_samples(ctx, limit: int) -> list[dict[str, np.ndarray]]:
    """Up to ``limit`` input dicts from ``ctx.calibration``, keeping a one-shot iterable reusable."""
    if ctx.calibration is None:
        return []
    if not isinstance(ctx.calibration, (list, tuple)):
        ctx.calibration = list(ctx.calibration)  # later passes must still see every sample
    return list(ctx.calibration[:limit])


def max_abs_values(ir: IRModel, names: Iterable[str], samples: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Max |value| of each named tensor over ``samples``, running a copy of the graph on CPU."""
    from qnnpasses.backends.cpu import run_cpu

    probe = ir.copy()
    tensors = probe.graph.tensors()
    wanted = [tensors[n] for n in dict.fromkeys(names) if n in tensors and tensors[n].dtype is not None]
    probe.graph.outputs = list(probe.graph.outputs) + [t for t in wanted if t not in probe.graph.outputs]
    result = {t.name: 0.0 for t in wanted}
    for sample in samples:
        outputs = run_cpu(probe, sample)
        for t in wanted:
            value = np.abs(np.asarray(outputs[t.name], dtype=np.float64))
            finite = value[np.isfinite(value)]
            result[t.name] = max(result[t.name], float(finite.max()) if finite.size else float("inf"))
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
        variable = [t for t in node.inputs if const_value(t) is None]
        if node.op in ("Add", "Sub", "Sum") and len(variable) == 1:
            tensor = variable[0]  # a bias (or position table) added to one stream: look through it
            continue
        if node.op in ("Add", "Sum"):
            return len(variable) >= 2
        return node.op in ("Gather", "GatherND", "GatherElements") and const_value(node.inputs[0]) is not None
    return False


def out_of_fp16_square_range(max_abs: float, threshold: float, underflow: float) -> bool:
    """A square of values up to ``max_abs`` overflows (with headroom) or underflows in fp16."""
    return max_abs > threshold or max_abs < underflow
