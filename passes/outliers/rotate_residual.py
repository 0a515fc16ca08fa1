"""rotate-residual: the residual stream of a pre-norm decoder turned by an orthogonal matrix (offline R1).

Matches the stream :func:`~qnnpasses.passes.outliers._stream.find_stream` finds: one token
embedding, residual Adds, RMSNorms with unit scale (run ``fold-norm-weights`` first) and
the projection MatMuls that read (Q/K/V, gate/up, lm_head) and write (o_proj, down_proj) it.
Produces, with an orthogonal ``R`` (``R·Rᵀ = I``):

    embedding table E  -> E·R          writers W, their biases b -> W·R, b·R
    readers W          -> Rᵀ·W         (every other node unchanged)

Why safe: every stream tensor becomes ``h·R``; ``RMSNorm(h·R) = RMSNorm(h)·R`` because
an orthogonal map keeps ``mean(h²)`` and a unit-scale norm is then linear in ``h``; readers
compute ``(norm(h)·R)·(Rᵀ·W) = norm(h)·W``.  Exact up to fp32 rounding, which the stream's
own magnitude amplifies on trained models, hence the stated tolerance (1e-3 + 1e-3·max|ref|).  Anything else
touching the stream (a graph output, a LayerNorm, a non-unit norm scale) stops the pass
before it changes a thing, with the reason.

What it is for: trained LLMs keep "massive activations" in a few channels of the stream
(tens of thousands, in one channel of the first token).  A per-tensor 16-bit range that must
hold them has a step coarser than most of the stream.  With a normalized
Hadamard ``R`` every channel gets ``±h_c/√n``: the range shrinks by up to √n (24× at 576).
This is QuaRot / SpinQuant's offline ``R1`` rotation; see :mod:`._orthogonal` for the matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from qnnpasses.passes.outliers._orthogonal import rotation
from qnnpasses.passes.outliers._stream import find_stream

from qnnpasses.errors import BadInputError
from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import (
    NORMS_FUSED,
    Pass,
    PassContext,
    PassResult,
    approximate,
    register_pass,
)
from qnnpasses.passmanager.rewrite import constant_value, make_constant


@register_pass
class RotateResidual(Pass):
    name = "rotate-residual"
    summary = "residual stream h => h·R (R orthogonal, Hadamard when one exists): embedding, writers, readers"
    contract = approximate(why="fp32 rounding of the rotated products; the stream of a trained LLM carries "
                           "|h| ~ 3e4, where one fp32 ulp is ~2e-3", atol=1e-3, rtol=1e-3, min_cosine=0.99999)
    requires = frozenset({NORMS_FUSED})
    ensures = frozenset()

    @dataclass
    class Options:
        kind: str = field(default="auto", metadata={"help": "auto (Hadamard, else Hadamard x random), hadamard, random"})
        seed: int = field(default=0, metadata={"help": "seed of the random orthogonal part"})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        stream, why = find_stream(ir.graph)
        if stream is None:
            return PassResult(changed=False, stats={"rotated": 0}, notes=[why])
        for norm in stream.norms:
            gamma = constant_value(norm.inputs[1]) if len(norm.inputs) > 1 else None
            if gamma is None or not np.all(gamma == gamma.flat[0]):
                return PassResult(changed=False, stats={"rotated": 0},
                                  notes=[f"{norm.name} has a per-channel scale: run fold-norm-weights first"])
        try:
            r, described = rotation(stream.hidden, self.options.kind, self.options.seed)
        except ValueError as exc:
            raise BadInputError(f"rotate-residual: {exc}") from None

        def turn(node, index: int, value: np.ndarray, suffix: str) -> None:
            node.inputs[index] = make_constant(ir, ctx, f"{node.inputs[index].name}_{suffix}",
                                               value.astype(constant_value(node.inputs[index]).dtype))

        for embed in stream.embeddings:
            turn(embed, 0, constant_value(embed.inputs[0]).astype(np.float64) @ r, "rot")
        for node in stream.writers:
            turn(node, 1, constant_value(node.inputs[1]).astype(np.float64) @ r, "rot")
        for node, index in stream.biases:
            turn(node, index, constant_value(node.inputs[index]).astype(np.float64) @ r, "rot")
        for node in stream.readers:
            turn(node, 1, np.matmul(r.T, constant_value(node.inputs[1]).astype(np.float64)), "rot")
        stats = {"rotated": 1, "hidden": stream.hidden, "readers": len(stream.readers),
                 "writers": len(stream.writers), "norms": len(stream.norms)}
        return PassResult(changed=True, stats=stats, notes=[f"R: {described}"])
