"""fuse-gelu: GeLU written with Erf or Tanh => one ``Gelu`` op.

Matches what the GeLU recognizer (:mod:`qnnpasses.ir.gelu`, shared with ``check`` and ``lint``)
finds by what the subgraph computes (any association/commutation, ``Div(x, 1.4142)`` or
``Mul(x, 0.7071)``, ``Pow(x, 3)`` or ``x*x*x``, Casts):

* ``0.5 * x * (1 + Erf(x / sqrt(2)))``                          => ``Gelu(x)``
* ``0.5 * x * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))``   => ``Gelu(x, approximate="tanh")``

checked at sample points to 1e-4 relative, so only the exact formulas fuse (lossless).

Why: the HTP rejects ``Erf`` (CPU fallback); QNN has a native ``Gelu`` and the QNN EP maps
ONNX ``Gelu`` (opset 20, both ``approximate`` values) and ``com.microsoft.Gelu`` to it
(measured: 1 node, on the HTP, fp16).  The EP has a private Erf-GeLU fusion, but only for
the spellings it knows, and the QNN converter toolchain does not share it.  Target: ONNX
``Gelu`` at opset >= 20 (raising the opset when lower and safe, see ``_norm_opset``); else
``com.microsoft.Gelu`` for the Erf form; the Tanh form is then left as is (it runs on the
HTP; ``com.microsoft.FastGelu`` does not).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qnnpasses.passes.norm._graph import Replacements
from qnnpasses.passes.norm._opset import raise_opset

from qnnpasses.ir.gelu import FORMS, GeluMatch, match_gelu
from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import EXACT, FOLDED, GELU_FUSED, Pass, PassContext, PassResult, register_pass
from qnnpasses.passmanager.rewrite import finish, make_node

GELU_OPSET = 20


@register_pass
class FuseGelu(Pass):
    name = "fuse-gelu"
    anchor_ops = frozenset(FORMS)
    summary = "0.5*x*(1+Erf(x/sqrt2)) / 0.5*x*(1+Tanh(sqrt(2/pi)(x+0.044715x^3))) => Gelu"
    contract = EXACT
    requires = frozenset({FOLDED})
    ensures = frozenset({GELU_FUSED})

    @dataclass
    class Options:
        raise_opset: bool = field(default=True, metadata={"help": "raise the model opset to 20 when lower (if safe)"})
        contrib: bool = field(default=True, metadata={"help": "fall back to com.microsoft.Gelu (Erf form) if the opset stays < 20"})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        matches, notes = [], []
        for node in [n for n in ir.graph.nodes if n.op in FORMS]:
            result = match_gelu(node, ir.graph)
            if not isinstance(result, str):
                matches.append(result)
            elif ctx.verbose:
                notes.append(f"{node.name}: {result}")
        stats = {"fused": 0, "fused_contrib": 0, "left": 0}
        if not matches:
            return PassResult(changed=False, stats=stats, notes=notes)
        before = ir.opset
        refused = raise_opset(ir, ctx, GELU_OPSET) if self.options.raise_opset else (
            None if before >= GELU_OPSET else "raise_opset=false")
        rewired = Replacements(ir.graph)
        for m in matches:
            target = _target(m, refused, self.options.contrib)
            if target is None:
                stats["left"] += 1
                continue
            domain, attrs = target
            gelu = make_node(ir, ctx, "Gelu", [rewired.resolve(m.x)], name_hint="gelu", attrs=attrs, domain=domain or None)
            rewired.replace(m.out, gelu.outputs[0])
            stats["fused_contrib" if domain else "fused"] += 1
        if refused:
            notes.append(f"opset {before} kept ({refused})")
        if ir.opset != before:
            stats["opset"] = f"{before}->{ir.opset}"
        changed = stats["fused"] + stats["fused_contrib"] > 0
        if changed:
            finish(ir)
        return PassResult(changed=changed, stats=stats, notes=notes)


def _target(m: GeluMatch, refused: str | None, contrib: bool) -> tuple[str, dict] | None:
    """(domain, attributes) of the Gelu to emit, or None to leave the pattern as it is."""
    if not refused:
        return "", {"approximate": m.approximate}
    if contrib and m.approximate == "none":
        return "com.microsoft", {}
    return None  # com.microsoft.FastGelu would leave the HTP; the Tanh form runs there as is
