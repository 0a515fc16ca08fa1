"""attention-cleanup: drop provably dead NaN guards and make attention masks finite.

Matches, for every ``Softmax``:

(a) the NaN guard SDPA exports put after it, ``Where(IsNaN(p), 0, p)``.  Softmax yields NaN
    only for a row whose inputs are all -inf (a fully masked query row).  The guard is
    removed when mask analysis (``passes/attention/_mask.py``) proves that cannot happen:
    the softmax input is bounded below in float32 (masks of ``finfo.min`` never reach -inf
    when added to finite scores), or every row keeps a key (a folded causal or sliding-window
    mask always keeps the diagonal).  A padding mask built from an ``attention_mask`` input
    cannot be proven (left padding masks whole rows), so there the guard stays unless
    ``assume_unmasked_rows=true`` says that every query row sees at least one key.
(b) float constants at or below ``threshold`` (``-inf``, ``finfo(float32).min``, -1e9,
    ``finfo(float16).min``) that flow into the softmax input without crossing a MatMul: the
    additive mask's ``Where(cond, 0, -big)``, ``(1 - m) * -big``, ``Where(cond, s, -big)``,
    ``Max(s, finfo.min)``.  They become ``mask_value``.

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

Why (b) is safe: for every row that has at least one visible key, the masked keys' weights
were 0 before and are ``exp(-1e4 + spread) = 0`` after, in fp32 and fp16.  A *fully* masked
row (possible only for padding query positions) changes from uniform (finfo.min) or 0 (SDPA
guard on -inf) to a softmax over its raw scores: its value is meaningless either way, and
HF's own eager and SDPA paths disagree there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx_graphsurgeon as gs
from qnnpasses.passes.attention._mask import replace_mask_constants, rows_keep
from qnnpasses.ir.attention import NaNGuard, find_guard

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import (
    CASE_GIVEN,
    CASE_MASKED,
    CASE_PADDED_RIGHT,
    CASE_RANDOM,
    FINITE_MASKS,
    FOLDED,
    INT32_INDICES,
    Pass,
    PassContext,
    PassResult,
    assumes,
    register_pass,
)
from qnnpasses.passmanager.rewrite import finish, replace_all_uses


@register_pass
class AttentionCleanup(Pass):
    name = "attention-cleanup"
    summary = "Where(IsNaN(Softmax)) guards proven dead -> removed; -inf/finfo.min masks -> finite mask_value (-1e4)"
    # a fully masked row (left padding) changes from uniform to softmax(scores): meaningless either way
    contract = assumes("every query row keeps a visible key and score spreads stay below |mask_value|",
                       holds_on=(CASE_RANDOM, CASE_PADDED_RIGHT, CASE_MASKED, CASE_GIVEN))
    requires = frozenset({FOLDED, INT32_INDICES})
    ensures = frozenset({FINITE_MASKS})

    @dataclass
    class Options:
        mask_value: float = field(default=-1e4,
                                  metadata={"help": "finite value for masked scores (fp16/quantization safe)"})
        threshold: float = field(default=-3e4, metadata={"help": "mask constants at or below this become mask_value"})
        assume_unmasked_rows: bool = field(default=False, metadata={
            "help": "every query row sees at least one key (no all-padding prefix): NaN guards may go"})
        remove_guards: bool = field(default=True, metadata={"help": "remove NaN guards where allowed"})
        finite_masks: bool = field(default=True, metadata={"help": "replace -inf/huge negative mask constants"})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        if not -65504 < self.options.mask_value or self.options.mask_value <= self.options.threshold:
            raise ValueError(f"mask_value must lie above -65504 (fp16) and above threshold ({self.options.threshold})")
        softmaxes = [n for n in ir.graph.nodes if n.op == "Softmax"]
        notes: list[str] = []
        removed, kept = self._guards(ir, softmaxes, notes) if self.options.remove_guards else (0, 0)
        constants, values = (replace_mask_constants(ir, ctx, softmaxes, self.options.mask_value, self.options.threshold)
                             if self.options.finite_masks else (0, 0))
        if removed or constants:
            finish(ir)
        stats = {"nan_guards_removed": removed, "nan_guards_kept": kept, "mask_constants_replaced": constants,
                 "mask_values_replaced": values}
        return PassResult(changed=bool(removed or constants), stats=stats, notes=notes if ctx.verbose else [])

    # ------------------------------------------------------------------ (a) NaN guards

    def _guards(self, ir: IRModel, softmaxes: list[gs.Node], notes: list[str]) -> tuple[int, int]:
        removed = kept = 0
        for softmax in softmaxes:
            guard = find_guard(softmax)
            if guard is None:
                continue
            if self.options.assume_unmasked_rows or rows_keep(softmax.inputs[0]):
                _drop_guard(ir, guard)
                removed += 1
            else:
                kept += 1
                notes.append(f"kept NaN guard after '{softmax.name}': a mask row may be fully -inf "
                             "(padding from an input); set assume_unmasked_rows=true if every row sees a key")
        return removed, kept

def _drop_guard(ir: IRModel, guard: NaNGuard) -> None:
    """Consumers of ``Where(IsNaN(p), 0, p)`` read ``p`` again; the guard is left dead."""
    probs = guard.where.inputs[2]
    replace_all_uses(ir.graph, guard.where.outputs[0], probs)
