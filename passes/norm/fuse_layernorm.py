"""fuse-layernorm: decomposed LayerNorm => one ``LayerNormalization`` (opset 17).

Matches ``ReduceMean(x) -> Sub(x, mean) -> Pow(.,2)|Mul(d,d) -> ReduceMean -> Add(eps) ->
Sqrt -> Div(d, .)`` (or ``Reciprocal``/``Div(1,.)`` then ``Mul(d, .)``), then optional
per-channel ``Mul(gamma)`` and ``Add(beta)`` in either operand order, no-op Casts, and an
fp32 compute of an fp16 input with the cast back.  Both means must be over the last axis
with keepdims (axes as attribute before opset 18, as input after).  This is what the
TorchScript exporter writes for ``nn.LayerNorm`` below opset 17, and what hand-written
norms (T5-style, custom modules) look like at any opset.

Produces ``LayerNormalization(x, gamma|ones, beta?, axis=-1, epsilon=eps)``.  Why: the HTP
runs LayerNormalization natively (measured: one ``LayerNorm`` op, fp16-safe for |x| =
30,000), while the decomposed form squares ``x - mean`` and overflows fp16 for |d| > 256.
``when=supported`` (default) fuses only what the HTP's LayerNorm runs (last axis, rank <=
4); ``when=always`` fuses every match.  The opset is raised to 17 when lower (if safe).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from qnnpasses.op_support.capability import htp_runs_norm
from qnnpasses.passes.norm._graph import Replacements, rank, static_dim
from qnnpasses.passes.norm._match import NormMatch, find_norms
from qnnpasses.passes.norm._opset import fuse_at_opset

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import EXACT, FOLDED, NORMS_FUSED, Pass, PassContext, PassResult, register_pass
from qnnpasses.passmanager.rewrite import make_constant, make_node

LAYERNORM_OPSET = 17


@register_pass
class FuseLayerNorm(Pass):
    name = "fuse-layernorm"
    anchor_ops = frozenset({"ReduceMean"})
    summary = "ReduceMean->Sub->Pow->ReduceMean->Add(eps)->Sqrt->Div[->Mul(g)->Add(b)] => LayerNormalization"
    contract = EXACT
    requires = frozenset({FOLDED})
    ensures = frozenset({NORMS_FUSED})

    @dataclass
    class Options:
        when: str = field(default="supported", metadata={"help": "supported (only what HTP LayerNorm runs) | always"})
        raise_opset: bool = field(default=True, metadata={"help": "raise the model opset to 17 when lower (if safe)"})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        if self.options.when not in ("supported", "always"):
            raise ValueError(f"fuse-layernorm: when must be supported or always (got {self.options.when!r})")
        matches, reasons = find_norms(ir.graph, kinds=("layernorm",))
        notes = list(reasons) if ctx.verbose else []
        refusals = [(m, self._why_not(m)) for m in matches]
        fusable = [m for m, why in refusals if not why]
        notes += [f"{m.normalized.name}: {why}" for m, why in refusals if why]
        stats = {"fused": 0, "not_fused": len(matches) - len(fusable)}
        if not fusable:
            return PassResult(changed=False, stats=stats, notes=notes)
        return fuse_at_opset(ir, ctx, fusable, _fuse, opset=LAYERNORM_OPSET, allow_raise=self.options.raise_opset,
                             stats=stats, notes=notes)

    def _why_not(self, m: NormMatch) -> str:
        if self.options.when == "supported" and not htp_runs_norm(-1, rank(m.x)):
            return f"rank {rank(m.x)} unknown or too high for the HTP LayerNorm (decomposed form kept)"
        if m.weight is None and static_dim(m.x, -1) is None:
            return "last dim unknown and no gamma"
        if m.x_source is None and m.out.dtype is not None and m.x.dtype is not None and np.dtype(m.out.dtype) != np.dtype(m.x.dtype):
            return "output dtype differs from the input's"
        return ""


def _fuse(ir: IRModel, ctx: PassContext, m: NormMatch, rewired: Replacements) -> None:
    x = rewired.resolve(m.x_source if m.x_source is not None else m.x)
    dtype = np.dtype(m.out.dtype or np.float32)
    gamma = m.weight if m.weight is not None else np.ones(static_dim(m.x, -1), dtype=dtype)
    inputs = [x, make_constant(ir, ctx, "layernorm_gamma", gamma.astype(dtype))]
    if m.bias is not None:
        inputs.append(make_constant(ir, ctx, "layernorm_beta", m.bias.astype(dtype)))
    node = make_node(ir, ctx, "LayerNormalization", inputs, name_hint="layernorm",
                     attrs={"axis": -1, "epsilon": float(m.eps), "stash_type": 1})
    rewired.replace(m.out, node.outputs[0])
