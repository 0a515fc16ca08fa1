"""smooth-mlp: SmoothQuant-style scale migration inside a gated MLP (up_proj -> down_proj).

Matches ``Mul(act(gate), up) -> MatMul(·, W_down)`` where ``up = MatMul(x, W_up)`` (optionally
``+ bias``) with constant weights, the Mul's output read only by the down projection and ``up``
read only by the Mul (LLaMA / Qwen2 / Mistral / Phi-3 SwiGLU MLPs after ``htp-llm``).
Produces, per intermediate channel ``j`` with a scale ``s_j > 0``:

    W_up[:, j] / s_j,  b_up[j] / s_j,  W_down[j, :] · s_j

Why safe: the Mul is element-wise, so ``(act(g) ⊙ u/s)·(diag(s)·W) = (act(g) ⊙ u)·W``: the
same function up to fp32 rounding.  This is where a residual-stream rotation does not reach:
the MLP intermediate of the layer that creates a trained LLM's massive activation carries
values in the thousands in a few channels (the down_proj input).  SmoothQuant's choice
``s_j = max|m_j|^α / max|W_down[j,:]|^(1-α)`` (``α`` = ``alpha``) moves part of that outlier
into the down_proj weights, measured on calibration data (``ctx.calibration``); without
calibration the pass does nothing.  Note the trade: the weights' range grows where the
activation's shrinks (a bad bargain for 4-bit weights; see docs/quant_llm.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import (
    NORMS_FUSED,
    Pass,
    PassContext,
    PassResult,
    approximate,
    register_pass,
)
from qnnpasses.passmanager.probe import calibration_samples, intermediate_values
from qnnpasses.passmanager.rewrite import constant_value, is_graph_output, make_constant, producer


def _gated(graph, node) -> tuple | None:
    """(mul, up MatMul, optional bias Add) when ``node`` is a down projection of a gated MLP."""
    if node.op != "MatMul" or constant_value(node.inputs[1]) is None or constant_value(node.inputs[1]).ndim != 2:
        return None
    mul = producer(node.inputs[0])
    if mul is None or mul.op != "Mul" or len(mul.outputs[0].outputs) != 1 or is_graph_output(graph, mul.outputs[0]):
        return None
    for t in mul.inputs:
        bias, up = None, producer(t)
        if up is not None and up.op == "Add" and len(t.outputs) == 1:
            consts = [i for i, x in enumerate(up.inputs) if constant_value(x) is not None]
            if len(consts) == 1:
                bias, up = (up, consts[0]), producer(up.inputs[1 - consts[0]])
        if up is None or up.op != "MatMul" or len(t.outputs) != 1 or is_graph_output(graph, t):
            continue
        w = constant_value(up.inputs[1])
        if w is not None and w.ndim == 2 and w.shape[1] == constant_value(node.inputs[1]).shape[0] \
                and len(up.outputs[0].outputs) == 1:
            return mul, up, bias
    return None


@register_pass
class SmoothMLP(Pass):
    name = "smooth-mlp"
    summary = "Mul(act(gate), up·W_up)·W_down => Mul(act(gate), up·W_up/s)·(diag(s)·W_down), s from calibration"
    contract = approximate(why="fp32 rounding of the rescaled weights (the intermediate of a trained LLM reaches "
                               "|m| ~ 1e3)", atol=1e-3, rtol=1e-3, min_cosine=0.99999)
    requires = frozenset({NORMS_FUSED})
    ensures = frozenset()

    @dataclass
    class Options:
        alpha: float = field(default=0.5, metadata={"help": "migration strength (0: none, 1: all into weights)"})
        max_samples: int = field(default=4, metadata={"help": "calibration samples measured"})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        found = [(n, m) for n in ir.graph.nodes if (m := _gated(ir.graph, n)) is not None]
        samples = calibration_samples(ctx, self.options.max_samples)
        if not found or not samples:
            return PassResult(changed=False, stats={"smoothed": 0},
                              notes=[] if found else ["no gated MLP (Mul -> down MatMul) found"])
        peaks: dict[str, np.ndarray] = {}
        for values in intermediate_values(ir, [m[0].outputs[0].name for _, m in found], samples):
            for name, v in values.items():
                peak = np.abs(v.reshape(-1, v.shape[-1])).max(axis=0)
                peaks[name] = np.maximum(peaks.get(name, peak), peak)
        alpha, smoothed, ratios = self.options.alpha, 0, []
        for down, (mul, up, bias) in found:
            act = peaks.get(mul.outputs[0].name)
            if act is None:
                continue
            w_down = constant_value(down.inputs[1]).astype(np.float64)
            w_peak = np.abs(w_down).max(axis=1)
            s = np.where((act > 0) & (w_peak > 0), act ** alpha / np.maximum(w_peak, 1e-12) ** (1 - alpha), 1.0)
            s = np.clip(s, 1e-4, 1e4)
            w_up = constant_value(up.inputs[1])
            up.inputs[1] = make_constant(ir, ctx, f"{up.inputs[1].name}_smooth",
                                         (w_up.astype(np.float64) / s).astype(w_up.dtype))
            down.inputs[1] = make_constant(ir, ctx, f"{down.inputs[1].name}_smooth",
                                           (w_down * s[:, None]).astype(constant_value(down.inputs[1]).dtype))
            if bias is not None:
                add, index = bias
                b = constant_value(add.inputs[index])
                add.inputs[index] = make_constant(ir, ctx, f"{add.inputs[index].name}_smooth",
                                                  (b.astype(np.float64) / s).astype(b.dtype))
            ratios.append(float(act.max() / np.median(act)) if np.median(act) > 0 else 0.0)
            smoothed += 1
        stats = {"smoothed": smoothed, "worst_peak_over_median": round(max(ratios, default=0.0), 1)}
        return PassResult(changed=smoothed > 0, stats=stats)
