"""Mask analysis for attention-cleanup: value bounds, fully-masked rows, and the mask cone.

``bounds(t)`` is an interval ``(lo, hi)`` that holds every element of ``t``, computed from
constants and op semantics and evaluated in float32 range (a sum below -FLT_MAX is -inf,
as it is when onnxruntime adds ``finfo.min`` twice).  Scores (MatMul outputs) are assumed
finite and within ``SCORE_BOUND``; a float graph input is unbounded; booleans are [0, 1].

``rows_keep(t, level)`` proves that every row (last axis) of ``t`` holds at least one value
above ``level``: above -inf (a softmax over it is never NaN), or above a mask threshold (no
query row is fully masked).  True when ``t`` is bounded below ``level``, or for a
constant (folded causal/sliding-window) mask whose rows each keep a key, or for
``Where(cond, finite, -inf)`` whose boolean ``cond`` keeps a key in every row (a constant,
or an ``Or`` with one), or an ``Add`` of such a mask and a bounded tensor.  A padding mask
built from an ``attention_mask`` input cannot be proven: an all-padding prefix masks whole
rows.

``mask_cone(t)`` lists every (node, input index, constant) that flows into ``t`` without
crossing a MatMul: the constants an additive mask or a masking ``Where`` is built from;
``replace_mask_constants`` makes those at or below a threshold finite (attention-cleanup's
and quant-mask's rewrite) and says which softmaxes it changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.model import IRModel
from qnnpasses.ir.read import numpy_dtype
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.rewrite import constant_value, make_constant, producer

FLT_MAX = float(np.finfo(np.float32).max)
SCORE_BOUND = 1e6
UNKNOWN = (-np.inf, np.inf)
MASK_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Where", "Max", "Min", "Cast", "Identity", "Neg", "Clip", "Not", "And", "Or",
    "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Expand", "Reshape", "Unsqueeze", "Squeeze",
    "Slice", "Concat", "Tile", "Transpose", "Gather", "GatherND", "Flatten",
})
_DATA_OPS = frozenset({"Identity", "Cast", "Expand", "Reshape", "Unsqueeze", "Squeeze", "Slice", "Tile", "Transpose",
                       "Gather", "GatherND", "Flatten"})
_BOOL_OPS = frozenset({"Not", "And", "Or", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "IsNaN",
                       "IsInf"})
_ROW_PRESERVING = frozenset({"Identity", "Cast", "Expand", "Tile"})


def _f32(value: float) -> float:
    """A float64 result as float32 arithmetic would give it (overflow to +-inf)."""
    if np.isnan(value):
        return value
    return -np.inf if value < -FLT_MAX else np.inf if value > FLT_MAX else value


def _const_bounds(value: np.ndarray) -> tuple[float, float]:
    if value.size == 0:
        return UNKNOWN
    if value.dtype == np.bool_:
        return (float(value.min()), float(value.max()))
    if np.isnan(value).any():
        return UNKNOWN
    return (float(value.min()), float(value.max()))


def bounds(tensor: gs.Tensor, depth: int = 0) -> tuple[float, float]:
    """An interval holding every element of ``tensor`` (see the module docstring)."""
    value = constant_value(tensor)
    if value is not None:
        return _const_bounds(value)
    node = producer(tensor)
    if node is None:
        return _input_bounds(tensor)
    if node.op == "MatMul":  # scores: assumed, so no weight behind them is read
        return (-SCORE_BOUND, SCORE_BOUND)
    if depth > 24:
        return UNKNOWN
    inputs = [bounds(t, depth + 1) if t.name else UNKNOWN for t in node.inputs]
    return _node_bounds(node, inputs)


def _input_bounds(tensor: gs.Tensor) -> tuple[float, float]:
    dtype = numpy_dtype(tensor) or np.dtype(np.float32)  # bfloat16: a float, unbounded
    if dtype == np.bool_:
        return (0.0, 1.0)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return (float(info.min), float(info.max))
    return UNKNOWN


def _node_bounds(node: gs.Node, ins: list[tuple[float, float]]) -> tuple[float, float]:
    op = node.op
    if op == "MatMul":
        return (-SCORE_BOUND, SCORE_BOUND)
    if op in _DATA_OPS:
        return ins[0]
    if op in _BOOL_OPS:
        return (0.0, 1.0)
    if op in ("Softmax", "Sigmoid"):
        return (0.0, 1.0)
    if op == "Tanh":
        return (-1.0, 1.0)
    if op == "Concat":
        return (min(b[0] for b in ins), max(b[1] for b in ins))
    if op == "Where":
        return (min(ins[1][0], ins[2][0]), max(ins[1][1], ins[2][1]))
    if op == "Neg":
        return (-ins[0][1], -ins[0][0])
    if op in ("Max", "Min"):
        pick = max if op == "Max" else min
        return (pick(b[0] for b in ins), pick(b[1] for b in ins))
    if op == "Add":
        return (_f32(ins[0][0] + ins[1][0]), _f32(ins[0][1] + ins[1][1]))
    if op == "Sub":
        return (_f32(ins[0][0] - ins[1][1]), _f32(ins[0][1] - ins[1][0]))
    if op == "Mul":
        with np.errstate(invalid="ignore"):
            products = [a * b for a in ins[0] for b in ins[1]]
        if any(np.isnan(p) for p in products):
            return UNKNOWN
        return (_f32(min(products)), _f32(max(products)))
    if op == "Div" and ins[1][0] > 0:
        quotients = [a / b for a in ins[0] for b in ins[1]]
        return (_f32(min(quotients)), _f32(max(quotients)))
    return UNKNOWN


def finite(interval: tuple[float, float]) -> bool:
    return bool(np.isfinite(interval[0]) and np.isfinite(interval[1]))


def rows_keep(tensor: gs.Tensor, level: float = -np.inf, depth: int = 0) -> bool:
    """True when every row (last axis) of ``tensor`` provably holds a value above ``level`` (or a
    True).  ``level`` -inf: no row is all -inf (a softmax over it is never NaN); a mask
    threshold: every row keeps a key the mask leaves visible (no row is fully masked)."""
    value = constant_value(tensor)
    if value is not None:
        if value.dtype == np.bool_:
            return bool(np.all(np.any(value, axis=-1))) if value.ndim else bool(value)
        return bool(np.all(np.any(value > level, axis=-1))) if value.ndim else bool(value > level)
    if bounds(tensor)[0] > level and tensor.dtype != np.bool_:
        return True
    node = producer(tensor)
    if node is None or depth > 24:
        return False
    if node.op in _ROW_PRESERVING:
        return rows_keep(node.inputs[0], level, depth + 1)
    if node.op == "Or":
        return any(rows_keep(t, level, depth + 1) for t in node.inputs)
    if node.op == "Where":  # the kept branch is a real score, finite
        return bounds(node.inputs[1])[0] > -np.inf and rows_keep(node.inputs[0], level, depth + 1)
    if node.op == "Add":
        a, b = node.inputs
        return any(bounds(other)[0] > -np.inf and rows_keep(mask, level, depth + 1) for mask, other in ((a, b), (b, a)))
    if node.op in ("Mul", "Div") and any(_positive_scalar(t) for t in node.inputs[1 if node.op == "Div" else 0:]):
        data = next(t for t in node.inputs if not _positive_scalar(t))
        return rows_keep(data, level, depth + 1)
    return False


def _positive_scalar(tensor: gs.Tensor) -> bool:
    value = constant_value(tensor)
    return value is not None and value.size == 1 and float(value.ravel()[0]) > 0


def mask_cone(tensor: gs.Tensor, limit: int = 64) -> list[tuple[gs.Node, int, gs.Tensor]]:
    """(consumer, input index, constant) for every constant flowing into ``tensor`` without a MatMul."""
    found, stack, seen = [], [tensor], set()
    while stack and len(seen) < limit:
        node = producer(stack.pop())
        if node is None or id(node) in seen or node.op not in MASK_OPS:
            continue
        seen.add(id(node))
        for index, inp in enumerate(node.inputs):
            if constant_value(inp) is not None:
                found.append((node, index, inp))
            elif inp.name:
                stack.append(inp)
    return found


@dataclass
class MaskRewrite:
    """What ``replace_mask_constants`` changed: constants, values, and for each Softmax whose
    mask cone changed (by ``id``) the lowest value it replaced (-inf, or a finite big negative)."""

    constants: int = 0
    values: int = 0
    lowest: dict[int, float] = field(default_factory=dict)


def replace_mask_constants(ir: IRModel, ctx: PassContext, softmaxes: list[gs.Node], mask_value: float,
                           threshold: float) -> MaskRewrite:
    """Every float constant in the softmax inputs' mask cones with elements at or below
    ``threshold`` (or -inf) gets those elements set to ``mask_value``.  Call ``finish``
    afterwards when any did."""
    replaced: dict[int, tuple[gs.Tensor, float] | None] = {}  # constant -> (its finite form, its lowest value)
    out = MaskRewrite()
    cones = [(softmax, mask_cone(softmax.inputs[0])) for softmax in softmaxes]  # before any changes:
    for softmax, cone in cones:                                                 # layers share masks
        for node, index, constant in cone:
            if id(constant) not in replaced:
                new, old = _finite(ir, ctx, constant, mask_value, threshold), constant_value(constant)
                replaced[id(constant)] = None if new is None else (
                    new, float(old[np.isneginf(old) | (old <= threshold)].min()))
                out.values += 0 if new is None else int(np.count_nonzero(old != new.values))
            if replaced[id(constant)] is not None:
                new, low = replaced[id(constant)]
                out.lowest[id(softmax)] = min(low, out.lowest.get(id(softmax), np.inf))
                node.inputs[index] = new
    out.constants = sum(v is not None for v in replaced.values())
    return out


def _finite(ir: IRModel, ctx: PassContext, constant: gs.Tensor, mask_value: float, threshold: float) -> gs.Constant | None:
    value = constant_value(constant)
    if value is None or not np.issubdtype(value.dtype, np.floating):
        return None
    bad = np.isneginf(value) | (value <= threshold)
    if not bad.any():
        return None
    fixed = np.where(bad, np.asarray(mask_value, dtype=value.dtype), value).astype(value.dtype)
    return make_constant(ir, ctx, f"{constant.name or 'mask'}_finite", fixed)
