"""layout family ``identity``: data-movement nodes that copy their input unchanged.

Matches: Concat operands that are empty along the concat axis (Phi-3 exports a
``Slice(x, d:)`` of size 0 as the "pass-through" part of its partial rotary, which the
HTP rejects outright: "tensor has 0 sized non-batch dimension"), a Concat or Split left
with a single operand/result, a Cast to the type its input already has, and a Cast
round trip through a type that represents every value exactly (float16->float32->float16,
bool->int64->bool, ...).  Produces: the operand itself.  Safe because each rewrite
removes a node whose output equals one of its inputs element for element.
(Identity, Dropout, identity Reshape/Transpose/Expand/Slice are the ``chains`` family's.)
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.rewrite import normalize_axis, replace_all_uses, static_shape

_FLOAT_MANTISSA = {np.dtype(np.float16): 11, np.dtype(np.float32): 24, np.dtype(np.float64): 53}


def exact_in(src: np.dtype, mid: np.dtype) -> bool:
    """Every value of ``src`` is exactly representable in ``mid`` (so Cast there and back is exact)."""
    src, mid = np.dtype(src), np.dtype(mid)
    if src == mid or src == np.bool_:
        return True
    if src.kind == "f":
        return mid.kind == "f" and mid.itemsize >= src.itemsize
    if src.kind in "iu" and mid.kind in "iu":
        if src.kind == mid.kind:
            return mid.itemsize >= src.itemsize
        return mid.kind == "i" and mid.itemsize > src.itemsize  # unsigned into a wider signed type
    if src.kind in "iu" and mid.kind == "f":
        return src.itemsize * 8 - (src.kind == "i") <= _FLOAT_MANTISSA.get(mid, 0)
    return False


def _drop_empty_operands(graph: gs.Graph, node: gs.Node) -> int:
    shapes = [static_shape(t) for t in node.inputs]
    if any(s is None for s in shapes) or len(node.inputs) < 2:
        return 0
    axis = normalize_axis(node.attrs.get("axis", 0), len(shapes[0]))
    keep = [t for t, s in zip(node.inputs, shapes) if s[axis] != 0] or [node.inputs[0]]
    if len(keep) == len(node.inputs):
        return 0
    dropped = len(node.inputs) - len(keep)
    node.inputs.clear()
    node.inputs.extend(keep)
    return dropped


def _numpy_dtype(dtype) -> bool:
    try:
        np.dtype(dtype)
        return dtype is not None
    except TypeError:
        return False


def _cast_source(node: gs.Node) -> gs.Tensor | None:
    """The tensor a Cast (or Cast round trip) reproduces exactly, if any."""
    x = node.inputs[0]
    target = node.outputs[0].dtype
    if x.dtype is None or target is None or not _numpy_dtype(x.dtype) or not _numpy_dtype(target):
        return None  # bfloat16/float8 are onnx enum values here: leave their casts alone
    if np.dtype(x.dtype) == np.dtype(target):
        return x
    inner = x.inputs[0] if x.inputs else None
    if inner is not None and inner.op == "Cast" and _numpy_dtype(inner.inputs[0].dtype):
        src = inner.inputs[0]
        if np.dtype(src.dtype) == np.dtype(target) and exact_in(src.dtype, x.dtype):
            return src
    return None


def rewrite_identity(ir: IRModel, ctx: PassContext, stats: dict, notes: list) -> int:
    graph, done = ir.graph, 0
    for node in list(graph.nodes):
        if not node.outputs or not node.inputs:
            continue
        source = None
        if node.op == "Concat":
            dropped = _drop_empty_operands(graph, node)
            if dropped:
                stats["identity_empty_operands"] = stats.get("identity_empty_operands", 0) + dropped
                done += 1
            source = node.inputs[0] if len(node.inputs) == 1 else None
        elif node.op == "Split" and len(node.outputs) == 1:
            source = node.inputs[0]
        elif node.op == "Cast":
            source = _cast_source(node)
        if source is None:
            continue
        replace_all_uses(graph, node.outputs[0], source, via_identity=True)
        node.inputs.clear()
        node.outputs.clear()
        key = f"identity_{node.op.lower()}"
        stats[key] = stats.get(key, 0) + 1
        done += 1
    return done
