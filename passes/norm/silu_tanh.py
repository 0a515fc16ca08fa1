"""silu-tanh: ``x * Sigmoid(x)`` => ``h * Tanh(h) + h`` with ``h = 0.5 * x`` (same SiLU, through Tanh).

Matches a ``Mul`` of a float tensor ``x`` by ``Sigmoid(x)`` (either input order) where the
Sigmoid's only reader is that Mul — the SiLU / Swish of Llama-style MLPs as exporters write it.
With ``sigmoid=true`` every other ``Sigmoid(x)`` becomes ``0.5 * Tanh(0.5 * x) + 0.5``.

Why it is safe: ``sigmoid(x) = (1 + tanh(x/2)) / 2``, so ``x * sigmoid(x) = x/2 + (x/2) * tanh(x/2)``
exactly; the rewrite changes the rounding, not the function (fp32: a few ulps).  ``0.5 * x`` is
exact in binary floating point down to the subnormals, ``Tanh`` is bounded by 1, so nothing can
overflow where the original did not (``h * t`` is at most ``|h|``).

Why: on the QNN HTP in fp16 mode (a trained model's own activations; ``tools/probe_fp16_ops.py``,
``docs/fp16_ops.md``), ``Sigmoid`` and ``x * Sigmoid(x)`` are further from fp32 than an ideal
fp16 op and the Tanh forms close to it; and in a one-token (decode) graph the HTP fuses
``MatMul -> Sigmoid -> Mul`` into a kernel less precise still, which the Tanh form is not fused into.  Elsewhere (CPU, fp32) the two
forms are the same function, so the pass is harmless where it is not needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from qnnpasses.passes.norm._graph import Replacements, binary, const, unary

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import (
    EXACT,
    Pass,
    PassContext,
    PassResult,
    register_pass,
)
from qnnpasses.passmanager.rewrite import finish, single_consumer

FLOATS = (np.float32, np.float16, np.float64)


def _float(tensor) -> bool:
    return tensor.dtype is not None and np.dtype(tensor.dtype) in [np.dtype(t) for t in FLOATS]


def silu_mul(sigmoid, graph):
    """The ``Mul(x, Sigmoid(x))`` reading ``sigmoid``'s output, or None (with the reason) when it does not match."""
    consumer = single_consumer(sigmoid.outputs[0], graph)
    if consumer is None:
        return None, "the Sigmoid has several readers (or is a graph output)"
    if consumer.op != "Mul" or len(consumer.inputs) != 2:
        return None, f"the Sigmoid feeds {consumer.op}, not Mul"
    x = sigmoid.inputs[0]
    others = [t for t in consumer.inputs if t is not sigmoid.outputs[0]]
    if len(others) != 1 or others[0] is not x:
        return None, "the Mul's other input is not the Sigmoid's input"
    return consumer, None


@register_pass
class SiluTanh(Pass):
    name = "silu-tanh"
    anchor_ops = frozenset({"Sigmoid"})
    summary = "x*Sigmoid(x) => h*Tanh(h)+h, h=x/2 (optionally Sigmoid(x) => 0.5*Tanh(x/2)+0.5): the fp16-precise SiLU"
    contract = EXACT
    requires = frozenset()
    ensures = frozenset()

    @dataclass
    class Options:
        sigmoid: bool = field(default=False, metadata={"help": "also rewrite Sigmoids that are not part of a SiLU"})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        rewired = Replacements(ir.graph)
        stats = {"silu": 0, "sigmoid": 0, "kept": 0}
        reasons: dict[str, int] = {}
        for node in [n for n in ir.graph.nodes if n.op == "Sigmoid" and n.domain in (None, "", "ai.onnx")]:
            x = node.inputs[0]
            mul, why = silu_mul(node, ir.graph) if _float(x) else (None, "not a float tensor")
            if mul is None and not (self.options.sigmoid and _float(x)):
                stats["kept"] += 1
                reasons[why] = reasons.get(why, 0) + 1
                continue
            h = binary(ir, ctx, "Mul", rewired.resolve(x), const(ir, ctx, x, 0.5, "silu_half"), "silu_half_x")
            t = unary(ir, ctx, "Tanh", h, "silu_tanh")
            if mul is not None:
                y = binary(ir, ctx, "Add", binary(ir, ctx, "Mul", h, t, "silu_h_tanh"), h, "silu")
                rewired.replace(mul.outputs[0], y)
                stats["silu"] += 1
            else:
                half = const(ir, ctx, x, 0.5, "sigmoid_half")
                y = binary(ir, ctx, "Add", binary(ir, ctx, "Mul", t, half, "sigmoid_half_tanh"), half, "sigmoid")
                rewired.replace(node.outputs[0], y)
                stats["sigmoid"] += 1
        if stats["silu"] or stats["sigmoid"]:
            finish(ir)
        notes = [f"kept {n} Sigmoid(s): {why}" for why, n in reasons.items()]
        return PassResult(changed=bool(stats["silu"] or stats["sigmoid"]), stats=stats, notes=notes)
