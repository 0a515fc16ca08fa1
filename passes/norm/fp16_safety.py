"""fp16-safety: rewrite computations whose intermediates leave fp16's range on the HTP.

Matches, after the fusions have run:

* decomposed RMSNorm and LayerNorm left unfused (``Pow(v,2)|Mul(v,v) -> ReduceMean ->
  Add(eps) -> Sqrt -> Div``, v = x or x - mean(x)) whose input is at risk: the square
  overflows fp16 for |v| > 256 (trained LLMs: |h| ~ 25,000).  Rewritten into
  ``t / sqrt(mean(t^2) + eps/m)`` with ``t = v / sqrt(m)``, ``m = max(max|v|, 2^-10)`` per
  row (see ``_norm_graph.safe_normalize``): the same function, every intermediate in range.
* ``Exp(z) -> ReduceSum(axis) -> Div(Exp, sum)`` -- a softmax spelled without the
  max subtraction (``Exp`` overflows fp16 for z > 11) -- and the same with ``z = x -
  ReduceMax(x)``: replaced by ``Softmax(x, axis)``, which the HTP runs natively and stably.

The rewrite costs ~10 ops per normalization, so it is applied only where the square can
actually overflow, and every decision is explained in the pass's notes.  Risk comes from
calibration data when given (``ctx.calibration``: max |v| per candidate, measured on
onnxruntime CPU; at risk above ``threshold`` or when every value squares to a subnormal),
else from ``static``: "derived" (default) rewrites where a value-range analysis
(``_ranges``: embedding tables, bounded ops, weight norms) cannot rule out |v| > 255.9, and
leaves alone norms whose range is unknown (computed from a float graph input) or proven
small; "residual" presumes every norm of the residual stream at risk; "all"; "none".
Native ``RMSNormalization``/``LayerNormalization`` are left alone:
measured on the HTP in fp16 they stay within fp16 rounding for |x| = 30,000.  Additive
attention masks (-3.4e38) belong to ``attention-cleanup``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from qnnpasses.passes.norm._graph import (
    Replacements,
    reduce_axes,
    safe_normalize,
    set_like,
)
from qnnpasses.passes.norm._match import NormMatch, find_norms
from qnnpasses.passes.norm._ranges import Bound, RangeAnalysis, square_can_overflow
from qnnpasses.passes.norm._risk import in_residual_stream, max_abs_values, out_of_fp16_square_range

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import (
    EXACT,
    GELU_FUSED,
    NORMS_FINAL,
    NORMS_FUSED,
    Pass,
    PassContext,
    PassResult,
    register_pass,
)
from qnnpasses.passmanager.probe import calibration_samples
from qnnpasses.passmanager.rewrite import (
    finish,
    is_graph_output,
    make_node,
    producer_op,
    replace_all_uses,
    static_shape,
)


@register_pass
class FP16Safety(Pass):
    name = "fp16-safety"
    anchor_ops = frozenset({"ReduceMean", "Exp"})  # a decomposed norm's mean; a softmax's Exp
    summary = "overflow-free RMSNorm/LayerNorm variance (per-row sqrt(max) scaling); Exp/ReduceSum/Div => Softmax"
    contract = EXACT
    requires = frozenset({NORMS_FUSED, NORMS_FINAL, GELU_FUSED})
    ensures = frozenset()

    @dataclass
    class Options:
        threshold: float = field(default=64.0, metadata={"help": "calibrated max |v| above which a square is at risk (256 overflows)"})
        underflow: float = field(default=2.0**-7, metadata={"help": "calibrated max |v| below which every square is subnormal"})
        static: str = field(default="derived", metadata={"help": "without calibration: derived | residual | all | none"})
        max_samples: int = field(default=8, metadata={"help": "calibration samples to run"})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        if self.options.static not in ("derived", "residual", "all", "none"):
            raise ValueError(f"fp16-safety: static must be derived, residual, all or none (got {self.options.static!r})")
        matches, reasons = find_norms(ir.graph)
        notes = list(reasons) if ctx.verbose else []
        at_risk, why = self._at_risk(ir, ctx, matches)
        notes += why
        rewired = Replacements(ir.graph)
        for m in at_risk:
            safe = safe_normalize(ir, ctx, rewired.resolve(m.v), m.eps, m.axes, hint=f"{m.kind}_fp16safe")
            rewired.replace(m.normalized, safe)
        softmaxes = _fuse_softmaxes(ir, ctx)
        stats = {"rms_rewritten": sum(m.kind == "rms" for m in at_risk),
                 "layernorm_rewritten": sum(m.kind == "layernorm" for m in at_risk),
                 "not_at_risk": len(matches) - len(at_risk), "softmax_fused": softmaxes}
        changed = bool(at_risk) or softmaxes > 0
        if changed:
            finish(ir)
        return PassResult(changed=changed, stats=stats, notes=notes)

    def _at_risk(self, ir: IRModel, ctx: PassContext, matches: list[NormMatch]) -> tuple[list[NormMatch], list[str]]:
        samples = calibration_samples(ctx, self.options.max_samples)
        if samples:
            ranges = max_abs_values(ir, [m.v.name for m in matches], samples)
            risky = [m for m in matches if out_of_fp16_square_range(
                ranges.get(m.v.name, float("inf")), self.options.threshold, self.options.underflow)]
            return risky, [f"{m.v.name}: calibrated max |v| = {ranges.get(m.v.name, float('nan')):.4g}"
                           + (" -> rewritten" if m in risky else " -> left as is") for m in matches]
        if self.options.static == "derived":
            return _derived_risk(ir, matches)
        if self.options.static == "all":
            return matches, []
        if self.options.static == "none":
            return [], []
        risky = [m for m in matches if in_residual_stream(m.x)]
        return risky, [f"{m.x.name}: not in the residual stream, left as is" for m in matches if m not in risky]


def _derived_risk(ir: IRModel, matches: list[NormMatch]) -> tuple[list[NormMatch], list[str]]:
    """Norms whose squared operand has a derived bound above sqrt(65504), and why each decision."""
    if not matches:
        return [], []
    ranges = RangeAnalysis(ir.graph)
    for m in matches:  # |v| / sqrt(mean(v^2) + eps) <= sqrt(N): each norm bounds what follows it
        n = _reduced_size(m)
        ranges.assume(m.normalized, Bound(math.sqrt(n), f"a normalization over {n} values") if n else
                      Bound(None, f"normalization {m.normalized.name} of unknown size"))
    risky, notes = [], []
    for m in matches:
        bound = ranges.bound(m.v)
        if not bound.known:
            notes.append(f"{m.v.name}: range unknown ({bound.why}) -> left as is; calibration data would measure it")
        elif square_can_overflow(bound.value):
            risky.append(m)
            notes.append(f"{m.v.name}: derived max |v| <= {bound.value:.4g} (from {bound.why}); its square can "
                         f"overflow fp16 (> 65504) -> rewritten")
        else:
            notes.append(f"{m.v.name}: derived max |v| <= {bound.value:.4g} (from {bound.why}); square fits fp16 -> left as is")
    return risky, notes


def _reduced_size(m: NormMatch) -> int | None:
    shape = static_shape(m.v)
    if shape is None:
        return None
    return math.prod(shape[a] for a in m.axes)


def _fuse_softmaxes(ir: IRModel, ctx: PassContext) -> int:
    """``Div(Exp(z), ReduceSum(Exp(z), [a]))`` => ``Softmax(x, a)`` (z = x or x - ReduceMax(x, [a]))."""
    count = 0
    for exp in [n for n in ir.graph.nodes if n.op == "Exp"]:
        e = exp.outputs[0]
        if len(e.outputs) != 2 or is_graph_output(ir.graph, e):
            continue
        total = next((n for n in e.outputs if n.op == "ReduceSum"), None)
        div = next((n for n in e.outputs if n.op == "Div"), None)
        axes = reduce_axes(total) if total is not None else None
        if div is None or axes is None or len(axes) != 1 or int(total.attrs.get("keepdims", 1)) != 1 \
                or div.inputs[0] is not e or div.inputs[1] is not total.outputs[0]:
            continue
        rank = len(e.shape) if e.shape is not None else None
        if ir.opset < 13 and axes[0] not in (-1, (rank or 0) - 1):
            continue  # before opset 13 Softmax normalizes all dims from ``axis`` on
        x = _unshifted(exp.inputs[0], axes)
        node = make_node(ir, ctx, "Softmax", [x], name_hint="softmax", attrs={"axis": axes[0]})
        replace_all_uses(ir.graph, div.outputs[0], set_like(node.outputs[0], div.outputs[0]))
        count += 1
    return count


def _unshifted(z, axes: list[int]):
    """``x`` when ``z = Sub(x, ReduceMax(x, axes))`` (Softmax subtracts the max itself), else ``z``."""
    sub = producer_op(z, "Sub")
    rmax = producer_op(sub.inputs[1], "ReduceMax") if sub is not None else None
    if rmax is not None and rmax.inputs[0] is sub.inputs[0] and reduce_axes(rmax) == axes \
            and int(rmax.attrs.get("keepdims", 1)) == 1:
        return sub.inputs[0]
    return z
