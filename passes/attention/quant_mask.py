"""quant-mask: the additive attention mask shrunk to the smallest value that still masks, for quantization.

Matches what ``attention-cleanup`` matches: float constants at or below ``threshold`` in the
mask cone of every ``Softmax`` input (``Where(cond, 0, -1e4)``, ``(1 - m) * -1e4``, a folded
causal mask).  They become ``-M`` with

    M = ceil(max score spread + margin)

where the score spread is ``max - min`` of the *unmasked* softmax inputs of one row,
measured on calibration data (``ctx.calibration``) on onnxruntime CPU (entries below
``threshold / 2`` count as masked).  Without calibration ``M = fallback``.

Why: in a QDQ graph the masked scores ``s + mask`` are one quantized tensor, so its range
is ``[min s - M, max s]``.  With the exported finfo.min the scale is infinite (the HTP
refuses the graph, error 6007); with attention-cleanup's -1e4 a uint8 step is 39 and a
uint16 step 0.15 -- coarser than the scores themselves on an 8-bit grid.  ``M = spread +
20`` costs about one bit instead of seven to ten.

Why it is safe: in a row with at least one visible key, a masked key had weight at most
``exp(-1e4 + spread)`` before and has at most ``exp(-margin) = 2e-9`` (margin 20) relative
to the row's largest weight after: below float32 rounding of the probabilities.  A row whose
keys are all masked gets ``softmax(s - M)`` = ``softmax(s)`` either way (a constant shift).
The rewrite is attention-cleanup's (``_mask.replace_mask_constants``: same matcher, same replacement).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from qnnpasses.passes.attention._mask import replace_mask_constants

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import (
    CASE_GIVEN,
    CASE_MASKED,
    CASE_PADDED_RIGHT,
    CASE_RANDOM,
    FINITE_MASKS,
    Pass,
    PassContext,
    PassResult,
    assumes,
    register_pass,
)
from qnnpasses.passmanager.probe import calibration_samples, intermediate_values
from qnnpasses.passmanager.rewrite import finish


@register_pass
class QuantMask(Pass):
    name = "quant-mask"
    anchor_ops = frozenset({"Softmax"})
    summary = "attention mask -1e4/finfo.min => -(calibrated score spread + margin): small range for QDQ"
    # Not verified on CASE_PADDED_LEFT: a causal model's left-padded query rows see no key at all;
    # there the causal and padding masks add up unevenly (-M vs -2M), so those rows -- outputs
    # every consumer discards -- change.
    contract = assumes("unmasked score spreads stay below the calibrated spread + margin, and no query row "
                       "is fully masked", holds_on=(CASE_RANDOM, CASE_PADDED_RIGHT, CASE_MASKED, CASE_GIVEN))
    requires = frozenset({FINITE_MASKS})
    ensures = frozenset()

    @dataclass
    class Options:
        margin: float = field(default=20.0, metadata={"help": "masked keys keep weight <= exp(-margin)"})
        threshold: float = field(default=-1000.0, metadata={"help": "mask constants at or below this are masks"})
        fallback: float = field(default=500.0, metadata={"help": "M without calibration data (safe for score spreads < 480)"})
        max_samples: int = field(default=8, metadata={"help": "calibration samples to run"})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        softmaxes = [n for n in ir.graph.nodes if n.op == "Softmax"]
        if not softmaxes:
            return PassResult(changed=False, stats={"mask_constants_replaced": 0})
        spread = self._spread(ir, ctx, [n.inputs[0].name for n in softmaxes])
        magnitude = float(math.ceil(spread + self.options.margin)) if spread is not None else self.options.fallback
        replaced = 0
        if -magnitude > self.options.threshold:  # else the scores spread so far that the mask cannot shrink
            replaced = replace_mask_constants(ir, ctx, softmaxes, -magnitude, self.options.threshold).constants
            if replaced:
                finish(ir)
        stats = {"mask_constants_replaced": replaced, "mask_value": -magnitude,
                 "score_spread": round(spread, 3) if spread is not None else "uncalibrated"}
        return PassResult(changed=bool(replaced), stats=stats)

    def _spread(self, ir: IRModel, ctx: PassContext, names: list[str]) -> float | None:
        """Largest per-row spread of the unmasked softmax inputs over the calibration samples."""
        samples = calibration_samples(ctx, self.options.max_samples)
        if not samples:
            return None
        worst = 0.0
        for values in intermediate_values(ir, names, samples):
            for value in values.values():
                worst = max(worst, row_spread(value, self.options.threshold / 2))
        return worst


def row_spread(scores: np.ndarray, masked_below: float) -> float:
    """max over rows (last axis) of max - min among entries at or above ``masked_below``."""
    s = np.asarray(scores, dtype=np.float64)
    visible = np.isfinite(s) & (s >= masked_below)
    if not visible.any():
        return 0.0
    hi = np.where(visible, s, -np.inf).max(axis=-1)
    lo = np.where(visible, s, np.inf).min(axis=-1)
    rows = np.isfinite(hi) & np.isfinite(lo)
    return float((hi - lo)[rows].max()) if rows.any() else 0.0
