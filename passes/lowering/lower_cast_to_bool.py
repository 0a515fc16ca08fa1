"""lower-cast-to-bool: ``Cast(x: float, to=bool)`` => ``Not(Equal(x, 0))``.

Matches a ``Cast`` to bool of a float16/float32 tensor -- onnxruntime-genai's fp16 graphs
build their attention mask that way (``Cast(1 - mask) -> Where``), and the HTP rejects the
cast (measured: the only CPU node of the builder's fp16 LLaMA, docs/genai.md).

Produces ``Not(Equal(x, 0))``, which the HTP runs.

Why safe: ONNX defines a cast to bool as ``x != 0``; NaN (not equal to 0) gives true in both,
and -0.0 equals 0 in both.

Where: after ``simplify`` (``requires folded``).  It matches by the input's dtype, which is known
only once shapes and types are inferred through the whole graph (contrib ops lowered, shapes
fixed), and a cast of a constant is folded there rather than lowered.  Nothing depends on it,
and it depends on nothing else: next to ``lower-int64`` in htp-llm is only the tie-break list.
"""

from __future__ import annotations

import numpy as np
import onnx

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import EXACT, FOLDED, Pass, PassContext, PassResult, register_pass
from qnnpasses.passmanager.rewrite import finish, make_constant, make_node

_FLOATS = (np.dtype(np.float16), np.dtype(np.float32))


@register_pass
class LowerCastToBool(Pass):
    name = "lower-cast-to-bool"
    anchor_ops = frozenset({"Cast"})
    summary = "Cast(x float, to=bool) => Not(Equal(x, 0)) (the HTP rejects the cast)"
    contract = EXACT
    requires = frozenset({FOLDED})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        lowered = 0
        for node in list(ir.graph.nodes):
            if node.op != "Cast" or int(node.attrs.get("to", 0)) != onnx.TensorProto.BOOL:
                continue
            x = node.inputs[0]
            if x.dtype is None or np.dtype(x.dtype) not in _FLOATS:
                continue
            zero = make_constant(ir, ctx, "cast_bool_zero", np.zeros((), dtype=np.dtype(x.dtype)))
            equal = make_node(ir, ctx, "Equal", [x, zero], name_hint="cast_bool_eq", dtype=np.bool_, shape=x.shape)
            node.op, node.attrs = "Not", {}  # the Cast node becomes the Not: its output keeps its name
            node.inputs.clear()
            node.inputs.append(equal.outputs[0])
            lowered += 1
        if lowered:
            finish(ir)
        return PassResult(changed=lowered > 0, stats={"lowered": lowered})
