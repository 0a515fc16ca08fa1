"""decompose-gelu: a GeLU op the target does not run => Erf-free primitives.

Matches ONNX ``Gelu`` (opset 20, both ``approximate`` values), ``com.microsoft.Gelu``,
``com.microsoft.FastGelu`` (tanh form, optional bias) and ``com.microsoft.BiasGelu``
(x + bias, exact form).  Produces

* tanh form: ``0.5*x*(1 + Tanh(sqrt(2/pi)*(x + 0.044715*x*x*x)))`` -- the definition;
* exact form: ``Relu(x) - |x|*q`` with ``q = 0.5*erfc(|x|/sqrt2)`` from Abramowitz &
  Stegun 7.1.26 (``erfc(z) = P(t)*exp(-z^2)``, ``t = 1/(1+0.3275911 z)``, |error| <= 1.5e-7),
  so no ``Erf`` (rejected by the HTP) -- equal to the exact GeLU within 1e-7*|x|, far inside
  the 1e-4 lossless tolerance.  ``x*Sigmoid(1.702x)`` would be lossy (error ~2e-2).

``when=unsupported`` (default) decomposes only what the HTP does not run natively.  Measured
with the QNN EP (fp16): ONNX ``Gelu`` and ``com.microsoft.Gelu`` run on the HTP;
``FastGelu`` and ``BiasGelu`` are rejected.  ``when=always`` decomposes every GeLU.
Every intermediate stays in fp16 range: ``x*x*x`` overflowing gives Tanh(+-inf) = +-1,
the exact result; ``exp(-z^2)`` underflows to 0 where ``q`` is below fp16 resolution, and its
argument is floored (:func:`floored_exp`: the HTP's fp16 ``Exp`` is wrong far below that, i.e.
for |x| above about 13), which moves ``|x|*q`` by under 1e-27 (it is ``|x|*P(t)*exp(-64)`` or less).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from qnnpasses.op_support.capability import htp_runs_gelu
from qnnpasses.passes.norm._graph import Replacements, binary, const, floored_exp, unary

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import EXACT, GELU_FUSED, Pass, PassContext, PassResult, register_pass
from qnnpasses.passmanager.rewrite import finish

#: (op, domain) -> approximate form.
GELU_OPS = {("Gelu", ""): None, ("Gelu", "com.microsoft"): "none", ("FastGelu", "com.microsoft"): "tanh",
            ("BiasGelu", "com.microsoft"): "none"}
#: Abramowitz & Stegun 7.1.26, times 0.5 (q = erfc/2).
_AS_P = 0.3275911
_AS_HALF_COEFFS = tuple(0.5 * a for a in (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429))


def _domain(node) -> str:
    return "" if node.domain in (None, "", "ai.onnx") else node.domain


@register_pass
class DecomposeGelu(Pass):
    name = "decompose-gelu"
    anchor_ops = frozenset(op for op, _ in GELU_OPS)
    summary = "Gelu / com.microsoft Gelu, FastGelu, BiasGelu => Tanh form or Erf-free exact form"
    contract = EXACT
    requires = frozenset({GELU_FUSED})
    ensures = frozenset()

    @dataclass
    class Options:
        when: str = field(default="unsupported", metadata={"help": "unsupported (only ops the HTP rejects) | always"})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        if self.options.when not in ("unsupported", "always"):
            raise ValueError(f"decompose-gelu: when must be unsupported or always (got {self.options.when!r})")
        rewired = Replacements(ir.graph)
        stats = {"decomposed": 0, "kept_native": 0}
        for node in [n for n in ir.graph.nodes if (n.op, _domain(n)) in GELU_OPS]:
            if self.options.when == "unsupported" and htp_runs_gelu(node.op, _domain(node)):
                stats["kept_native"] += 1
                continue
            form = GELU_OPS[(node.op, _domain(node))] or node.attrs.get("approximate", "none")
            form = form.decode() if isinstance(form, bytes) else form
            x = rewired.resolve(node.inputs[0])
            if len(node.inputs) > 1 and node.inputs[1].name:  # FastGelu / BiasGelu bias
                x = binary(ir, ctx, "Add", x, rewired.resolve(node.inputs[1]), "gelu_bias")
            y = _tanh_gelu(ir, ctx, x) if form == "tanh" else _exact_gelu(ir, ctx, x)
            rewired.replace(node.outputs[0], y)
            stats["decomposed"] += 1
        if stats["decomposed"]:
            finish(ir)
        return PassResult(changed=stats["decomposed"] > 0, stats=stats)


def _tanh_gelu(ir: IRModel, ctx: PassContext, x):
    cube = binary(ir, ctx, "Mul", binary(ir, ctx, "Mul", x, x, "gelu_sq"), x, "gelu_cube")
    inner = binary(ir, ctx, "Add", x, binary(ir, ctx, "Mul", cube, const(ir, ctx, x, 0.044715, "gelu_c"), "gelu_cubic"), "gelu_sum")
    t = unary(ir, ctx, "Tanh", binary(ir, ctx, "Mul", inner, const(ir, ctx, x, math.sqrt(2 / math.pi), "gelu_k"), "gelu_arg"), "gelu_tanh")
    half_x = binary(ir, ctx, "Mul", x, const(ir, ctx, x, 0.5, "gelu_half"), "gelu_half_x")
    return binary(ir, ctx, "Mul", half_x, binary(ir, ctx, "Add", t, const(ir, ctx, x, 1.0, "gelu_one"), "gelu_1pt"), "gelu")


def _exact_gelu(ir: IRModel, ctx: PassContext, x):
    """``Relu(x) - |x| * 0.5*erfc(|x|/sqrt2)``: x*Phi(x) for both signs of x, without Erf."""
    a = unary(ir, ctx, "Abs", x, "gelu_abs")
    z_p = binary(ir, ctx, "Mul", a, const(ir, ctx, x, _AS_P / math.sqrt(2), "gelu_p"), "gelu_pz")
    t = binary(ir, ctx, "Div", const(ir, ctx, x, 1.0, "gelu_one"),
               binary(ir, ctx, "Add", z_p, const(ir, ctx, x, 1.0, "gelu_one"), "gelu_1pz"), "gelu_t")
    poly = const(ir, ctx, x, _AS_HALF_COEFFS[-1], "gelu_a")
    for coeff in reversed(_AS_HALF_COEFFS[:-1]):  # Horner: ((a5 t + a4) t + ...) t + a1, then * t
        poly = binary(ir, ctx, "Add", binary(ir, ctx, "Mul", poly, t, "gelu_horner"), const(ir, ctx, x, coeff, "gelu_a"), "gelu_horner")
    poly = binary(ir, ctx, "Mul", poly, t, "gelu_poly")
    neg_half_sq = binary(ir, ctx, "Mul", binary(ir, ctx, "Mul", a, a, "gelu_sq"), const(ir, ctx, x, -0.5, "gelu_mhalf"), "gelu_mz2")
    q = binary(ir, ctx, "Mul", poly, floored_exp(ir, ctx, neg_half_sq, "gelu_exp"), "gelu_q")
    return binary(ir, ctx, "Sub", unary(ir, ctx, "Relu", x, "gelu_relu"), binary(ir, ctx, "Mul", a, q, "gelu_aq"), "gelu")
