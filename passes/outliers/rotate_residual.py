"""rotate-residual: the residual stream of a pre-norm decoder turned by an orthogonal matrix (offline R1).

Matches the stream :func:`~qnnpasses.passes.outliers._stream.find_stream` finds: one token
embedding (optionally times a constant, Gemma's ``sqrt(hidden)``), residual Adds, the RMSNorms
reading it, the projection MatMuls that read (Q/K/V, gate/up, lm_head) and write (o_proj,
down_proj) it, and with ``post_norms=true`` post-norms that write it (Gemma 2/3:
``RMSNorm(o_proj(·); γ)`` added into the stream).  Produces, with an orthogonal ``R``
(``R·Rᵀ = I``):

    embedding table E  -> E·R          writers W, their biases b -> W·R, b·R
    readers W          -> Rᵀ·W         (the norms that read the stream must have unit scale:
                                        run ``fold-norm-weights`` first)
    post-norm RMSNorm(x·W; γ)  -> RMSNorm(x·(W·R); 1) · (Rᵀ·diag(γ)·R)     (a new MatMul)

or, with ``unturn=true``, every weight but the embedding and the writers as it was:

    RMSNorm(h; γ)      -> RMSNorm(h·R; 1) · (Rᵀ·diag(γ))    (a new MatMul after each norm)
    post-norm RMSNorm(x; γ)  -> RMSNorm(x; γ) · R             (a new MatMul)

Why safe: every stream tensor becomes ``h·R``; ``RMSNorm(h·R) = RMSNorm(h)·R`` because
an orthogonal map keeps ``mean(h²)`` and a unit-scale norm is then linear in ``h``; readers
compute ``(norm(h)·R)·(Rᵀ·W) = norm(h)·W``, or, unturned, ``norm(h)·R·Rᵀ·diag(γ) = norm(h; γ)``.
A post-norm's per-channel ``γ`` does not commute with ``R``: ``RMSNorm(x·W·R; 1) =
RMSNorm(x·W; 1)·R``, times ``Rᵀ·diag(γ)·R`` gives ``RMSNorm(x·W; γ)·R``.  Turning the
post-norm's input by ``R`` as well (when a projection computes it for the norm alone; else the
new weight is ``diag(γ)·R``) spreads the new weight: ``diag(γ)·R`` holds ``γ`` row by row, so a
few large channels of a trained ``γ`` set every column's per-channel quantization step.
Unturned, each new weight is ``R`` with its columns scaled, which a per-channel grid takes
whole.  The price is ``hidden²`` weights per new MatMul (``stats["added_weights"]``).  Exact up
to fp32 rounding, which the stream's own magnitude amplifies on trained models, hence the
stated tolerance (1e-3 + 1e-3·max|ref|).  Anything else touching the stream (a graph output, a
LayerNorm, a non-unit scale of a norm that reads it when not unturning) stops the pass before
it changes a thing, with the reason.

Which form: folding ``γ`` into the readers puts its largest channels into every output
channel's int8 step.  Where the readers' norms carry large scales (Gemma's ``(1 + w)``), that
costs the weights more than the turn saves the stream, and ``unturn`` keeps the weights as they
were (``qnnpasses.llm.outliers.UNTURNED``; the w8a16 Gemma 3 pair: docs/llm_gemma3_270m.md).

What it is for: trained LLMs keep "massive activations" in a few channels of the stream
(tens of thousands, in one channel of the first token).  A per-tensor 16-bit range that must
hold them has a step coarser than most of the stream.  With a normalized
Hadamard ``R`` every channel gets ``±h_c/√n``: the range shrinks by up to √n (24× at 576).
This is QuaRot / SpinQuant's offline ``R1`` rotation; see :mod:`._orthogonal` for the matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import numpy as np
from qnnpasses.passes.outliers._orthogonal import rotation
from qnnpasses.passes.outliers._products import times_left, times_right
from qnnpasses.passes.outliers._stream import find_stream, trace_projection

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
from qnnpasses.passmanager.rewrite import constant_value, derived_constant, finish, make_constant, make_node


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
        post_norms: bool = field(default=False, metadata={
            "help": "also turn a stream that post-norms write (Gemma 2/3): a hidden x hidden MatMul per post-norm"})
        unturn: bool = field(default=False, metadata={
            "help": "turn the stream back after each norm (a MatMul R^T·diag(scale)) instead of in the readers' "
                    "weights: the weights stay as they were, no fold-norm-weights needed"})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        stream, why = find_stream(ir.graph)
        if stream is None:
            return PassResult(changed=False, stats={"rotated": 0}, notes=[why])
        if stream.norm_writers and not self.options.post_norms:
            return PassResult(changed=False, stats={"rotated": 0, "post_norms": len(stream.norm_writers)}, notes=[
                f"{len(stream.norm_writers)} post-norms write into the residual stream: turning it costs a "
                "hidden x hidden MatMul each (rotate-residual{post_norms=true})"])
        for norm in stream.norms if not self.options.unturn else ():
            gamma = constant_value(norm.inputs[1]) if len(norm.inputs) > 1 else None
            if gamma is None or not np.all(gamma == gamma.flat[0]):
                return PassResult(changed=False, stats={"rotated": 0},
                                  notes=[f"{norm.name} has a per-channel scale: run fold-norm-weights first"])
        try:
            r, described = rotation(stream.hidden, self.options.kind, self.options.seed)
        except ValueError as exc:
            raise BadInputError(f"rotate-residual: {exc}") from None

        def turn(node, index: int, product, suffix: str) -> None:
            """``node``'s constant input ``index`` becomes ``product(value)``, a recipe computed as it is saved."""
            tensor = node.inputs[index]
            node.inputs[index] = derived_constant(ir, ctx, f"{tensor.name}_{suffix}", tensor, product, same_shape=True)

        right = partial(times_right, m=r)
        for embed in stream.embeddings:
            turn(embed, 0, right, "rot")
        for node in stream.writers:
            turn(node, 1, right, "rot")
        for node, index in stream.biases:
            turn(node, index, right, "rot")
        if self.options.unturn:  # norm(h·R; 1)·Rᵀ·diag(γ) = norm(h; γ): the readers see what they saw
            for norm in stream.norms:
                gamma = constant_value(norm.inputs[1]).astype(np.float64).reshape(-1)
                _after(ir, ctx, norm, r.T * gamma[None, :], "unrot")
            for norm in stream.norm_writers:  # norm(x; γ)·R into the turned stream
                _after(ir, ctx, norm, r, "rot", keep_scale=True)
            spread = 0
        else:
            for node in stream.readers:
                turn(node, 1, partial(times_left, r.T), "rot")
            spread = sum(self._post_norm(ir, ctx, norm, r, turn) for norm in stream.norm_writers)
        added = len(stream.norm_writers) + (len(stream.norms) if self.options.unturn else 0)
        if added:
            finish(ir)
        stats = {"rotated": 1, "hidden": stream.hidden, "readers": len(stream.readers),
                 "writers": len(stream.writers), "norms": len(stream.norms)}
        if stream.norm_writers:
            stats.update(post_norms=len(stream.norm_writers), post_norm_inputs_turned=spread)
        if added:
            stats["added_weights"] = added * stream.hidden ** 2
        return PassResult(changed=True, stats=stats, notes=[f"R: {described}"])

    @staticmethod
    def _post_norm(ir: IRModel, ctx: PassContext, norm, r: np.ndarray, turn) -> bool:
        """``RMSNorm(x; γ)`` written into the stream -> ``RMSNorm(x; 1)·M`` with ``M = diag(γ)·R``, or
        ``Rᵀ·diag(γ)·R`` with ``x``'s projection turned by ``R`` too (True then)."""
        gamma = constant_value(norm.inputs[1]).astype(np.float64).reshape(-1)
        source, biases, _ = trace_projection(ir.graph, norm.inputs[0], r.shape[0])
        weight = gamma[:, None] * r
        if source is not None:
            right = partial(times_right, m=r)
            turn(source, 1, right, "rot")
            for node, index in biases:
                turn(node, index, right, "rot")
            weight = r.T @ weight
        _after(ir, ctx, norm, weight, "gamma_rot")
        return source is not None


def _after(ir: IRModel, ctx: PassContext, norm, weight: np.ndarray, suffix: str, keep_scale: bool = False) -> None:
    """``norm``'s readers read ``norm(x)·weight`` instead (a new MatMul, in the norm's dtype); the norm's
    scale becomes ones unless ``keep_scale``."""
    scale = constant_value(norm.inputs[1])
    if not keep_scale:
        norm.inputs[1] = make_constant(ir, ctx, f"{norm.inputs[1].name}_ones", np.ones_like(scale))
    out = norm.outputs[0]
    readers = list(out.outputs)
    matmul = make_node(ir, ctx, "MatMul", [out, make_constant(ir, ctx, f"{norm.name}_{suffix}", weight.astype(scale.dtype))],
                       name_hint=f"{norm.name}_{suffix}", dtype=out.dtype, shape=out.shape)
    for reader in readers:
        for index, x in enumerate(reader.inputs):
            if x is out:
                reader.inputs[index] = matmul.outputs[0]
