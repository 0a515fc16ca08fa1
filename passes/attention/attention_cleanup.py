"""attention-cleanup: drop provably dead row guards and make attention masks finite.

Matches, for every ``Softmax``:

(a) the row guard an export puts after it for query rows whose keys are all masked:
    ``Where(IsNaN(p), 0, p)`` (SDPA exports: such a row is NaN after a -inf mask) or
    ``Where(Equal(ReduceMax(bias), -inf), 0, p)`` (ONNX's Attention function).  The guard is
    removed when mask analysis (``passes/attention/_mask.py``) proves that no row is fully
    masked: the softmax input is bounded below in float32 (masks of ``finfo.min`` never reach
    -inf when added to finite scores), or every row keeps a key (a folded causal or
    sliding-window mask always keeps the diagonal), or ``assume_unmasked_rows=true`` says so.
(b) float constants at or below ``threshold`` (``-inf``, ``finfo(float32).min``, -1e9,
    ``finfo(float16).min``) that flow into the softmax input without crossing a MatMul: the
    additive mask's ``Where(cond, 0, -big)``, ``(1 - m) * -big``, ``Where(cond, s, -big)``,
    ``Max(s, finfo.min)``.  They become ``mask_value``.
(c) where (b) changed a softmax's mask and (a) could not rule out fully masked rows (a padding
    mask built from an input, a boolean mask input), such rows keep what the original gives
    them.  Guarded: the guard's 0, the guard now testing the row's largest input,
    ``ReduceMax(x) < mask_value / 2`` (IsNaN never fires on a finite mask).  Unguarded under
    ``finfo.min``: every input of such a row rounds to finfo.min, so the row is uniform; the
    softmax input is clamped, ``Max(x, mask_value / 2)``, which makes every masked input one
    value again (one op).  Unguarded under -inf the original row is NaN (no value defined):
    nothing to keep.  Not kept: rows of two finfo.min masks added (their sum overflows to -inf
    in float32, so the original's row is uniform over the keys masked once); verification
    rolls the pass back there (``assume_unmasked_rows=true`` if no such row is ever read).

Why ``mask_value = -1e4`` (measured on one attention block, S=64, on CPU and the HTP):
  * fp32 exactness: a masked key keeps weight ``exp(mask_value + spread)``; -1e4 is exact
    for any score spread below ~9,900, while -100/-50 already leak at a spread of 100
    (max abs error 4.2 / 4.6);
  * fp16 headroom: ``scores + mask`` must stay above -65,504; -1e4 leaves 55k for negative
    scores, whereas -65,000 overflows to -inf for scores below -504 (NaN for masked rows);
  * quantization: the mask sets the activation range of the masked scores.  With uint16
    activations (onnxruntime's QNN QDQ recipe) on the HTP, finfo.min gives cosine 0.11
    (the scale is 5e33, scores quantize to zero), -65,000 gives 0.9905, -1e4 0.99962 and
    -1e3 0.99984 at score spread 10; at spread 100, -1e4 is as good as -1e3 (0.99897).
    -1e4 is the smallest round value that stays exact in fp32 for any realistic spread.
    (It is also what HF BERT and GPT-2 used before finfo.min.)

Why it is safe: for every row that has at least one visible key, the masked keys' weights
were 0 before and are ``exp(-1e4 + spread) = 0`` after, in fp32 and fp16, and the row test of
(c) is false while its largest visible score stays above -5,000.  A fully masked row's
largest input is at most -1e4 + its largest score, below -5,000 while scores stay below
5,000, so (c) gives it the original's value; the clamp changes no input above -5,000.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs
from qnnpasses.passes.attention._mask import replace_mask_constants, rows_keep
from qnnpasses.ir.attention import NAN_GUARD, RowGuard, find_guard
from qnnpasses.ir.read import numpy_dtype

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import (
    CASE_CAUSAL,
    CASE_GIVEN,
    CASE_MASKED,
    CASE_PADDED_LEFT,
    CASE_PADDED_RIGHT,
    CASE_RANDOM,
    CASE_ROW_MASKED,
    FINITE_MASKS,
    FOLDED,
    INT32_INDICES,
    Pass,
    PassContext,
    PassResult,
    assumes,
    register_pass,
)
from qnnpasses.passmanager.rewrite import finish, make_constant, make_node, make_reduce, replace_all_uses


@register_pass
class AttentionCleanup(Pass):
    name = "attention-cleanup"
    summary = "row guards proven dead -> removed; -inf/finfo.min masks -> finite mask_value (-1e4), fully masked rows kept"
    contract = assumes("scores stay within +-|mask_value|/2",
                       holds_on=(CASE_RANDOM, CASE_PADDED_RIGHT, CASE_PADDED_LEFT, CASE_MASKED, CASE_ROW_MASKED,
                                 CASE_CAUSAL, CASE_GIVEN))
    # with assume_unmasked_rows the user vouches that no row is fully masked: not checked where one is
    unmasked_contract = assumes("every query row sees a key and scores stay within +-|mask_value|/2",
                                holds_on=(CASE_RANDOM, CASE_PADDED_RIGHT, CASE_MASKED, CASE_CAUSAL, CASE_GIVEN))
    requires = frozenset({FOLDED, INT32_INDICES})
    ensures = frozenset({FINITE_MASKS})

    @dataclass
    class Options:
        mask_value: float = field(default=-1e4,
                                  metadata={"help": "finite value for masked scores (fp16/quantization safe)"})
        threshold: float = field(default=-3e4, metadata={"help": "mask constants at or below this become mask_value"})
        assume_unmasked_rows: bool = field(default=False, metadata={
            "help": "every query row sees at least one key (no all-padding prefix): row guards and tests may go"})
        remove_guards: bool = field(default=True, metadata={"help": "remove row guards where allowed"})
        finite_masks: bool = field(default=True, metadata={"help": "replace -inf/huge negative mask constants"})

    def __init__(self, options=None, **values):
        super().__init__(options, **values)
        if self.options.assume_unmasked_rows:
            self.contract = self.unmasked_contract

    @property
    def masked_below(self) -> float:
        """A score at or below this is masked: the bound of the row test and of the clamp."""
        return self.options.mask_value / 2

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        if not -65504 < self.options.mask_value or self.options.mask_value <= self.options.threshold:
            raise ValueError(f"mask_value must lie above -65504 (fp16) and above threshold ({self.options.threshold})")
        softmaxes = [n for n in ir.graph.nodes if n.op == "Softmax"]
        # decided on the masks as exported (once finite, every row is bounded below):
        # rows that may be NaN (all -inf), and rows that may be fully masked (finfo.min too)
        assume = self.options.assume_unmasked_rows
        nan_rows = {id(s) for s in softmaxes if not (assume or rows_keep(s.inputs[0]))}
        open_rows = {id(s) for s in softmaxes if not (assume or rows_keep(s.inputs[0], self.masked_below))}
        guards = {id(s): find_guard(s) for s in softmaxes}
        notes: list[str] = []
        removed = kept = 0
        if self.options.remove_guards:
            for softmax in softmaxes:
                guard = guards[id(softmax)]
                # an IsNaN guard is dead when no row is all -inf; a row-maximum test (ours, once the
                # mask is finite) when no row is fully masked
                needed = nan_rows if guard is not None and guard.kind == NAN_GUARD else open_rows
                if guard is not None and id(softmax) not in needed:
                    _drop_guard(ir, guard)
                    guards[id(softmax)] = None
                    removed += 1
                elif guard is not None:
                    kept += 1
        masks = (replace_mask_constants(ir, ctx, softmaxes, self.options.mask_value, self.options.threshold)
                 if self.options.finite_masks else None)
        tested = 0
        for softmax in softmaxes:
            if masks is None or id(softmax) not in open_rows or id(softmax) not in masks.lowest:
                continue
            if self._keep_masked_rows(ir, ctx, softmax, guards[id(softmax)], masks.lowest[id(softmax)]):
                tested += 1
                notes.append(f"'{softmax.name}': rows may be fully masked (a mask from an input); they keep the "
                             "original's value (assume_unmasked_rows=true drops the row test or clamp)")
        if removed or tested or (masks is not None and masks.constants):
            finish(ir)
        stats = {"nan_guards_removed": removed, "nan_guards_kept": kept, "masked_row_tests": tested,
                 "mask_constants_replaced": masks.constants if masks else 0,
                 "mask_values_replaced": masks.values if masks else 0}
        return PassResult(changed=bool(removed or tested or (masks and masks.constants)), stats=stats,
                          notes=notes if ctx.verbose else [])

    def _keep_masked_rows(self, ir: IRModel, ctx: PassContext, softmax: gs.Node, guard: RowGuard | None,
                          lowest: float) -> bool:
        """(c), where the original gives fully masked rows a value; False where it gives NaN."""
        x = softmax.inputs[0]
        dtype = numpy_dtype(x)
        if dtype is None:  # bfloat16 scores: no row test written; verification judges the change
            return False
        masked = make_constant(ir, ctx, f"{softmax.name}_masked_below", np.asarray(self.masked_below, dtype))
        if guard is not None:  # the guard's 0, now for rows whose largest input is masked
            row_max = make_reduce(ir, ctx, "ReduceMax", x, [-1], f"{softmax.name}_row_max")
            dead = make_node(ir, ctx, "Less", [row_max, masked], name_hint=f"{softmax.name}_masked_row",
                             dtype=np.bool_).outputs[0]
            guard.where.inputs[0] = dead
            return True
        if lowest == -np.inf:  # unguarded -inf: the original row is NaN, no value to keep
            return False
        # finfo.min: every input of a fully masked row rounds to finfo.min, the row is uniform;
        # clamped at mask_value/2 every masked input is that one value again
        clamp = make_node(ir, ctx, "Max", [x, masked], name_hint=f"{softmax.name}_masked_clamp",
                          dtype=x.dtype, shape=x.shape).outputs[0]
        softmax.inputs[0] = clamp
        return True


def _drop_guard(ir: IRModel, guard: RowGuard) -> None:
    """Consumers of ``Where(test, 0, p)`` read ``p`` again; the guard is left dead."""
    probs = guard.where.inputs[2]
    replace_all_uses(ir.graph, guard.where.outputs[0], probs)
