"""fuse-rmsnorm: decomposed RMSNorm => one ONNX ``RMSNormalization`` (opset 23).

Matches ``Pow(x,2)|Mul(x,x) -> ReduceMean(last axis, keepdims; axes attribute or input)
-> Add(eps) -> Sqrt -> Div(1,.)|Reciprocal -> Mul(x,.)`` (or ``Div(x, Sqrt)``), then an
optional per-channel ``Mul(weight)`` in either operand order, with no-op Casts in between
and HF's fp32 compute of an fp16 input (``Cast(up) ... Cast(back)``, fused with
``stash_type=1``).  Produces ``RMSNormalization(x, weight, axis=-1, epsilon=eps)``
(weight = ones when absent).

Why: the exported pattern squares x, and ``x^2`` overflows fp16 (65,504) as soon as
|x| > 256 -- trained LLMs carry |x| ~ 25,000 in a few residual channels, and then the HTP
output is garbage.  Measured on the HTP (fp16): ``RMSNormalization`` maps to the native
``RmsNorm`` op, runs fully on the HTP, and stays within fp16 rounding of fp32 for inputs
with |x| = 30,000 (max abs 3e-3 on unit-scale outputs); the decomposed form's error is 7e2.
onnxruntime's contrib ``SimplifiedLayerNormalization`` is not an alternative: in the default
domain the HTP runs it, but the ONNX checker rejects it (and onnxruntime does not load it as
com.microsoft); ``SkipSimplifiedLayerNormalization`` is not supported by the QNN EP.

The model's opset is raised to 23 when it is lower and that is safe (``_norm_opset``);
otherwise nothing is fused and ``fp16-safety`` makes the decomposed form overflow-free.
Safe because the fused op computes the same function (rounding-level differences only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from qnnpasses.op_support.capability import MAX_NORM_RANK, htp_runs_norm
from qnnpasses.passes.norm._graph import Replacements, rank, static_dim
from qnnpasses.passes.norm._match import NormMatch, find_norms
from qnnpasses.passes.norm._opset import fuse_at_opset

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import EXACT, FOLDED, NORMS_FUSED, Pass, PassContext, PassResult, register_pass
from qnnpasses.passmanager.rewrite import make_constant, make_node

RMS_OPSET = 23


@register_pass
class FuseRMSNorm(Pass):
    name = "fuse-rmsnorm"
    summary = "Pow(x,2)->ReduceMean->Add(eps)->Sqrt->Div/Reciprocal->Mul(x)[->Mul(w)] => RMSNormalization"
    contract = EXACT
    requires = frozenset({FOLDED})
    ensures = frozenset({NORMS_FUSED})

    @dataclass
    class Options:
        raise_opset: bool = field(default=True, metadata={"help": "raise the model opset to 23 when lower (if safe)"})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        matches, reasons = find_norms(ir.graph, kinds=("rms",))
        notes = list(reasons) if ctx.verbose else []
        refusals = [(m, _why_not(m)) for m in matches]
        fusable = [m for m, why in refusals if not why]
        notes += [f"{m.normalized.name}: {why}" for m, why in refusals if why]
        stats = {"fused": 0, "not_matched": len(reasons) + len(matches) - len(fusable)}
        if not fusable:
            return PassResult(changed=False, stats=stats, notes=notes)
        return fuse_at_opset(ir, ctx, fusable, _fuse, opset=RMS_OPSET, allow_raise=self.options.raise_opset,
                             stats=stats, notes=notes, refused_hint="; fp16-safety rewrites the decomposed form instead")


def _why_not(m: NormMatch) -> str:
    """Why a matched RMSNorm is not fused ('' when it is): the HTP's RmsNorm limits."""
    if not htp_runs_norm(-1, rank(m.x)):
        return f"input rank {rank(m.x)} is unknown or above the HTP RmsNorm's {MAX_NORM_RANK}"
    if _scale_size(m) is None:
        return "last dim unknown and no weight"
    return ""


def _scale_size(m: NormMatch) -> int | None:
    return m.weight.size if m.weight is not None else static_dim(m.x, -1)


def _fuse(ir: IRModel, ctx: PassContext, m: NormMatch, rewired: Replacements) -> None:
    """Replace the pattern's output with ``RMSNormalization``."""
    x = rewired.resolve(m.x_source if m.x_source is not None else m.x)
    out_dtype = np.dtype(m.out.dtype or np.float32)
    weight = m.weight if m.weight is not None else np.ones(_scale_size(m), dtype=out_dtype)
    scale = make_constant(ir, ctx, "rmsnorm_scale", weight.astype(out_dtype))
    node = make_node(ir, ctx, "RMSNormalization", [x, scale], name_hint="rmsnorm",
                     attrs={"axis": -1, "epsilon": float(m.eps), "stash_type": 1},
                     dtype=m.out.dtype, shape=m.out.shape)
    rewired.replace(m.out, node.outputs[0])
