"""fold-norm-weights: the per-channel scale of an RMSNorm moves into the projections that read it.

Matches ``RMSNormalization(x, γ)`` with a constant ``γ`` that is not all ones, whose output
is read only by ``MatMul(·, W)`` with constant ``W[..., hidden, N]`` (2-D or head-major 4-D,
possibly behind reshapes that keep the hidden size last): Q/K/V and gate/up after each block's
norms, the lm_head after the final norm.  Produces ``RMSNormalization(x, 1)`` and
``W' = diag(γ)·W`` in every reader (new constants; a weight shared with another node is
not touched).

Why: ``norm(x)·γ`` feeds only ``(norm(x)·γ)·W = norm(x)·(diag(γ)·W)``, so the function is
the same up to fp32 rounding of the product.  What it is for: with ``γ = 1`` the norm
commutes with an orthogonal rotation of its input (``rotate-residual``), and the norm
output's range no longer carries ``γ``'s outliers (a trained final-norm ``γ`` can span more
than an order of magnitude).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
from qnnpasses.passes.outliers._products import scale_rows
from qnnpasses.passes.outliers._stream import NORM_OPS, norm_consumers

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import (
    EXACT,
    NORMS_FUSED,
    Pass,
    PassContext,
    PassResult,
    register_pass,
)
from qnnpasses.passmanager.rewrite import constant_value, derived_constant, make_constant


@register_pass
class FoldNormWeights(Pass):
    name = "fold-norm-weights"
    summary = "RMSNormalization(x, γ) -> MatMul(W) => RMSNormalization(x, 1) -> MatMul(diag(γ)·W)"
    contract = EXACT
    requires = frozenset({NORMS_FUSED})
    ensures = frozenset()

    @dataclass
    class Options:
        pass

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        folded, skipped, notes = 0, 0, []
        for norm in [n for n in ir.graph.nodes if n.op in NORM_OPS]:
            gamma = constant_value(norm.inputs[1]) if len(norm.inputs) > 1 else None
            if gamma is None or gamma.ndim != 1 or np.all(gamma == 1):
                continue
            readers, why = norm_consumers(ir.graph, norm, gamma.shape[0])
            if why or not readers:
                skipped += 1
                notes.append(why or f"{norm.name}: nothing reads it")
                continue
            for reader in readers:  # a recipe: a large model's projections are never all in memory
                w = reader.inputs[1]
                reader.inputs[1] = derived_constant(ir, ctx, f"{w.name}_gamma", w,
                                                    partial(scale_rows, scale=gamma.astype(np.float64)), same_shape=True)
            norm.inputs[1] = make_constant(ir, ctx, f"{norm.inputs[1].name}_ones", np.ones_like(gamma))
            folded += 1
        return PassResult(changed=folded > 0, stats={"folded": folded, "skipped": skipped},
                          notes=notes if ctx.verbose else [])
