"""An example plugin: removes arithmetic with a neutral constant.

``Add(x, 0)``, ``Sub(x, 0)``, ``Mul(x, 1)`` and ``Div(x, 1)`` (either operand order for
Add and Mul) compute ``x`` exactly in IEEE arithmetic, so the node can go when the
constant does not broadcast ``x`` to a larger shape or change its dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.api import (
    EXACT,
    FOLDED,
    Pass,
    PassContext,
    PassResult,
    can_replace,
    constant_value,
    finish,
    register_pass,
    replace_all_uses,
)

# op -> (neutral value, may the constant be the first operand?)
NEUTRAL = {"Add": (0.0, True), "Sub": (0.0, False), "Mul": (1.0, True), "Div": (1.0, False)}


@register_pass
class DropNeutralArithmetic(Pass):
    name = "drop-neutral-arith"
    summary = "Add(x,0) / Sub(x,0) / Mul(x,1) / Div(x,1) -> x"
    contract = EXACT                    # IEEE x+0, x*1, ... are x: verified with the tight tolerance
    requires = frozenset({FOLDED})      # after simplify: neutral constants are initializers by then
    ensures = frozenset()
    anchor_ops = frozenset(NEUTRAL)     # a graph without Add/Sub/Mul/Div has nothing to drop

    @dataclass
    class Options:
        ops: str = field(default="Add:Sub:Mul:Div", metadata={"help": "which ops to consider, ':'-separated"})

    def run(self, ir, ctx: PassContext) -> PassResult:
        wanted = set(self.options.ops.split(":"))
        removed = 0
        for node in list(ir.graph.nodes):
            kept = self._passthrough_input(node, wanted)
            if kept is None or not can_replace(ir.graph, node.outputs[0], kept):
                continue
            replace_all_uses(ir.graph, node.outputs[0], kept)
            node.outputs.clear()
            removed += 1
        if removed:
            finish(ir)
        return PassResult(changed=removed > 0, stats={"removed": removed})

    @staticmethod
    def _passthrough_input(node: gs.Node, wanted: set[str]) -> gs.Tensor | None:
        if node.op not in NEUTRAL or node.op not in wanted or len(node.inputs) != 2:
            return None
        neutral, commutes = NEUTRAL[node.op]
        candidates = [(node.inputs[0], node.inputs[1])]
        if commutes:
            candidates.append((node.inputs[1], node.inputs[0]))
        out = node.outputs[0]
        for kept, const in candidates:
            value = constant_value(const)
            if value is None or value.size == 0 or not np.all(value == neutral):
                continue
            same_shape = kept.shape is not None and out.shape is not None and list(kept.shape) == list(out.shape)
            same_dtype = kept.dtype is not None and np.dtype(kept.dtype) == np.dtype(out.dtype or kept.dtype)
            if same_shape and same_dtype:
                return kept
        return None
